"""One function per pipeline stage kind: `kind(spec, stage, folder, outputs, address, progress) -> outputs`.

`outputs` holds the recorded outputs of the stages before (by name); a runner returns its own
as a JSON-able dict, which `stage.json` keeps and later stages and the report read.
"""

from __future__ import annotations

import json
import logging
import os
import uuid

from .errors import RayloadError
from .paths import join_uri, shared_storage, write_json

log = logging.getLogger(__name__)


def plan_for(spec, stage) -> tuple[dict, int | None, str | None]:
    """(resolved spec, seed, data content hash) of a stage, without running anything."""
    from .data.pipeline import job_cache_key

    if stage.kind in ("prepare", "train"):
        job = _job(spec, stage)
        plan = job.model_dump(mode="json")
        if stage.kind == "train" and (shared := shared_storage(job.train.storage_path)):
            plan["shared_storage"] = shared  # where the run lives: a new place is a new run
        if stage.kind == "train":
            plan.update(_init_identity(job))
        return plan, job.split.seed if stage.kind == "prepare" else job.train.seed, job_cache_key(job)  # the seed that shaped its output
    if stage.kind == "tune":
        from .search_job import base_raw
        from .tuning import job_from

        search = _search(spec, stage)
        raw = base_raw(search, None)
        base = job_from(raw, {})
        return {"search": search.model_dump(mode="json"), "base": raw, **_init_identity(base)}, search.seed, job_cache_key(base)
    if stage.kind == "ab":
        ab = _ab_template(spec, stage)
        # Arms the pipeline does not fill from earlier stages (whose fingerprints cover them)
        # are read here: a job arm's resolved spec and data, a checkpoint arm's files.
        arms = [] if stage.champion else [_arm_identity(arm) for arm in ab["arms"]]
        return {**ab, "arm_inputs": arms}, ab.get("simulate", {}).get("seed"), None
    return stage.model_dump(mode="json"), None, None


def _job(spec, stage):
    from .spec import load_spec

    return load_spec(spec.path(stage.job), stage.set)


def _shared_run(shared: str, folder: str, stage: str) -> str:
    """Where a train stage's run lives on shared storage: pipelines/<run id>/<stage>-<token>.
    The token is drawn when the stage starts from an empty folder (first run, changed inputs,
    --force) and kept in the folder (shared_run.json), so an interrupted stage resumes its own
    run while a fresh start never restores an older run's checkpoints, nor another machine's
    run of a pipeline with the same run id."""
    import uuid

    marker = os.path.join(folder, "shared_run.json")
    try:
        with open(marker) as f:
            kept = json.load(f)
    except (OSError, ValueError):  # none yet, or unreadable (written before it was atomic): a fresh start
        kept = None
    if isinstance(kept, dict) and kept.get("shared") == shared and isinstance(kept.get("run"), str):
        return kept["run"]
    run = join_uri(shared, "pipelines", os.path.basename(os.path.dirname(os.path.abspath(folder))), f"{stage}-{uuid.uuid4().hex[:8]}")
    _dump(marker, {"shared": shared, "run": run})
    return run


def _search(spec, stage):
    from .search_job import load_search_spec

    return load_search_spec(spec.path(stage.search), stage.set)


def _init_identity(job) -> dict:
    """The weights a job starts from (train.init_from): a checkpoint replaced at the same path
    is a new start, so the identity of its model.pt goes into the fingerprint."""
    if not job.train.init_from:
        return {}
    return {"init_from": _arm_identity({"checkpoint": job.train.init_from})}


