"""Resource amounts as Ray places them, checked when a spec loads (job and search specs): Ray
refuses a GPU amount above 1 that is not whole, and any amount finer than 0.0001, but only when
the workers are placed."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import AfterValidator


def ray_quantity(value: float | None) -> float | None:
    """An amount Ray can place: no finer than 0.0001 (1.5 CPUs is one; 1e-5 is not)."""
    if value is not None and not math.isfinite(value):  # a search spec's numbers may be written .inf
        raise ValueError("must be a finite number")
    if value is not None and abs(value * 10_000 - round(value * 10_000)) > 1e-6:
        raise ValueError("Ray counts resources in steps of 0.0001")
    return value


def gpu_quantity(value: float | None) -> float | None:
    """A GPU amount Ray can place: a fraction of one GPU, or whole GPUs (1.5 is refused)."""
    value = ray_quantity(value)
    if value is not None and value > 1 and value != int(value):
        raise ValueError(f"Ray places GPUs above 1 only in whole units: use {int(value)} or {int(value) + 1}")
    return value


RayQuantity = Annotated[float, AfterValidator(ray_quantity)]
GpuQuantity = Annotated[float, AfterValidator(gpu_quantity)]
