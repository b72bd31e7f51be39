"""Resource amounts as Ray places them, checked when a spec loads (job and search specs)."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import AfterValidator


def ray_quantity(value: float | None) -> float | None:
    """A resource amount Ray can place: above 1 only whole units, and no finer than 0.0001
    (Ray refuses both, but only when the workers are placed)."""
    if value is not None and not math.isfinite(value):  # a search spec's numbers may be written .inf
        raise ValueError("must be a finite number")
    if value is not None and value > 1 and value != int(value):
        raise ValueError(f"Ray places an amount above 1 only in whole units: use {int(value)} or {int(value) + 1}")
    if value is not None and abs(value * 10_000 - round(value * 10_000)) > 1e-6:
        raise ValueError("Ray counts resources in steps of 0.0001")
    return value


RayQuantity = Annotated[float, AfterValidator(ray_quantity)]
