"""Transfer learning: start a run from a checkpoint's weights (`train.init_from`) and keep
named parts fixed (`train.freeze`).

A frozen part keeps `requires_grad=False` (no gradient, no optimizer state, no weight decay,
so its parameters stay bit-identical) and runs in eval mode during training: its batch-norm
statistics do not move and its dropout is off, as a fixed feature extractor should.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..errors import RayloadError

# freeze name -> the model attributes that hold that part, across the registered models
PARTS = {
    "embeddings": ("embed",),
    "first_order": ("wide", "first"),
    "dense_vectors": ("dense_vectors",),
    "deep": ("deep",),
    "bottom": ("bottom",),
    "top": ("top",),
    "cross": ("cross",),
}


def init_weights(model: nn.Module, checkpoint: str) -> None:
    """Copy a checkpoint's weights into a freshly built model of the same architecture."""
    config = _model_json(checkpoint)
    if config.get("compression"):
        raise RayloadError(f"train.init_from={checkpoint!r} is a {config['compression']['method']} checkpoint; "
                           "start from the uncompressed one it was made from")
    from .checkpoint import localize

    weights = torch.load(os.path.join(localize(checkpoint), "model.pt"), weights_only=True, map_location="cpu")
    own = model.state_dict()
    missing = sorted(set(own) - set(weights))
    extra = sorted(set(weights) - set(own))
    shapes = sorted(f"{k}: checkpoint {tuple(weights[k].shape)} vs model {tuple(v.shape)}"
                    for k, v in own.items() if k in weights and weights[k].shape != v.shape)
    if missing or extra or shapes:
        # A checkpoint from before model.align was built unpadded; the spec's default pads to 8.
        unpadded = "align" not in config.get("config", {}) and getattr(model, "align", 1) != 1
        raise RayloadError(
            f"train.init_from={checkpoint!r} does not fit this model ({config.get('config', {}).get('name')} in the checkpoint): "
            f"missing {missing[:5]}, unexpected {extra[:5]}, shape mismatches {shapes[:5]}; use the checkpoint's model section"
            + (" (its model.json predates model.align: set model.align: 1)" if unpadded else "")
        )
    model.load_state_dict(weights)


def _model_json(checkpoint: str) -> dict:
    from .checkpoint import MODEL_JSON, localize, read_model_json

    try:  # a URI (shared storage) is fetched into the local cache first
        path = os.path.join(localize(checkpoint), MODEL_JSON)
    except (OSError, ValueError) as exc:
        raise RayloadError(f"train.init_from={checkpoint!r} cannot be read: {exc}") from exc
    if not os.path.exists(path):
        raise RayloadError(f"train.init_from={checkpoint!r} is not a checkpoint: {path} does not exist")
    return read_model_json(checkpoint)


def frozen_parts(model: nn.Module, freeze: list[str]) -> list[tuple[str, nn.Module | nn.Parameter]]:
    """(attribute, module or parameter) for every frozen name; an error names a part this model lacks."""
    out = []
    for name in freeze:
        found = [(attr, getattr(model, attr)) for attr in PARTS[name] if getattr(model, attr, None) is not None]
        if not found:
            present = [k for k, attrs in PARTS.items() if any(getattr(model, a, None) is not None for a in attrs)]
            raise RayloadError(f"train.freeze: {type(model).__name__} has no {name!r} part; its parts are {present}")
        out += found
    return out


def freeze(model: nn.Module, freeze: list[str]) -> list[str]:
    """Turn off gradients of the named parts; returns the frozen parameter names."""
    names = []
    for attr, part in frozen_parts(model, freeze):
        params = [(attr, part)] if isinstance(part, nn.Parameter) else [(f"{attr}.{n}", p) for n, p in part.named_parameters()]
        for name, p in params:
            p.requires_grad_(False)
            names.append(name)
    return names


def eval_frozen(model: nn.Module, freeze: list[str]) -> None:
    """After model.train(): frozen modules back to eval mode (fixed batch-norm statistics, no dropout)."""
    if not freeze:
        return
    inner = model.module if hasattr(model, "module") else model
    for _, part in frozen_parts(inner, freeze):
        if isinstance(part, nn.Module):
            part.eval()
