"""Whether a launch under an existing run's name continues that run.

A relaunch with the same `train.run_name` resumes the run's latest checkpoint. That is right
only for the spec and data the run was started with: other data, another lr or another model
under the same name would go on from weights and optimizer state trained for something else
(or fail deep in `load_state_dict`). The checkpoint's `manifest.json` holds the resolved spec and
the prepared data's content hash (`data_hash`); a launch whose own differ anywhere but in
`RELAUNCH_MAY_CHANGE` is refused, naming each differing field old -> new.
"""

from __future__ import annotations

import json
import logging

from ..errors import SpecError, SpecIssue
from ..paths import join_uri, read_text

log = logging.getLogger(__name__)

# What a relaunch may change and still continue the run: how long it goes on, where and on
# what it runs, how its batches are fed and kept, never what it learns from or how. A prefix
# ("resources") covers its whole section.
RELAUNCH_MAY_CHANGE = {
    "name": "the job's label; the run is named by train.run_name",
    "train.run_name": "the run's own name",
    "train.epochs": "a relaunch extends the run (or ends it sooner)",
    "train.max_failures": "the retries of this launch",
    "train.storage_path": "where the run is found",
    "train.keep_checkpoints": "how many checkpoints are kept",
    "train.prefetch_batches": "how batches are fed, not which",
    "train.cache_dataset": "whether the rows are kept in the object store",
    "train.worker_cache_mb": "whether each worker keeps its batches in memory",
    "resources": "the worker count (a number or {min, max}), CPUs, GPUs, accelerator, placement timeout, CPU "
                 "fallback: checkpoints load on fewer workers, on fewer GPUs or none",
    "eval.split": "the split scored after training",
    "eval.batch_size": "the evaluation's batch size",
    "eval.calibration_bins": "how the calibration error is reported",
    "data.source.path": "where the data is read from; what it holds is compared by data_hash",
}


def may_change(path: str) -> bool:
    return any(path == key or path.startswith(key + ".") for key in RELAUNCH_MAY_CHANGE)


def read_manifest(checkpoint: str) -> dict | None:
    """A checkpoint's manifest.json (a local folder or a URI); None when it has none."""
    try:
        return json.loads(read_text(join_uri(checkpoint, "manifest.json")))
    except FileNotFoundError:
        return None


# The spec fields that decide the fitted features (the source's path aside: the same files may move).
_PREPARES = ("data.", "split.", "rebalance.", "features.", "train.init_from")


def features_differ(checkpoint: str, manifest: dict | None, spec, fix: str) -> str:
    """Why `spec`'s data does not give `checkpoint`'s features.json: the spec prepares it
    otherwise (the differing fields, and `fix`), or, with those sections as the checkpoint's
    manifest has them, the data changed since it was trained. (The manifest's data_hash cannot
    tell: it hashes features.json too.)"""
    from ..spec import JobSpec

    generic = f"{checkpoint} was trained on a different preprocessing than the spec's data gives (features.json differs); {fix}"
    try:  # a stored spec this rayload no longer reads would differ in every default added since
        old = JobSpec.model_validate((manifest or {})["spec"]).model_dump(mode="json")
    except (KeyError, ValueError, TypeError):
        return generic
    before, after = _flat(old), _flat(spec.model_dump(mode="json"))
    fields = [p for p in sorted(set(before) | set(after))
              if p.startswith(_PREPARES) and p != "data.source.path" and before.get(p) != after.get(p)]
    if fields:
        shown = ", ".join(f"{p} {_short(before.get(p))} -> {_short(after.get(p))}" for p in fields[:5])
        return f"{checkpoint} was trained with other preprocessing than the spec gives ({shown}): features.json differs; {fix}"
    commit = (manifest or {}).get("git_commit")
    return (f"{checkpoint} was trained on other data than the spec reads now: its data, split, rebalance and features sections "
            "are the checkpoint's, yet the fitted features.json differs, so the source's rows changed since (or the rayload "
            f"that fits them: the checkpoint was written at commit {commit or 'unknown'}); point data.source.path at the data it "
            "was trained on, or retrain")


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _flat(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict) and obj:
        out = {}
        for key, value in obj.items():
            out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: obj}


def _resolved(spec: dict) -> dict:
    """A stored spec with today's defaults filled in, so a field added since it was written
    counts as its default rather than as a change (as given when it no longer validates)."""
    from ..spec import JobSpec

    try:
        return JobSpec.model_validate(spec).model_dump(mode="json")
    except ValueError:
        return spec


def changes(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """(field, old, new) for every field of two manifests' specs (and their data hashes) that
    differ, outside RELAUNCH_MAY_CHANGE. A manifest without a data_hash (the check before
    preprocessing) compares the specs alone."""
    missing = object()
    before, after = _flat(_resolved(old["spec"])), _flat(_resolved(new["spec"]))
    found = [(path, before.get(path, missing), after.get(path, missing)) for path in sorted(set(before) | set(after))]
    found = [(p, a, b) for p, a, b in found if a != b and not may_change(p)]
    if new.get("data_hash") is not None:
        # A manifest written before data_hash was a content digest held the cache key there.
        now = new["data_hash"] if "cache_key" in old else new.get("cache_key")
        if old.get("data_hash") != now:
            found.append(("data_hash", old.get("data_hash"), now))
    return [(p, None if a is missing else a, None if b is missing else b) for p, a, b in found]


def check_same_run(run: str, checkpoint: str, old: dict | None, new: dict) -> None:
    """Refuse to continue run `run` from `checkpoint` (whose manifest is `old`) with a launch
    whose manifest is `new`, when they differ outside RELAUNCH_MAY_CHANGE. A checkpoint or a
    launch without a spec in its manifest (written by hand, or by a test) is not compared."""
    if not old or "spec" not in old or "spec" not in new:
        return
    found = changes(old, new)
    if not found:
        return
    issues = [SpecIssue(path, f"{a!r} -> {b!r}: run '{run}' was trained with {a!r}") if path != "data_hash" else
              SpecIssue(path, f"{a} -> {b}: run '{run}' was trained on other data (the prepared data's content hash "
                        "differs: the source's rows changed, or the split, rebalancing or features that prepare them)")
              for path, a, b in found]
    allowed = ", ".join(RELAUNCH_MAY_CHANGE)
    issues.append(SpecIssue("train.run_name", f"a relaunch under the name '{run}' resumes that run from {checkpoint}, which "
                            f"needs the spec and data it was started with (only {allowed} may change); use a new run name "
                            "(train.run_name / --run-name) to train this spec, or restore the run's spec", run, True))
    raise SpecError(issues)
