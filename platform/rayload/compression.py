"""`rayload compress`: an int8 or pruned copy of a checkpoint, written only past an accuracy gate.

The gate scores the validation split of the checkpoint's own job spec (from its manifest,
preprocessed with the same fitted features) with the original and with the compressed model,
exactly as it will be loaded for serving, and refuses when the AUC drops by more than
`max_auc_drop`. A refused model is never written.

The result is a checkpoint like any other (model.pt, model.json, features.json,
manifest.json) that `ckpt.load`, serving and A/B experiments read; `model.json` carries
`compression` (method, settings, and for int8 which modules became int8). It has no
train_state.pt: a compressed model is served, not resumed; fine-tune the original instead.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import shutil
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from . import pruning
from .models import quantized
from .errors import DataError, RayloadError
from .paths import is_remote, join_uri, local_path, read_text, remote_scratch, remove_folder, upload_folder

log = logging.getLogger(__name__)
Method = Literal["int8", "prune"]


@dataclass(frozen=True)
class CompressResult:
    method: str
    source: str
    checkpoint: str | None  # where it was written; None when the gate refused it
    auc_before: float
    auc_after: float
    max_auc_drop: float
    bytes_before: int
    bytes_after: int
    settings: dict

    @property
    def auc_drop(self) -> float:
        return self.auc_before - self.auc_after

    @property
    def passed(self) -> bool:
        from .evaluate import AUC_TOLERANCE  # "refuses a drop of more than max_auc_drop": exactly 0.002 was refused

        return self.auc_drop <= self.max_auc_drop + AUC_TOLERANCE

    def to_dict(self) -> dict:
        return {**asdict(self), "auc_drop": self.auc_drop, "passed": self.passed}


class GateRefused(RayloadError):
    def __init__(self, result: CompressResult):
        self.result = result
        super().__init__(
            f"{result.method} model refused: validation AUC {result.auc_before:.5f} -> {result.auc_after:.5f} "
            f"(drop {result.auc_drop:.5f} > max_auc_drop {result.max_auc_drop}); nothing written. "
            + ("Use a smaller --amount, add --finetune-epochs, or raise --max-auc-drop" if result.method == "prune" else
               "Raise --max-auc-drop, or try --method prune")  # int8 refuses --amount and --finetune-epochs
        )


def compress(checkpoint: str, method: Method = "int8", amount: float | None = None, structured: bool = False, finetune_epochs: int = 0,
             max_auc_drop: float = 0.002, out: str | None = None, spec=None, address: str | None = None,
             overrides=()) -> CompressResult:
    """Compress `checkpoint`; raises GateRefused (with both AUCs) when the gate fails.
    `amount`: prune only, the fraction to cut (default 0.5). `spec`: the job spec it was trained
    with (a JobSpec or a file; default: the one in its manifest). `overrides` (key=value, as
    --set) change that spec (the manifest's, or the file given)."""
    from .evaluate import auc
    from .train import checkpoint as ckpt
    from .train.loop import class_weight_pair

    _check_args(method, amount, finetune_epochs, max_auc_drop, structured)
    amount = 0.5 if amount is None else amount
    if isinstance(spec, str):  # the SDK takes a job spec file as the CLI's --spec does (it failed on spec.train)
        from .spec import load_spec

        spec, overrides = load_spec(spec, list(overrides)), ()
    if spec is not None and overrides:
        raise RayloadError(f"overrides {list(overrides)} change the job spec in the checkpoint's manifest; with a spec given, "
                           "apply them to that spec (rayload compress --spec FILE --set ... does)")
    suffix = default_suffix(method, amount, structured)
    origin = checkpoint
    # A checkpoint on shared storage is compressed from its local copy, and its compressed copy
    # goes back beside it (CHECKPOINT-int8 on the same storage), where serving replicas and
    # A/B arms on any node reach it; --out may name a URI or a local folder either way.
    destination = out or _beside(origin, suffix)
    destination = destination if is_remote(destination) else local_path(destination)  # file:// names a folder here
    checkpoint = require_checkpoint(checkpoint, "the checkpoint to compress")  # a URI fetched once into the cache; a folder as it is
    # The folder written on this disk: the destination itself, or for a URI a staging copy
    # under runs/compressed/remote/<hash of the URI>/, uploaded once it is complete.
    target = remote_scratch(destination, "compressed") if is_remote(destination) else _normal(destination)
    if is_remote(destination):
        _check_remote_out(destination, origin)
    else:
        _check_out(target, checkpoint)
    source = ckpt.load(checkpoint)
    config = ckpt.read_model_json(checkpoint)
    if config.get("compression"):
        raise RayloadError(f"{checkpoint} is already compressed ({config['compression']['method']}); compress the original")
    if source.features.label.task != "binary":
        raise RayloadError("the compression gate compares validation AUC: it needs a binary-label model")
    job, pre = _validation_data(checkpoint, source, spec, address, overrides)
    layout = _layout(source.features)
    ranges = quantized.InputRanges(source.model) if method == "int8" else None  # int8 layers' input clamps
    try:
        labels, before = _predict(source.model, pre.batches("val"), layout)
    finally:
        if ranges is not None:
            ranges.remove()
    positives = int((labels > 0.5).sum())
    if min(positives, len(labels) - positives) == 0:  # AUC's own ValueError was a traceback after the scoring
        raise DataError(f"the validation split of {checkpoint}'s job has {positives} positive and {len(labels) - positives} "
                        "negative rows: the gate compares AUCs, which need both classes; use a stratified split or more data")
    if method == "int8":
        model, state, info = _int8(source.model, config, ranges.bounds())
    else:
        model, info = pruning.prune(copy.deepcopy(source.model), amount, structured)
        if finetune_epochs:
            pruning.finetune(model, pre.batches("train"), layout, finetune_epochs, job.train.lr, job.train.batch_size,
                             job.train.weight_decay, class_weight_pair(source.features), job.train.grad_clip)
            info["finetune_epochs"] = finetune_epochs
        pruning.unmask(model)
        info["sparsity"] = pruning.sparsity(model)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    labels_after, after = _predict(model, pre.batches("val"), layout)
    if not np.array_equal(labels, labels_after):  # a Ray Dataset of remote shards need not keep its order
        raise RayloadError("the validation split was read in a different order for the two models; cannot pair their scores")
    for name, scores in (("the source model", before), (f"the {method} model", after)):
        if bad := int((~np.isfinite(scores)).sum()):  # NaN was a bare ValueError from auc(), inf ranked as a tie
            hint = " (a diverged fine-tune? fewer --finetune-epochs)" if finetune_epochs else ""
            raise DataError(f"{name} scored {bad} of the {len(scores)} validation rows NaN or infinite: its AUC cannot be compared{hint}")
    result = CompressResult(method, checkpoint, None, auc(labels, before), auc(labels, after), max_auc_drop,
                            os.path.getsize(os.path.join(checkpoint, ckpt.MODEL)), 0, info)
    if not result.passed:
        raise GateRefused(result)
    size = _write(checkpoint, target, state, config, source.manifest, result, origin)
    if is_remote(destination):
        _check_remote_out(destination, origin)  # again just before the earlier copy goes
        # the earlier copy first: uploaded over it, an upload cut short left its model.pt beside the
        # new model.json (a checkpoint that failed to load); now a cut leaves no model.pt, which
        # require_checkpoint names, and no stale file of the old copy stays
        remove_folder(destination)
        upload_folder(target, destination, last=(ckpt.MODEL,))  # model.pt last: see upload_folder
        shutil.rmtree(target, ignore_errors=True)  # the staging copy; readers fetch the URI into their cache
        log.info("uploaded %s to %s", target, destination)
    return CompressResult(**{**asdict(result), "checkpoint": destination, "bytes_after": size})


def default_suffix(method: str, amount: float, structured: bool) -> str:
    """The default output's suffix: int8, or prune<percent> (with -structured) at the exact
    amount (0.5 -> prune50, 0.504 -> prune50.4), so copies made with other settings do not
    replace each other."""
    if method == "int8":
        return "int8"
    return f"prune{format(amount * 100, '.10g')}" + ("-structured" if structured else "")


def require_checkpoint(path: str, what: str, fix: str = "name one") -> str:
    """`path` as a local checkpoint folder (a URI fetched into the cache); a RayloadError naming
    the path, what a checkpoint folder holds and `fix` when it is not one."""
    from .train import checkpoint as ckpt

    try:
        folder = ckpt.localize(path)
    except (OSError, ValueError) as exc:
        raise RayloadError(f"{what}, {path}, cannot be read: {exc}") from exc
    missing = [n for n in (ckpt.MODEL, ckpt.MODEL_JSON, ckpt.FEATURES) if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        state = "does not exist" if not os.path.exists(folder) else f"is not a checkpoint folder (no {', '.join(missing)})"
        raise RayloadError(f"{what}, {path}, {state}: a checkpoint folder holds {ckpt.MODEL}, {ckpt.MODEL_JSON} and "
                           f"{ckpt.FEATURES}, as rayload train writes them (runs/train/<run>/epoch_NNNN); {fix}")
    return folder


def _beside(checkpoint: str, suffix: str) -> str:
    """CHECKPOINT-suffix in the checkpoint's own folder; a URI keeps its query (the filesystem's
    options) after the path: s3://b/run/epoch_0003?endpoint_override=h -> s3://b/run/epoch_0003-int8?endpoint_override=h."""
    if not is_remote(checkpoint):
        return f"{os.path.normpath(local_path(checkpoint))}-{suffix}"
    head, sep, query = checkpoint.partition("?")
    return f"{head.rstrip('/')}-{suffix}{sep}{query}"


def _normal(path: str) -> str:
    """An absolute path with symlinks resolved and no trailing slash: `dir/` and `dir` are one folder."""
    return os.path.realpath(os.path.abspath(path))


def _contains(folder: str, path: str) -> bool:
    """`path` is `folder` itself or lies inside it (both normalised)."""
    return os.path.commonpath([folder, path]) == folder


def _check_out(target: str, checkpoint: str) -> None:
    """--out may be a new folder or an earlier compressed copy (replaced whole); nothing else is
    removed: not the checkpoint or a folder holding it, not a folder that is not a compressed
    checkpoint (a run folder, a trained checkpoint, anything else)."""
    target, checkpoint = _normal(target), _normal(checkpoint)
    if _contains(target, checkpoint) or _contains(checkpoint, target):  # inside it: the source gained a nested copy
        what = "is" if target == checkpoint else "contains" if _contains(target, checkpoint) else "lies inside"
        raise RayloadError(f"--out {target} {what} the checkpoint being compressed ({checkpoint}); "
                           "write the compressed copy somewhere else")
    if not os.path.lexists(target):
        return
    if not os.path.isdir(target) or os.path.islink(target):
        raise RayloadError(f"--out {target} exists and is not a folder; name a new folder or an earlier compressed copy")
    if not os.listdir(target):
        return
    if not _is_compressed_checkpoint(target):
        raise RayloadError(f"--out {target} exists and is not a compressed checkpoint (no model.json with a compression "
                           "section); it would be replaced whole, so it is refused: name a new folder")


def _is_compressed_checkpoint(folder: str) -> bool:
    from .train import checkpoint as ckpt

    try:
        with open(os.path.join(folder, ckpt.MODEL_JSON)) as f:
            return bool(json.load(f).get("compression")) and os.path.exists(os.path.join(folder, ckpt.MODEL))
    except (OSError, ValueError, AttributeError):
        return False


def _check_remote_out(destination: str, origin: str) -> None:
    """On object storage as on a disk: the copy must not land on the checkpoint or in a folder
    holding it, and may replace only an earlier compressed copy (a folder holding anything else,
    another run's checkpoint, was written over and left mixed)."""
    import pyarrow.fs as pafs

    out = destination.partition("?")[0].rstrip("/")
    src = origin.partition("?")[0].rstrip("/")
    if src == out or src.startswith(out + "/") or out.startswith(src + "/"):
        what = "is" if src == out else "contains" if src.startswith(out + "/") else "lies inside"
        raise RayloadError(f"--out {destination} {what} the checkpoint being compressed; write the compressed copy somewhere else")
    fs, root = pafs.FileSystem.from_uri(destination)
    if not fs.get_file_info(pafs.FileSelector(root.rstrip("/"), allow_not_found=True)):
        return  # absent or empty
    try:
        compressed = bool(json.loads(read_text(join_uri(destination, "model.json"))).get("compression"))
    except (OSError, ValueError, AttributeError):
        compressed = False
    if not compressed:
        raise RayloadError(f"--out {destination} exists and is not a compressed checkpoint (no model.json with a compression "
                           "section); it would be replaced whole, so it is refused: name a new folder")


def _check_args(method: str, amount: float | None, finetune_epochs: int, max_auc_drop: float, structured: bool = False) -> None:
    if method not in ("int8", "prune"):
        raise RayloadError(f"--method must be int8 or prune, got {method!r}")
    if amount is not None and method != "prune":  # it was ignored: an int8 model written where half the weights were to go
        raise RayloadError("--amount applies to --method prune only")
    if amount is not None and not 0.0 < amount < 1.0:
        raise RayloadError(f"--amount is the fraction of weights to cut and must be in (0, 1), got {amount}")
    if finetune_epochs < 0 or not max_auc_drop >= 0 or math.isinf(max_auc_drop):  # NaN: every model refused, gains too
        raise RayloadError(f"--finetune-epochs and --max-auc-drop must be >= 0 (and finite), got {finetune_epochs} and {max_auc_drop}")
    if finetune_epochs and method != "prune":
        raise RayloadError("--finetune-epochs applies to --method prune only")
    if structured and method != "prune":  # it was ignored: an int8 model written where whole neurons were asked to go
        raise RayloadError("--structured applies to --method prune only")


def _layout(features):
    from .train.batch import Layout

    return Layout.from_features(features)


def _validation_data(checkpoint: str, source, spec, address, overrides=()):
    """The checkpoint's job spec (manifest with `overrides` applied, or the one given)
    preprocessed into its splits."""
    from .data.pipeline import preprocess
    from .evaluate import with_own_features

    if spec is None:
        if "spec" not in source.manifest:
            raise RayloadError(f"{checkpoint}/manifest.json has no job spec; pass the spec it was trained with (--spec)")
        spec = _manifest_spec(checkpoint, _paths_from(source.manifest), overrides)
    given = spec  # as the user (or the manifest) gave it, for the mismatch message
    spec = with_own_features(spec, checkpoint)  # the ancestor of a fine-tuned model may be gone
    pre = preprocess(spec, address=address)
    if pre.features != source.features:
        from .train.identity import features_differ

        raise DataError(features_differ(checkpoint, source.manifest, given, "pass the job spec (and --set overrides) it was "
                                        "trained with (--spec)"))
    if not pre.files.get("val"):
        raise DataError(f"the spec of {checkpoint} has no validation split to gate on; give split fractions with val > 0")
    return spec, pre


def _paths_from(manifest: dict) -> dict:
    """The manifest's job spec with its relative local data paths made absolute against the
    folder training ran in (`workdir`): read from another folder they named other files, or none."""
    raw = copy.deepcopy(manifest["spec"])
    source, workdir = raw.get("data", {}).get("source", {}), manifest.get("workdir")
    if workdir and "path" in source and os.path.realpath(workdir) != os.path.realpath(os.getcwd()):  # same folder: as written (its cache key)
        paths = [source["path"]] if isinstance(source["path"], str) else source["path"]
        paths = [p if "://" in p or os.path.isabs(os.path.expanduser(p)) else os.path.join(workdir, p) for p in paths]
        source["path"] = paths[0] if isinstance(source["path"], str) else paths
    return raw


def _manifest_spec(checkpoint: str, raw: dict, overrides):
    """The manifest's job spec, with overrides (--set) applied and checked as a spec file's are."""
    from ._spec_checks import check_job
    from ._spec_load import apply_overrides, validate_model
    from .spec import JobSpec

    if not overrides:
        return JobSpec.model_validate(raw)
    raw = copy.deepcopy(raw)
    issues = apply_overrides(raw, overrides)
    return validate_model(JobSpec, raw, check_job, file=f"{checkpoint}/manifest.json (its job spec, with --set)", issues=issues)


def _predict(model: nn.Module, dataset, layout) -> tuple[np.ndarray, np.ndarray]:
    from .evaluate import predict

    model.eval()
    return predict(model, dataset, layout, raw=True)  # logits: AUC ranks them without float32 sigmoid's ties


# ---------------------------------------------------------------- int8


def _int8(model: nn.Module, config: dict, bounds: dict | None = None):
    """The int8 model built through the loader's own path from the state written to disk, so
    the gate scores exactly what serving will run."""
    from .models import build_model
    from .train.checkpoint import input_shape

    state, plan = quantized.quantize(copy.deepcopy(model), bounds)
    served = quantized.build(build_model(config["config"], input_shape(config)), state, plan)
    return served, state, {"plan": plan, "engine": torch.backends.quantized.engine}


# ---------------------------------------------------------------- write


def _write(checkpoint: str, target: str, state: dict, config: dict, manifest: dict, result: CompressResult, origin: str) -> int:
    """Write into a temporary folder, then move it into place: a reader never sees half a checkpoint."""
    from .train import checkpoint as ckpt

    target = _normal(target)
    _check_out(target, checkpoint)  # again just before anything is removed: the folder may have changed since
    tmp = f"{target}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    aside = None
    try:
        _fill(tmp, checkpoint, state, config, manifest, result, origin)
        # the earlier copy aside, the new one in, then the old one gone: removed first, an interrupt
        # between the two left neither
        if os.path.lexists(target):
            aside = f"{target}.old-{os.getpid()}"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(target, aside)
        os.replace(tmp, target)
    except BaseException:
        if aside and not os.path.lexists(target):
            os.replace(aside, target)  # the earlier copy back in place
        shutil.rmtree(tmp, ignore_errors=True)  # a disk full or Ctrl-C left <out>.tmp-PID beside the run for good
        raise
    if aside:
        shutil.rmtree(aside, ignore_errors=True)
    log.info("wrote %s (%s)", target, result.method)
    return os.path.getsize(os.path.join(target, ckpt.MODEL))


def _fill(tmp: str, checkpoint: str, state: dict, config: dict, manifest: dict, result: CompressResult, origin: str) -> None:
    from .train import checkpoint as ckpt

    torch.save(state, os.path.join(tmp, ckpt.MODEL))
    shutil.copy(os.path.join(checkpoint, ckpt.FEATURES), os.path.join(tmp, ckpt.FEATURES))
    summary = {"method": result.method, "source": origin if is_remote(origin) else os.path.abspath(checkpoint), **result.settings,
               "auc_before": result.auc_before, "auc_after": result.auc_after, "max_auc_drop": result.max_auc_drop}
    with open(os.path.join(tmp, ckpt.MODEL_JSON), "w") as f:
        json.dump({**config, "compression": summary}, f, indent=1)
    with open(os.path.join(tmp, ckpt.MANIFEST), "w") as f:
        # the source's validation metrics are the source's: this model's AUC is the gate's
        json.dump({**manifest, "metrics": {"val_auc": result.auc_after}, "source_metrics": manifest.get("metrics"),
                   "compression": {k: v for k, v in summary.items() if k != "plan"}}, f, indent=1, default=str)
