"""rayload: train, tune and A/B-test recommendation models on Ray from one YAML spec."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "load_spec", "preprocess", "train", "evaluate", "synth", "TrainResult", "FittedFeatures", "PreprocessResult", "SpecError", "DataError",
           "tune", "tune_function", "load_search_spec", "TuneResult", "SearchSpec", "run", "PipelineResult",
           "compress", "retrain", "CompressResult", "GateRefused", "RetrainResult", "load_checkpoint"]

import inspect as _inspect
import types as _types

from . import evaluate as _evaluate_module
from . import train as _train_package
from .errors import DataError, SpecError
from .spec import load_spec


class _CallableModule(_types.ModuleType):
    """A submodule that is also an SDK function. `rayload.train` and `rayload.evaluate` are both:
    `rayload.train(spec)` trains, and `rayload.train.checkpoint` (also as `import
    rayload.train.checkpoint as ckpt`, which a plain function in the module's place broke: that
    form of import reaches the submodule through the attribute) is the subpackage's module."""

    def __call__(self, *args, **kwargs):
        return self.__sdk_function__(*args, **kwargs)

    def __reduce__(self):  # by reference, as pickle and cloudpickle take a plain module or function
        import importlib

        return importlib.import_module, (self.__name__,)


def _callable(module: _types.ModuleType, function):
    module.__class__ = _CallableModule
    module.__sdk_function__ = function
    module.__signature__ = _inspect.signature(function)  # inspect.signature(rayload.train) is the SDK's
    module.__doc__ = f"{function.__doc__}\n\n{module.__doc__ or ''}".rstrip()  # the call first, then the module
    return module


def _job(spec, overrides=()):
    """A JobSpec, or a job spec file's path (str or os.PathLike) loaded with `overrides`."""
    import os

    if isinstance(spec, (str, os.PathLike)):
        return load_spec(os.fspath(spec), list(overrides))
    if overrides:
        raise TypeError("overrides apply to a job spec file; change a JobSpec with model_copy")
    return spec


def train(spec, address: str | None = None, evaluate_test: bool = True, *, overrides=()):
    """Preprocess and train a job spec (a JobSpec or a YAML path, with `overrides` as `--set`);
    returns a TrainResult (best checkpoint, metrics, test metrics)."""
    from .train.trainer import fit

    return fit(_job(spec, overrides), address=address, evaluate_test=evaluate_test)


train = _callable(_train_package, train)


def preprocess(spec, out: str | None = None, address: str | None = None, engine: str = "ray", on_stage=None, *, overrides=()):
    """Validate, split, fit the preprocessor and write preprocessed shards for a job spec (a
    JobSpec or a YAML path, with `overrides` as `--set`); returns a PreprocessResult (cached by
    a hash of the spec and the input files)."""
    from .data.pipeline import preprocess as run

    return run(_job(spec, overrides), out=out, address=address, engine=engine, on_stage=on_stage)


def evaluate(spec, checkpoint: str, split: str = "test", address: str | None = None, *, overrides=()):
    """Offline metrics of a checkpoint on a split ("train", "val" or "test") of a job spec's
    preprocessed data (a JobSpec or a YAML path, with `overrides` as `--set`), as `rayload
    evaluate SPEC --checkpoint PATH --split SPLIT`; returns rayload.evaluate's Metrics. For a
    dataset of your own: `from rayload.evaluate import evaluate_checkpoint`."""
    from .evaluate import evaluate_split

    return evaluate_split(_job(spec, overrides), checkpoint, split, address=address)


evaluate = _callable(_evaluate_module, evaluate)


def load_checkpoint(path: str, device: str = "cpu"):
    """A checkpoint's model (CPU unless `device`, eval mode) with its fitted features: a
    rayload.train.checkpoint.LoadedModel. `path` is a checkpoint folder (model.pt, model.json,
    features.json)."""
    from .train.checkpoint import load

    return load(path, device)


def tune(search, resume: str | None = None, address: str | None = None, overrides=()):
    """Run (or resume) a hyperparameter search from a search spec; returns a TuneResult."""
    from .tuning import tune as run

    return run(search, resume=resume, address=address, overrides=overrides)


def tune_function(fn, space: dict, **options):
    """Search any Python objective `fn(config) -> float | dict` with rayload's strategies."""
    from .tuning import tune_function as run

    return run(fn, space, **options)


def run(spec, run_id: str | None = None, overrides=(), address: str | None = None, force=()):
    """Run a pipeline spec (or any job, search or A/B spec as its own stages); returns a
    PipelineResult. `overrides` are `STAGE.field=value` items, as `rayload run --set`."""
    from .pipeline_spec import PipelineSpec, load_pipeline
    from .stages import run as run_stages

    if isinstance(spec, PipelineSpec) and overrides:  # they were dropped without a word
        raise TypeError("overrides apply to a spec file; change a PipelineSpec with model_copy")
    pipeline = spec if isinstance(spec, PipelineSpec) else load_pipeline(spec, list(overrides))
    # one stage's name as a string was split into letters ("ab": --force names no stage: ['a', 'b'])
    return run_stages(pipeline, run_id, address, (force,) if isinstance(force, str) else tuple(force))


def compress(checkpoint: str, method: str = "int8", **options):
    """An int8 or pruned copy of a checkpoint, written only if its validation AUC drops by at
    most `max_auc_drop` (else GateRefused with both AUCs); returns a CompressResult."""
    from .compression import compress as run

    return run(checkpoint, method, **options)


def retrain(spec, from_events: str, **options):
    """Retrain an A/B run's champion on its logged feedback, gate it, and write the next A/B
    spec with it as challenger; returns a RetrainResult."""
    from .retraining import retrain as run

    return run(spec, from_events, **options)


def __getattr__(name: str):
    # Ray-backed entry points import lazily so `import rayload` and spec checks stay fast.
    if name == "PreprocessResult":
        from .data import pipeline

        return pipeline.PreprocessResult
    if name == "TrainResult":
        from .train.trainer import TrainResult

        return TrainResult
    if name in ("load_search_spec", "SearchSpec"):
        from . import search_job, search_spec

        return getattr(search_job if name == "load_search_spec" else search_spec, name)
    if name == "PipelineResult":
        from .stages import PipelineResult

        return PipelineResult
    if name == "TuneResult":
        from .tuning import TuneResult

        return TuneResult
    if name in ("CompressResult", "GateRefused"):  # the README's SDK names both
        from . import compression

        return getattr(compression, name)
    if name == "RetrainResult":
        from .retraining import RetrainResult

        return RetrainResult
    if name == "synth":
        from .data.synthetic import write_synthetic

        return write_synthetic
    if name == "FittedFeatures":
        from .features import FittedFeatures

        return FittedFeatures
    raise AttributeError(f"module 'rayload' has no attribute {name!r}")
