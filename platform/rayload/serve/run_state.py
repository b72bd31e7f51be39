"""An A/B experiment's state on disk (serve.json in its run folder): written whole and fsynced,
read with a clear error when it is missing or damaged, one writer at a time under a lock, and
the generation stamp that tells one start of an experiment from the next."""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import contextmanager

from ..errors import RayloadError
from ..paths import runs_root, write_json

log = logging.getLogger("rayload.serve.control")  # restarts are the controller's to log, as they always were


def new_generation() -> str:
    """An experiment's generation: when it started (UTC) and a random part. Its router stamps each
    exposure with it, and the analysis, SRM check and ramp read only the current generation's:
    the name's events from before a fresh start (other models, salt, arms or shadow mode) share
    the store but not the experiment. A stamp, not a time bound on `ts`: the old generation's
    replicas keep answering (and logging) while Serve rolls the new ones out, and replicas on
    other nodes write their own clocks' time."""
    import secrets

    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(4)}"


def save_state(run_dir: str, state: dict) -> None:
    # a restart after a crash reads it: never an empty file renamed into place, nor the old
    # serve.json brought back by a power cut (undoing a recorded promote or rollback)
    # private: the event store's URL may carry a password
    write_json(os.path.join(run_dir, "serve.json"), state, durable=True, private=True)


def load_state(run: str) -> tuple[str, dict]:
    for folder in (run, os.path.join(runs_root(), "ab", run)):
        path = os.path.join(folder, "serve.json")
        if os.path.exists(path):
            try:
                with open(path) as f:
                    state = json.load(f)
            except (OSError, ValueError) as exc:  # a bare JSONDecodeError (or IsADirectoryError) named no file
                raise RayloadError(f"{path} is damaged ({exc}); the experiment's events are in its event store") from None
            if not isinstance(state, dict) or not _serve_config(state.get("config")):  # was KeyError: 'config', 'applications', ...
                raise RayloadError(f"{path} is damaged (no Serve config in it); the experiment's events are in its event store")
            return os.path.abspath(folder), state
    if run.endswith((".yaml", ".yml")) and not os.path.exists(run):  # a mistyped spec was read as a run name
        raise RayloadError(f"spec file not found: {run}")
    places = list(dict.fromkeys([run, os.path.join(runs_root(), "ab", run)]))  # one place when the name is already a path there
    raise RayloadError(f"no A/B run {run!r}: no serve.json in {' or '.join(places)}; an experiment gets its run folder when "
                       "`rayload serve SPEC` starts it")


def _serve_config(config) -> bool:
    """The shape `parts` reads: an application with args and a deployment's user_config."""
    try:
        app = config["applications"][0]
        return isinstance(app["args"], dict) and isinstance(app["deployments"][0]["user_config"], dict)
    except (KeyError, IndexError, TypeError):
        return False


@contextmanager
def _locked(run_dir: str):
    """One writer of an experiment's state at a time: the serve loop's controller, `ab
    simulate`'s and a by-hand command each read serve.json, decide and write it back under
    this lock (an flock on a file beside it, released if the holder dies), so none acts on a
    state another has just changed."""
    import fcntl

    with open(os.path.join(run_dir, "serve.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def parts(config: dict) -> tuple[dict, dict]:
    """(app args, router user_config) of an experiment's Serve config (the ones it changes)."""
    app = config["applications"][0]
    return app["args"], app["deployments"][0]["user_config"]


FINAL = ("promote", "rollback")  # decisions that end an experiment's automatic steps
_KEPT = ("decisions", "final", "ramp_step")  # what a restart keeps of serve.json, beside the router's user_config and generation
# what makes a restart the same experiment; the champion too: kept across a restart whose spec
# named another, the running roles and the args' disagreed, and a rollback gave the arm under test all traffic
_SAME = ("experiment", "salt", "arms", "checkpoints", "shadow", "champion")


def _previous_state(run_dir: str) -> dict:
    try:
        return load_state(run_dir)[1]
    except RayloadError:
        return {}


def _earlier_state(run_dir: str, args: dict) -> dict | None:
    """serve.json of this experiment's earlier start, when it is the same experiment (same
    name, arms, models, salt, shadow mode and champion): `rayload serve SPEC` again after a crash, a
    reboot or a `--detach` re-run goes on where it was (a promote stays promoted, the decision
    log and ramp step are kept) instead of deploying the spec's weights and deciding afresh on
    the same events. Anything else starts afresh, said in the log, as a new generation whose
    analysis does not read the earlier one's events (new_generation). A run recorded before
    generations had none: restarted as the same experiment it keeps reading all its events."""
    path = os.path.join(run_dir, "serve.json")
    if not os.path.exists(path):
        return None
    _, state = load_state(run_dir)
    before = parts(state["config"])[0]
    changed = [k for k in _SAME if before.get(k) != args.get(k)]
    if changed:
        log.warning("%s: the experiment there had other %s; it starts afresh (the earlier decision log is dropped)",
                    path, ", ".join(changed))
        return None
    _older_state(state, args)
    log.info("%s: restarting %s with its weights, champion and decisions in force (%d decisions, final: %s)", path,
             args["experiment"], len(state.get("decisions") or []), (state.get("final") or {}).get("decision"))
    return state


def _older_state(state: dict, args: dict) -> None:
    """A serve.json written before `final` and `ramp_step` were kept: its promote or rollback is
    the last decision of the log when the weights in force are that decision's (else a restart
    ramped the demoted arm back in), and a ramp step under way counts its units from the next
    look (else the first look after the restart took the next step with no new units)."""
    weights = parts(state["config"])[1].get("weights")
    if "final" not in state:
        last = (state.get("decisions") or [None])[-1]
        state["final"] = last if last and last.get("decision") in FINAL and last.get("weights") == weights else None
    if "ramp_step" not in state and weights != args.get("weights"):
        state["ramp_step"] = {"weights": weights, "units": None}
