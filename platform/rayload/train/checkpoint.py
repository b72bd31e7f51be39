"""The checkpoint contract: a directory that serving, evaluation and resumption all read.

    model.pt        CPU state dict of the unwrapped model (no "module." prefix)
    train_state.pt  optimizers, scheduler, grad scaler, every rank's RNG states, epoch, step,
                    early-stop state
    features.json   the fitted preprocessor (requests are transformed with it)
    model.json      architecture: model config and input shape
    manifest.json   package versions, seed, data content hash, the resolved spec, metrics
    history.json    the per-epoch metrics up to this checkpoint (also in train_state.pt; a
                    reader of the history alone fetches this small file, not the optimizer state)

Everything loads with `torch.load(..., weights_only=True)`: no pickled code is executed.
"""

from __future__ import annotations

import json
import os
import platform as _stdlib_platform
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import RayloadError
from ..features import FittedFeatures
from ..models import InputShape, build_model, model_json
from ..paths import join_uri, localize, read_text

MODEL, STATE, FEATURES, MODEL_JSON, MANIFEST, HISTORY = ("model.pt", "train_state.pt", "features.json", "model.json", "manifest.json",
                                                         "history.json")


@dataclass
class TrainState:
    epoch: int = -1  # last completed epoch
    step: int = 0  # optimizer steps taken
    best: float | None = None
    bad_epochs: int = 0
    history: list[dict] = field(default_factory=list)
    restarts: int = 0  # times this run resumed from a checkpoint (worker or driver failures)
    cached: bool | None = None  # whether the ranks trained from their batch cache (Session.cached)
    cached_bytes: int | None = None  # then: the largest rank's cached bytes (Session.cache_bytes)
    cached_world: int | None = None  # and the ranks that held them


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "module") else model


def rng_state() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "numpy": [torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
             "python": random.getstate()}
    if torch.cuda.is_available():  # the device this rank trains on: a resume may see fewer GPUs
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, (list, tuple)):  # saved before: every visible GPU's, set_rng_state_all failed on fewer GPUs
            here = torch.cuda.current_device()
            cuda = cuda[here] if here < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)


def rank_rng_states(world_size: int) -> list[dict]:
    """Every rank's RNG states, by rank, on every rank (a collective: every rank calls it).
    Ranks draw different dropout masks (setup.seed_rank); a resume restores each its own."""
    state = rng_state()
    if world_size == 1:
        return [state]
    states: list = [None] * world_size
    torch.distributed.all_gather_object(states, state)
    return states


def saved_rng_state(raw: dict, rank: int, world_size: int) -> dict | None:
    """This rank's RNG states from a loaded train_state.pt, or None when it holds none for this
    rank: it was saved with another world size, or before every rank's were kept ("rng" alone:
    rank 0's, which is a one-worker run's whole state)."""
    states = raw.get("rng_ranks") or [raw["rng"]]
    return states[rank] if len(states) == world_size else None


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def save(path: str, model, features: FittedFeatures, model_config: dict, train: dict, manifest: dict) -> None:
    """train: optimizers, scheduler, scaler state dicts, a TrainState and "rng", every rank's
    RNG states (`rank_rng_states`; this process's alone when absent)."""
    os.makedirs(path, exist_ok=True)
    weights = {k: v.detach().to("cpu").clone() for k, v in unwrap(model).state_dict().items()}
    torch.save(weights, os.path.join(path, MODEL))
    ts: TrainState = train["state"]
    rngs = train.get("rng") or [rng_state()]
    torch.save({
        "optimizers": [o.state_dict() for o in train["optimizers"]],
        # one per optimizer that follows the schedule (a dict alone in checkpoints from before)
        "scheduler": [sch.state_dict() for sch in train["schedulers"]] if train.get("schedulers") else None,
        "scaler": train["scaler"].state_dict() if train.get("scaler") else None,
        # "rng": rank 0's (what readers from before the per-rank states restore on every rank)
        "rng": rngs[0], "rng_ranks": rngs,
        "epoch": ts.epoch, "step": ts.step, "best": ts.best, "bad_epochs": ts.bad_epochs, "restarts": ts.restarts, "cached": ts.cached,
        "cached_bytes": ts.cached_bytes, "cached_world": ts.cached_world,
        "history": json.dumps(ts.history),
    }, os.path.join(path, STATE))
    features.save(os.path.join(path, FEATURES))
    shape = InputShape.from_features(features)
    _write_json(os.path.join(path, MODEL_JSON), model_json(model_config, shape))
    _write_json(os.path.join(path, MANIFEST), manifest)
    _write_json(os.path.join(path, HISTORY), ts.history)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


