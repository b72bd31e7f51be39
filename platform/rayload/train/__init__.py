"""Distributed training: the loop, `fit(spec)`, and the checkpoint contract.

Exports load lazily: `import rayload` stays free of torch until training is used.
"""

__all__ = ["fit", "TrainResult", "TrainingError", "load", "LoadedModel"]


def __getattr__(name: str):
    if name in ("fit", "TrainResult", "TrainingError"):
        from . import trainer

        return getattr(trainer, name)
    if name in ("load", "LoadedModel"):
        from . import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(name)
