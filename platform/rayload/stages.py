"""`rayload run`: a pipeline spec's stages in order, each in `runs/<run-id>/<stage>/`.

A stage's fingerprint is a hash of everything it reads: its resolved spec (file contents and
`set` overrides applied), the content hash of its data, and, for each stage whose outputs it
uses, that stage's fingerprint and execution (an id drawn each time it runs, kept in its
`stage.json`: a stage run again, by `--force` too, has new outputs, so the stages that use
them run again as well). A stage whose `stage.json` holds the same fingerprint and a finished
outcome is skipped and its recorded outputs are used; a changed one starts from an empty
folder; an interrupted one (same fingerprint, no finished outcome) continues: a training run
resumes from its checkpoints, a search resumes its study, an experiment keeps its events.

`manifest.json` in the run folder is rewritten after every stage: package versions, the git
commit, seeds, data content hashes, the resolved specs, each stage's duration and outcome.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import re
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field

from .errors import RayloadError
from .hashing import digest
from .paths import NAME_MAX, NAME_PATTERN, exclusive, runs_root
from ._stage_runners import _dump
from .pipeline_spec import RESERVED_RUN_IDS, PipelineSpec

log = logging.getLogger(__name__)
FINISHED = ("ok", "skipped")


@dataclass
class StageResult:
    name: str
    kind: str
    outcome: str  # ok | skipped | failed
    seconds: float
    fingerprint: str
    outputs: dict = field(default_factory=dict)
    error: str | None = None
    execution: str | None = None  # drawn when the stage runs; a skipped stage keeps the recorded one
    user_error: bool = False  # failed with a RayloadError (the user's spec or data): the CLI exits 2, as for other commands


@dataclass
class PipelineResult:
    run_id: str
    run_dir: str
    stages: list[StageResult]

    def outputs(self, name: str) -> dict:
        found = next((s for s in self.stages if s.name == name), None)
        if found is None:  # a bare StopIteration named nothing (and became a RuntimeError in a generator)
            raise KeyError(f"no stage named {name!r} in run {self.run_id}; its stages: {', '.join(s.name for s in self.stages) or 'none'}")
        return found.outputs

    @property
    def ok(self) -> bool:
        return all(s.outcome in FINISHED for s in self.stages)


@dataclass
class _Plan:
    """What one stage reads, resolved before it runs (and hashed into its fingerprint)."""

    spec: dict
    seed: int | None = None
    data_hash: str | None = None
    upstream: dict = field(default_factory=dict)


def run_dir_for(run_id: str) -> str:
    return os.path.join(runs_root(), run_id)


def run(spec: PipelineSpec, run_id: str | None = None, address: str | None = None, force: tuple[str, ...] = (),
        on_event=None) -> PipelineResult:
    """Run every stage in order; `force` names stages to run even when unchanged.
    `on_event(kind, stage, info)` reports `start`, `progress` (info: fraction done) and `end`."""
    if run_id is not None and not run_id:  # '' was read as "none given" and ran the spec's own run
        raise RayloadError("--run-id must not be empty (leave it out for the pipeline's name)")
    run_id = run_id or spec.name
    if len(run_id) > NAME_MAX:  # a folder name past the file system's 255 bytes was an OSError traceback
        raise RayloadError(f"--run-id must be at most {NAME_MAX} characters (got {len(run_id)})")
    if not re.fullmatch(NAME_PATTERN, run_id):  # "." or ".." made the run folder runs/ or its parent, deleted on a re-run
        raise RayloadError(f"--run-id {run_id!r} must be one folder name: letters, digits, '_', '-' and '.', not starting "
                           "with '.'")
    if run_id in RESERVED_RUN_IDS:
        raise RayloadError(f"run id {run_id!r} is reserved (runs/{run_id}/ belongs to another command); choose another --run-id")
    unknown = set(force) - {s.name for s in spec.stages}
    if unknown:
        raise RayloadError(f"--force names no stage: {sorted(unknown)}; stages: {[s.name for s in spec.stages]}")
    on_event = on_event or (lambda kind, stage, info=None: None)
    run_dir = run_dir_for(run_id)
    os.makedirs(run_dir, exist_ok=True)
    with _run_lock(run_dir, run_id):
        return _run_stages(spec, run_id, run_dir, address, force, on_event)


@contextlib.contextmanager
def _run_lock(run_dir: str, run_id: str):
    """One process per run folder: a second `rayload run` of the same run id took the first
    one's running stage for an interrupted one and ran it again in the same folder (with
    --force, it deleted the folder under it)."""
    with exclusive(os.path.join(run_dir, ".lock"), f"run {run_id!r} ({run_dir}) is being run by another process; wait for it, "
                   "or give another --run-id"):
        yield


def _run_stages(spec: PipelineSpec, run_id: str, run_dir: str, address: str | None, force: tuple[str, ...], on_event) -> PipelineResult:
    manifest = _Manifest(run_dir, spec, run_id)
    _ray_for_direct_ingress(spec, address)
    done: dict[str, StageResult] = {}
    for stage in spec.stages:
        folder = os.path.join(run_dir, stage.name)
        on_event("start", stage.name, None)
        try:
            plan = _plan(spec, stage, done)
        except RayloadError as exc:  # its spec no longer loads (edited since the pipeline was read)
            plan, result = _Plan({}), StageResult(stage.name, stage.kind, "failed", 0.0, "", {}, f"{type(exc).__name__}: {exc}",
                                                  user_error=True)
        else:
            # The stage's `set` counts through the spec it resolves to (plan.spec): a --set of the value
            # already there, or the same sets in another order, re-ran the stage and wiped its outputs
            fingerprint = digest({"kind": stage.kind, "stage": _without_sets(stage.model_dump(mode="json")), "spec": plan.spec,
                                  "data": plan.data_hash, "upstream": plan.upstream})
            result = _run_stage(spec, stage, folder, plan, fingerprint, done, address, stage.name in force,
                                lambda frac, name=stage.name: on_event("progress", name, frac))
        done[stage.name] = result
        manifest.add(stage.name, plan, result)
        on_event("end", stage.name, result)
        if result.outcome == "failed":
            break
    return PipelineResult(run_id, run_dir, list(done.values()))


def _ray_for_direct_ingress(spec: PipelineSpec, address: str | None) -> None:
    """An A/B stage served with `serving.ingress: direct` needs Serve's direct ingress switched
    on when the embedded Ray starts, and an earlier stage (prepare, train) would start it
    first without: so start it here, before any stage, when some A/B stage asks for it."""
    from ._stage_runners import _ab_template

    for stage in spec.stages:
        if stage.kind != "ab":
            continue
        try:
            direct = _ab_template(spec, stage)["serving"]["ingress"] == "direct"
        except (RayloadError, OSError):  # the stage itself reports a spec that does not load
            continue
        if direct:
            from ._ray import ensure_ray
            from .serve.ingress import direct_ingress_env

            ensure_ray(address, env=direct_ingress_env())
            return


def _run_stage(spec, stage, folder, plan, fingerprint, done, address, force, progress) -> StageResult:
    previous = _read_stage(folder)
    if not force and previous and previous.get("fingerprint") == fingerprint and previous.get("outcome") in FINISHED:
        log.info("stage %s unchanged: skipped", stage.name)
        return StageResult(stage.name, stage.kind, "skipped", 0.0, fingerprint, previous["outputs"], execution=previous.get("execution"))
    if (previous and (force or previous.get("fingerprint") != fingerprint)) or (not previous and os.path.isdir(folder)):
        # changed inputs: nothing of the old outputs may leak into the new ones; a folder without
        # stage.json (a wipe killed halfway, a hand edit) holds outputs of unknown inputs
        _wipe(folder)
    os.makedirs(folder, exist_ok=True)
    execution = uuid.uuid4().hex
    _write_stage(folder, {"fingerprint": fingerprint, "outcome": "running", "started": _now(), "execution": execution})
    start = time.perf_counter()
    from . import _stage_runners as runners

    # a forced prepare stage preprocesses again instead of reusing the shard cache
    options = {"force": True} if force and stage.kind == "prepare" else {}
    try:
        outputs = getattr(runners, stage.kind)(spec, stage, folder, {n: r.outputs for n, r in done.items()}, address, progress, **options)
    except Exception as exc:
        seconds = time.perf_counter() - start
        error = f"{type(exc).__name__}: {exc}"
        _write_stage(folder, {"fingerprint": fingerprint, "outcome": "failed", "seconds": seconds, "error": error, "execution": execution})
        user = isinstance(exc, RayloadError)
        if not user:
            log.exception("stage %s failed", stage.name)
        return StageResult(stage.name, stage.kind, "failed", seconds, fingerprint, {}, error, execution, user_error=user)
    seconds = time.perf_counter() - start
    _write_stage(folder, {"fingerprint": fingerprint, "outcome": "ok", "seconds": seconds, "finished": _now(), "outputs": outputs,
                          "execution": execution})
    return StageResult(stage.name, stage.kind, "ok", seconds, fingerprint, outputs, execution=execution)


def _wipe(folder: str) -> None:
    """Remove a stage folder: renamed aside first, so a process killed during the removal
    leaves no half-emptied folder under the stage's name (stage.json gone, old outputs left)."""
    aside = f"{folder}.old-{uuid.uuid4().hex[:8]}"
    os.replace(folder, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _plan(spec: PipelineSpec, stage, done: dict[str, StageResult]) -> _Plan:
    from ._stage_runners import plan_for

    resolved, seed, data_hash = plan_for(spec, stage)
    refs = [getattr(stage, f) for f in ("champion", "challenger", "experiment") if getattr(stage, f, None)]
    return _Plan(resolved, seed, data_hash, {r: _upstream(done[r]) for r in refs})


def _upstream(result: StageResult):
    """What a stage's fingerprint takes from one whose outputs it uses: its fingerprint and
    execution. A stage.json from before executions were recorded has none: its fingerprint
    alone, as then, so an unchanged pipeline recorded then is still skipped."""
    if result.execution is None:
        return result.fingerprint
    return {"fingerprint": result.fingerprint, "execution": result.execution}


def _without_sets(stage: dict) -> dict:
    return {**stage, "set": []} if "set" in stage else stage  # [] as before, so unchanged stages keep their fingerprint


def _read_stage(folder: str) -> dict | None:
    """The stage's record; None without one, or with one that cannot be read (a crash between
    the write and the disk, a hand edit): its outputs are then of unknown inputs, and the stage
    runs again from an empty folder."""
    path = os.path.join(folder, "stage.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError) as exc:
        log.warning("%s cannot be read (%s): the stage runs again", path, exc)
        return None
    return record if isinstance(record, dict) else None


def _write_stage(folder: str, record: dict) -> None:
    _dump(os.path.join(folder, "stage.json"), record)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class _Manifest:
    def __init__(self, run_dir: str, spec: PipelineSpec, run_id: str):
        from .train.checkpoint import versions
        from .train.trainer import _git_commit

        self.path = os.path.join(run_dir, "manifest.json")
        self.body = {"run_id": run_id, "pipeline": spec.name, "started": _now(), "versions": versions(),
                     "git_commit": _git_commit(), "pipeline_spec": spec.model_dump(mode="json", exclude={"folder"}),
                     "seeds": {}, "data_hashes": {}, "data_cache_keys": {}, "specs": {}, "stages": []}

    def add(self, name: str, plan: _Plan, result: StageResult) -> None:
        if plan.seed is not None:
            self.body["seeds"][name] = plan.seed
        if plan.data_hash:  # the inputs' key (paths, sizes, mtimes), which the fingerprint uses
            self.body["data_cache_keys"][name] = plan.data_hash
        if data_hash := _content_hash(result.outputs):  # what the prepared data holds, as checkpoints record it
            self.body["data_hashes"][name] = data_hash
        self.body["specs"][name] = plan.spec
        row = asdict(result)
        row["seconds"] = round(row["seconds"], 3)
        self.body["stages"].append(row)
        self.body["finished"] = _now()
        _dump(self.path, self.body)


def load_run(run: str) -> tuple[str, dict]:
    """A pipeline run's folder and manifest, by run id or folder."""
    for folder in (run, run_dir_for(run)):
        path = os.path.join(folder, "manifest.json")
        if os.path.exists(path):
            try:
                with open(path) as f:
                    manifest = json.load(f)
            except (ValueError, IsADirectoryError) as exc:  # a bare JSONDecodeError named no file
                raise RayloadError(f"{path} is damaged ({exc}); each stage's stage.json in {folder} still holds its outputs") from None
            stages = manifest.get("stages") if isinstance(manifest, dict) else None
            if not isinstance(stages, list) or not all(isinstance(s, dict) and {"kind", "outcome"} <= s.keys() for s in stages):
                raise RayloadError(f"{path} is damaged (not a run manifest); each stage's stage.json in {folder} still holds its outputs")
            return os.path.abspath(folder), manifest
    raise RayloadError(f"no pipeline run {run!r}: looked for manifest.json in {run} and {run_dir_for(run)}")


def _content_hash(outputs: dict) -> str | None:
    """A stage's prepared-data content hash: a prepare stage's own, a train or tune stage's from
    its checkpoint's manifest."""
    if outputs.get("data_hash"):
        return outputs["data_hash"]
    checkpoint = outputs.get("checkpoint")
    if not isinstance(checkpoint, str) or "://" in checkpoint:
        return None
    try:
        with open(os.path.join(checkpoint, "manifest.json")) as f:
            return json.load(f).get("data_hash")
    except (OSError, ValueError, AttributeError):
        return None