def _arm_identity(arm: dict) -> dict:
    """What an A/B arm trains or serves: a job arm's resolved spec and its data's content hash;
    a checkpoint arm's model.pt size and modification time (a URI as named)."""
    from .paths import is_remote, local_path

    if arm.get("job"):
        from .data.pipeline import job_cache_key
        from .spec import load_spec

        job = load_spec(arm["job"], arm.get("set") or [])
        return {"job": job.model_dump(mode="json"), "data": job_cache_key(job), **_init_identity(job)}
    path = arm["checkpoint"]
    if is_remote(path):
        return {"checkpoint": path}
    path = local_path(path)  # file:// too: os.stat of the URI failed, so replacing the checkpoint never reran the stage
    try:
        st = os.stat(os.path.join(path, "model.pt"))
        return {"checkpoint": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    except OSError:
        return {"checkpoint": os.path.abspath(path), "missing": True}


def _ab_template(spec, stage) -> dict:
    from .ab_spec import load_ab_spec

    return load_ab_spec(spec.path(stage.spec), stage.set).model_dump(mode="json")


def prepare(spec, stage, folder, outputs, address, progress, force: bool = False) -> dict:
    """`force` (`rayload run --force STAGE`): preprocess again into the stage folder (shards/),
    leaving the shared shard cache, which other runs may be reading, as it is."""
    from .data.pipeline import preprocess

    result = preprocess(_job(spec, stage), out=os.path.join(folder, "shards") if force else None, address=address)
    result.features.save(os.path.join(folder, "features.json"))
    _dump(os.path.join(folder, "counts.json"), result.counts)
    c = result.counts
    # data_hash is the prepared data's content hash, as a checkpoint's manifest and summary.json name it (it was the cache key)
    return {"shards": result.out_dir, "cached": result.cached, "cache_key": result.cache_key, "data_hash": result.data_hash,
            "input_rows": c["input"],
            "good_rows": c["good"], "quarantined_rows": c["quarantined"]}


def train(spec, stage, folder, outputs, address, progress) -> dict:
    from .spec import load_spec
    from .train.trainer import fit

    # The run lives under a fixed name, so a relaunch resumes it: in the stage folder, or on
    # the shared storage the job or the cluster names (train.storage_path, RAYLOAD_STORAGE_PATH:
    # a multi-node cluster's workers cannot reach this node's disk), under pipelines/<run>/<stage>.
    shared = shared_storage(_job(spec, stage).train.storage_path)
    where = _shared_run(shared, folder, stage.name) if shared else folder
    job = load_spec(spec.path(stage.job), [*stage.set, f"train.storage_path={where}", "train.run_name=run"])
    result = fit(job, address=address)
    _dump(os.path.join(folder, "history.json"), result.history)
    return {"checkpoint": result.checkpoint, "history": os.path.join(folder, "history.json"), "val": result.metrics, "test": result.test, "epochs": len(result.history),
            "job": spec.path(stage.job)}


def tune(spec, stage, folder, outputs, address, progress) -> dict:
    from .evaluate import evaluate_checkpoint
    from .spec import load_spec
    from .tuning import tune as run
    from .train.trainer import fit  # noqa: F401  (loads the trainer before Tune's workers need it)

    search_dir = os.path.join(folder, "search")
    resume = search_dir if os.path.exists(os.path.join(search_dir, "search.json")) else None
    search = _search(spec, stage)
    if resume is None and search.storage:
        # a storage the search spec names outlives the stage folder: the study of an earlier run of
        # this stage keeps the name, and a rerun (--force, changed inputs) was refused as existing
        search = search.model_copy(update={"name": f"{search.name}-{os.path.basename(os.path.dirname(folder))}-{stage.name}-"
                                                   f"{uuid.uuid4().hex[:8]}"})
    # a resume runs the spec the search was started with (search.json), its name included: the
    # stage's fingerprint already says the search spec did not change since
    found = run(None if resume else search, resume=resume, address=address, run_dir=search_dir)
    out = {"run_dir": found.run_dir, "metric": found.metric, "mode": found.mode, "trials": len(found.trials), "counts": found.counts(),
           "best": None, "history": [{"number": t["number"], "state": t["state"], "value": t["value"]} for t in found.trials]}
    if not found.best:
        raise RayloadError(no_best(stage.name, found))
    best_job = load_spec(found.best_spec)
    from .data.pipeline import preprocess

    test = evaluate_checkpoint(found.best["checkpoint"], preprocess(best_job, address=address).batches("test"), best_job.eval)
    out["best"] = {"number": found.best["number"], "value": found.best_value, "params": found.best_params,
                   "checkpoint": found.best["checkpoint"], "spec": found.best_spec, "test": test.to_dict()}
    out["checkpoint"] = found.best["checkpoint"]
    return out


def no_best(stage: str, found) -> str:
    """Why a search stage has no result: which trials failed or were stopped, where to look."""
    by_state: dict[str, list[int]] = {}
    for t in sorted(found.trials, key=lambda t: t["number"]):
        by_state.setdefault(t["state"], []).append(t["number"])
    states = "; ".join(f"{state}: trials {', '.join(map(str, numbers))}" for state, numbers in by_state.items()) or "no trials ran"
    return (f"stage {stage!r}: no trial of the search finished with a {found.metric} value ({states}); see trials.csv "
            f"and Ray Tune's error files in {found.run_dir}, and run it afresh with --force {stage}")


def _checkpoint_of(outputs: dict, name: str) -> str:
    checkpoint = outputs[name].get("checkpoint")
    if not checkpoint:
        raise RayloadError(f"stage {name!r} produced no checkpoint (a search whose trials all failed?); the A/B stage needs one")
    return checkpoint


def ab(spec, stage, folder, outputs, address, progress) -> dict:
    from .ab_spec import ab_from_dict
    from .serve import control
    from .serve.simulate import simulate_and_decide
    from .serve.world import world_for

    template = _ab_template(spec, stage)
    arms = template["arms"]
    if stage.champion:
        # The A/B spec's champion arm serves the pipeline's champion, the other arm its challenger.
        champion = template.get("champion") or arms[0]["name"]
        template["arms"] = [{"name": a["name"], "weight": a["weight"],
                             "checkpoint": _checkpoint_of(outputs, stage.champion if a["name"] == champion else stage.challenger)}
                            for a in arms]
        template["champion"] = champion
    experiment = ab_from_dict(template)
    dep = control.start(experiment, address=address, run_dir=folder)
    try:
        if stage.traffic == "simulate":
            sim = experiment.simulate
            # the router's URLs asked again for each slice: a replaced direct-ingress replica has a new port
            key = os.environ.get(experiment.serving.api_key_env) if experiment.serving.api_key_env else None  # as `ab simulate` sends it
            out = simulate_and_decide(dep.run_dir, lambda: control.live_urls(dep.run_dir), world_for(experiment, dep.args), sim.users,
                                      sim.requests, sim.concurrency, sim.seed, api_key=key, auto=experiment.ramp.auto,
                                      on_chunk=lambda done, status: progress(done / sim.requests))
            decision, reasons, requests = out.decision, out.reasons, out.requests
        else:
            decision, reasons = _watch_live(folder, stage, progress, experiment.ramp.auto)
            requests = None
    finally:
        if not stage.keep_serving:
            control.stop(folder)
    return {"run_dir": folder, "url": dep.url, "decision": decision, "reasons": reasons, "requests": requests,
            "champion": experiment.champion_arm, "serving": stage.keep_serving, "checkpoints": dep.args["checkpoints"]}


def _watch_live(folder: str, stage, progress, auto: bool = True) -> tuple[str, list[str]]:
    """Real traffic: look at the analysis every interval_s until a decision or max_minutes. With
    `ramp.auto: false` (`auto`) only looked at: the experiment's weights are left to the user
    (as `rayload serve` and `ab simulate` leave them; a later decide stage acts, or not)."""
    import time

    from .serve import control

    deadline = time.monotonic() + stage.max_minutes * 60
    start = time.monotonic()
    decision, reasons = "continue", []
    while time.monotonic() < deadline:
        if auto:
            decision, reasons = control.step(folder)
        else:
            result = control.analysis_for(folder)
            decision, reasons = result.decision, result.reasons
        progress((time.monotonic() - start) / (stage.max_minutes * 60))
        if decision != "continue":
            break
        time.sleep(stage.interval_s)
    return decision, reasons


def decide(spec, stage, folder, outputs, address, progress) -> dict:
    from .serve import control

    exp = outputs[stage.experiment]
    result = control.analysis_for(exp["run_dir"])
    _, state = control.load_state(exp["run_dir"])
    # The decision in force (serve.json's final), not the log's last: weights set by hand after a
    # rollback undo it (the controller decides again), and the log still ended with it.
    in_force = (state.get("final") or {}).get("decision")
    action = "recorded"
    if result.decision in ("promote", "rollback"):
        if in_force == result.decision:
            action = f"applied during the experiment ({result.decision})"
        elif stage.act and exp.get("serving"):
            (control.promote if result.decision == "promote" else control.rollback)(exp["run_dir"], "; ".join(result.reasons))
            action = f"applied now ({result.decision})"
        elif not stage.act:
            action = "recorded (act: false, not applied)"
        else:
            action = "recorded (the experiment is no longer deployed)"
    arms = {a.arm: {"units": a.units, "exposures": a.exposures, "clicks": a.clicks, "ctr": a.ctr, "ctr_ci": list(a.ctr_ci)}
            for a in result.arms}
    # champion / challenger: the roles the lift compares; live_champion: the arm serving now, after a promote
    out = {"decision": result.decision, "reasons": result.reasons, "action": action, "champion": result.champion,
           "challenger": result.challenger, "live_champion": result.live_champion or result.champion, "arms": arms, "lift": result.lift,
           "lift_ci": list(result.lift_ci) if result.lift_ci else None, "sequential_p": result.sequential_p,
           "z_p_value": result.z_p_value, "srm_p": result.srm_p}
    _dump(os.path.join(folder, "decision.json"), out)
    return out


def _dump(path: str, obj) -> None:
    """Written whole or not at all (a crash mid-write left a truncated file that later runs read),
    readable by its owner alone: a pipeline's manifest and stage files hold the resolved specs,
    an event store's or a study's URL with its password among them."""
    write_json(path, obj, private=True)
