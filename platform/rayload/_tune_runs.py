"""A search's run folder: `search.json` (spec, storage, state, the driver's pid and host) and
the status of a running, finished or interrupted search."""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket

from .errors import RayloadError
from .paths import runs_root


def preparing(resume: str | None) -> dict:
    """A new run's first state: preparing (its data, before the study opens), by this driver."""
    return {} if resume else {"state": "preparing", "pid": os.getpid(), "host": socket.gethostname()}


def find_run(run: str) -> str:
    candidates = [run, os.path.join(runs_root(), "tune", run)]
    for path in candidates:
        if os.path.exists(os.path.join(path, "search.json")):
            return os.path.abspath(path)
    raise RayloadError(f"no search run {run!r}: looked for search.json in {', '.join(candidates)}")


def read_state(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "search.json")) as f:
        return json.load(f)


def write_state(run_dir: str, **updates) -> None:
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "search.json")
    state = read_state(run_dir) if os.path.exists(path) else {"started": now()}
    state.update(updates, updated=now())
    with open(path + ".tmp", "w") as f:
        json.dump(state, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def status(run: str) -> dict:
    """State of a running, finished or interrupted search: its trials, counts and best trial."""
    from ._study import read_study
    from ._tune_report import best_row, trial_rows

    run_dir = find_run(run)
    state = read_state(run_dir)
    try:
        rows = trial_rows(read_study(state["storage"], state["study"]))
    except RayloadError:
        if state.get("state") != "preparing":
            raise
        rows = []  # its data is being prepared: the study opens after that
    if state.get("state", "preparing") in ("running", "preparing") and not _alive(state.get("pid"), state.get("host")):
        state["state"] = "interrupted (driver gone; continue with --resume)"
    return {"run_dir": run_dir, "state": state.get("state", "preparing"), "total": state["total"], "metric": state["metric"],
            "mode": state["mode"], "trials": rows, "best": best_row(rows), "ended": state.get("ended"),
            "spent_s": state.get("spent_s")}


def _alive(pid: int | None, host: str | None) -> bool:
    if not pid or host != socket.gethostname():
        return host != socket.gethostname() and pid is not None  # another machine's driver: assume it runs
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def now() -> str:
    return _dt.datetime.now().isoformat(timespec="seconds")