def load_train_state(path: str) -> dict:
    path = localize(path)
    raw = torch.load(os.path.join(path, STATE), weights_only=True, map_location="cpu")
    raw["state"] = TrainState(raw["epoch"], raw["step"], raw["best"], raw["bad_epochs"], json.loads(raw["history"]), raw["restarts"],
                              raw.get("cached"), raw.get("cached_bytes"), raw.get("cached_world"))
    return raw


def read_history(path: str) -> list[dict]:
    """The per-epoch history of a checkpoint (local folder or URI): history.json alone, without
    downloading the checkpoint; checkpoints written before that file existed are read whole."""
    try:
        return json.loads(read_text(join_uri(path, HISTORY)))
    except FileNotFoundError:
        return load_train_state(path)["state"].history


@dataclass
class LoadedModel:
    model: torch.nn.Module
    features: FittedFeatures
    config: dict
    manifest: dict


def read_model_json(path: str) -> dict:
    """A checkpoint's model.json: architecture config, input shape, compression (if any)."""
    where = os.path.join(localize(path), MODEL_JSON)
    try:
        with open(where) as f:
            spec = json.load(f)
    except ValueError as exc:  # a bare JSONDecodeError named no file
        raise RayloadError(f"{where} is damaged ({exc}); not a checkpoint rayload can load") from None
    if not (isinstance(spec, dict) and isinstance(spec.get("config"), dict)):  # was KeyError: 'config' from compress, evaluate, serve
        raise RayloadError(f"{where} is damaged (no model config in it); not a checkpoint rayload can load")
    return spec


def input_shape(spec: dict) -> InputShape:
    """The InputShape recorded in a model.json."""
    return InputShape(spec["shape"]["dense"], tuple(spec["shape"]["sparse"]), tuple(spec["shape"]["bags"]))


def load(path: str, device: str | torch.device = "cpu") -> LoadedModel:
    """Rebuild the model from a checkpoint directory (on CPU unless told otherwise), in eval
    mode; a URI (s3://...) is downloaded first (`localize`)."""
    path = localize(path)
    spec = read_model_json(path)
    shape = spec.get("shape")
    if not (isinstance(shape, dict) and {"dense", "sparse", "bags"} <= shape.keys()):
        raise RayloadError(f"{os.path.join(path, MODEL_JSON)} is damaged (no input shape in it); not a checkpoint rayload can load")
    model = build_model(spec["config"], input_shape(spec))
    weights = torch.load(os.path.join(path, MODEL), weights_only=True, map_location="cpu")
    compression = spec.get("compression") or {}
    if compression.get("method") == "int8":  # CPU int8 modules rebuilt from plain int8 tensors
        from ..models import quantized

        model = quantized.build(model, weights, compression["plan"])
    else:  # fp32, or pruned (same layout, zeros where weights were cut)
        model.load_state_dict(weights)
    features = FittedFeatures.load(os.path.join(path, FEATURES))
    manifest_path = os.path.join(path, MANIFEST)
    manifest = json.load(open(manifest_path)) if os.path.exists(manifest_path) else {}
    return LoadedModel(model.to(device).eval(), features, spec["config"], manifest)


def versions() -> dict:
    import pyarrow
    import ray

    from .. import __version__

    return {"rayload": __version__, "torch": torch.__version__, "ray": ray.__version__, "numpy": np.__version__,
            "pyarrow": pyarrow.__version__, "python": _stdlib_platform.python_version()}
