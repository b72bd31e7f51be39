"""rayload: train, tune and A/B-test recommendation models on Ray from one YAML spec."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "load_spec", "preprocess", "synth", "FittedFeatures", "PreprocessResult", "SpecError", "DataError"]

from .errors import DataError, SpecError
from .spec import load_spec


def __getattr__(name: str):
    # Ray-backed entry points import lazily so `import rayload` and spec checks stay fast.
    if name in ("preprocess", "PreprocessResult"):
        from .data import pipeline

        return getattr(pipeline, name)
    if name == "synth":
        from .data.synthetic import write_synthetic

        return write_synthetic
    if name == "FittedFeatures":
        from .features import FittedFeatures

        return FittedFeatures
    raise AttributeError(f"module 'rayload' has no attribute {name!r}")
