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


def check_before_training(spec) -> None:
    """`train.init_from` and `train.freeze` checked in the driver before any data is prepared:
    the spec's model, built on the checkpoint's input shape (its fitted features are this run's),
    takes the checkpoint's weights, has every frozen part, and keeps something to train. On the
    workers the same errors came after preprocessing, and Ray Train retried them as worker
    failures up to train.max_failures times (forever with -1). The model is built on the meta
    device and the weights memory-mapped, so no table is allocated or read."""
    init = spec.train.init_from
    if not init:
        return
    from ..models import build_model
    from .checkpoint import input_shape

    config = _model_json(init)
    with torch.device("meta"):
        model = build_model(spec.model.model_dump(), input_shape(config))
    _fit_weights(model, init, config, spec.model.model_dump(mode="json"), mmap=True)
    freeze(model, spec.train.freeze)
    check_trainable(model, spec.train.freeze)


def check_trainable(model: nn.Module, frozen: list[str]) -> None:
    """Some dense parameter still trains (checked before a DDP wrap, whose own error says less)."""
    from .sparse_sync import sparse_tables

    tables = {id(p) for _, p in sparse_tables(model)}
    if not any(p.requires_grad and id(p) not in tables for p in model.parameters()):
        raise RayloadError(f"train.freeze={frozen} leaves no dense parameters to train; freeze fewer parts")


def init_weights(model: nn.Module, checkpoint: str, spec_model: dict | None = None) -> None:
    """Copy a checkpoint's weights into a freshly built model of the same architecture."""
    model.load_state_dict(_fit_weights(model, checkpoint, _model_json(checkpoint), spec_model))


def _fit_weights(model: nn.Module, checkpoint: str, config: dict, spec_model: dict | None, mmap: bool = False) -> dict:
    """The checkpoint's weights, refused (naming the model fields that differ from the
    checkpoint's) unless every one fits `model`."""
    if config.get("compression"):
        raise RayloadError(f"train.init_from={checkpoint!r} is a {config['compression']['method']} checkpoint; "
                           "start from the uncompressed one it was made from")
    from .checkpoint import localize

    weights = torch.load(os.path.join(localize(checkpoint), "model.pt"), weights_only=True, map_location="cpu", mmap=mmap)
    own = model.state_dict()
    missing = sorted(set(own) - set(weights))
    extra = sorted(set(weights) - set(own))
    shapes = sorted(f"{k}: checkpoint {tuple(weights[k].shape)} vs model {tuple(v.shape)}"
                    for k, v in own.items() if k in weights and weights[k].shape != v.shape)
    if missing or extra or shapes:
        saved = config.get("config", {})
        # A checkpoint from before model.align was built unpadded; the spec's default pads to 8.
        unpadded = "align" not in saved and getattr(model, "align", 1) != 1
        differ = [f"model.{k}: checkpoint {saved[k]!r} vs spec {v!r}" for k, v in (spec_model or {}).items()
                  if k in saved and saved[k] != v]
        raise RayloadError(
            f"train.init_from={checkpoint!r} does not fit this model ({saved.get('name')} in the checkpoint): "
            + (f"{'; '.join(differ)}; " if differ else "")
            + f"missing {missing[:5]}, unexpected {extra[:5]}, shape mismatches {shapes[:5]}; use the checkpoint's model section"
            + (" (its model.json predates model.align: set model.align: 1)" if unpadded else "")
        )
    return weights


def _model_json(checkpoint: str) -> dict:
    from .checkpoint import MODEL_JSON, localize, read_model_json

    try:  # a URI (shared storage) is fetched into the local cache first
        path = os.path.join(localize(checkpoint), MODEL_JSON)
    except (OSError, ValueError) as exc:
        raise RayloadError(f"train.init_from={checkpoint!r} cannot be read: {exc}") from exc
    if not os.path.exists(path):
        raise RayloadError(f"train.init_from={checkpoint!r} is not a checkpoint: {path} does not exist")
    return read_model_json(checkpoint)


def has_part(model: nn.Module, attr: str) -> bool:
    """The model holds something at `attr`: an empty parameter (DeepFM's dense vectors on data
    without numeric columns) is no part, and freezing it froze nothing."""
    part = getattr(model, attr, None)
    return part is not None and not (isinstance(part, nn.Parameter) and part.numel() == 0)


def frozen_parts(model: nn.Module, freeze: list[str]) -> list[tuple[str, nn.Module | nn.Parameter]]:
    """(attribute, module or parameter) for every frozen name; an error names a part this model lacks."""
    out = []
    for name in freeze:
        found = [(attr, getattr(model, attr)) for attr in PARTS[name] if has_part(model, attr)]
        if not found:
            present = [k for k, attrs in PARTS.items() if any(has_part(model, a) for a in attrs)]
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
