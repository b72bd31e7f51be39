"""rayload: train, tune and A/B-test recommendation models on Ray from one YAML spec."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "load_spec", "preprocess", "train", "evaluate", "synth", "TrainResult", "FittedFeatures", "PreprocessResult", "SpecError", "DataError"]

from . import train as _train_package  # noqa: F401  (bind the subpackage before `train` below)
from .errors import DataError, SpecError
from .spec import load_spec


def train(spec, address: str | None = None, evaluate_test: bool = True):
    """Preprocess and train a job spec; returns a TrainResult (best checkpoint, metrics, test metrics)."""
    from .train.trainer import fit

    return fit(spec, address=address, evaluate_test=evaluate_test)


def __getattr__(name: str):
    # Ray-backed entry points import lazily so `import rayload` and spec checks stay fast.
    if name in ("preprocess", "PreprocessResult"):
        from .data import pipeline

        return getattr(pipeline, name)
    if name == "TrainResult":
        from .train.trainer import TrainResult

        return TrainResult
    if name == "evaluate":
        from .evaluate import evaluate_checkpoint

        return evaluate_checkpoint
    if name == "synth":
        from .data.synthetic import write_synthetic

        return write_synthetic
    if name == "FittedFeatures":
        from .features import FittedFeatures

        return FittedFeatures
    raise AttributeError(f"module 'rayload' has no attribute {name!r}")
