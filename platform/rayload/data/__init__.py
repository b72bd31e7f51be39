"""The data plane: sources, validation and quarantine, splits, rebalancing, preprocessing."""

__all__ = ["preprocess", "PreprocessResult", "load_result"]


def __getattr__(name: str):
    if name in __all__:
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(name)
