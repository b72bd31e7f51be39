"""Model registry: short name -> CTR model class; `build_model` rebuilds one from model.json."""

from __future__ import annotations

from torch import nn

from ._inputs import InputShape
from .zoo import DCN, DLRM, MLP, DeepFM, WideDeep

__all__ = ["MODELS", "InputShape", "build_model", "model_json"]

MODELS: dict[str, type[nn.Module]] = {"mlp": MLP, "wide_deep": WideDeep, "deepfm": DeepFM, "dlrm": DLRM, "dcn": DCN}


def build_model(config: dict, shape: InputShape) -> nn.Module:
    """config: a ModelSpec dump (name, embedding_dim, hidden, bottom, dropout, batch_norm, ...)."""
    try:
        cls = MODELS[config["name"]]
    except KeyError:
        raise ValueError(f"unknown model {config['name']!r}; registered: {', '.join(MODELS)}") from None
    return cls(shape, config)


def model_json(config: dict, shape: InputShape) -> dict:
    """Everything needed to rebuild the architecture (written next to model.pt)."""
    return {"config": dict(config), "shape": shape.to_dict()}
