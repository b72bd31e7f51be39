"""A search's run folder: `search.json` (spec, storage, state, the driver's pid and host), the
status of a running, finished or interrupted search, and what a resume must respect: one driver
at a time, and the spec the search was started with."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import socket
import threading
from typing import TYPE_CHECKING

from . import _tune_beat as beats
from .errors import RayloadError
from .paths import runs_root, write_json

if TYPE_CHECKING:
    from .search_spec import SearchSpec

log = logging.getLogger(__name__)
_DRIVEN: set[str] = set()  # run folders a tune call of this process drives now
_DRIVEN_LOCK = threading.Lock()


class SearchRunningError(RayloadError):
    pass


@contextlib.contextmanager
def driving(run_dir: str, resume: bool):
    """This call drives the search in `run_dir` while the block runs. A resume is refused while
    the run's driver is alive: a second one would re-attach the same running trials, run them
    twice and tell the same Optuna trials twice. Else the run is this driver's from now on:
    preparing (its data), by this pid and host, so `status` does not call it interrupted; and
    while the block runs, this process beats in the run folder (_tune_beat), so a resume on
    another machine can tell whether it still runs."""
    key, before = os.path.abspath(run_dir), None
    with _DRIVEN_LOCK, _locked(key if resume else None):  # two resumes at once: one claims it, the other sees it alive
        if resume:
            before = read_state(key)
            _refuse_live_driver(key, before)
            write_state(key, state="preparing", pid=os.getpid(), host=socket.gethostname())
        _DRIVEN.add(key)
    beat = beats.Beat(key).start()
    try:
        yield
    finally:
        beat.stop()
        _DRIVEN.discard(key)
        if before is not None:
            _unclaim(key, before)


def _unclaim(run_dir: str, before: dict) -> None:
    """A resume that stopped before its search started (no Ray at that address, data that could
    not be prepared) gives the run the state it had: a finished run must not read interrupted."""
    state = read_state(run_dir)
    if state.get("state") == "preparing" and state.get("pid") == os.getpid():
        write_state(run_dir, **{key: before[key] for key in ("state", "pid", "host") if key in before})


@contextlib.contextmanager
def _locked(run_dir: str | None):
    """An exclusive lock on the run folder's search.lock (none for a folder not made yet)."""
    if run_dir is None:
        yield
        return
    import fcntl

    with open(os.path.join(run_dir, "search.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _refuse_live_driver(run_dir: str, state: dict) -> None:
    pid, host = state.get("pid"), state.get("host")
    if state.get("state") not in ("running", "preparing"):
        return
    if pid == os.getpid() and host == socket.gethostname():
        alive = run_dir in _DRIVEN  # this process: only while one of its calls drives the run
    else:
        alive = _alive(pid, host)
        if alive and host == socket.gethostname() and _beat_stale(run_dir, pid, host):
            # the pid is taken by another process now (a reboot, a container): the driver stopped
            # beating long ago, and the pid alone kept its run from ever being resumed
            log.warning("%s: pid %s is alive but has not marked this search for over %.0f s: another process holds the "
                        "pid now; resuming", run_dir, pid, beats.STALE_S)
            return
    if not alive:
        return
    what = f"the search {run_dir} is still {state['state']}: its driver, pid {pid} on {host}, "
    if host != socket.gethostname():
        beating = beats.still_beating(run_dir, pid, host)
        if beating is False:
            log.warning("%s: the driver of this search, pid %s on %s, has not marked it for %.0f s (its machine or process "
                        "stopped): resuming it here", run_dir, pid, host, beats.WATCH_S)
            return
        if beating:
            raise SearchRunningError(what + f"another machine, still runs it (its beat in {run_dir}/{beats.BEAT_FILE} moved "
                                     "just now); two drivers would run the same trials twice. Wait for it to end (rayload "
                                     "tune status) or stop it, then resume")
        raise SearchRunningError(what + "another machine, may still run it (it left no beat to check: an older rayload); two "
                                 "drivers would run the same trials twice. Resume it once that driver has ended; if it is gone "
                                 f'(its machine stopped), set "state": "interrupted" in {run_dir}/search.json first')
    raise SearchRunningError(what + "is alive; two drivers would run the same trials twice. Wait for it to end (rayload "
                             "tune status) or stop it, then resume")


def preparing(resume: str | None) -> dict:
    """A new run's first state: preparing (its data, before the study opens), by this driver (a
    resumed run's was written as `driving` claimed it)."""
    return {} if resume else {"state": "preparing", "pid": os.getpid(), "host": socket.gethostname()}


class ResumeSpecError(RayloadError):
    pass


def check_resumed_spec(run_dir: str, stored: dict, given: SearchSpec) -> None:
    """A resumed search continues the study it made, with the spec it was started with: a
    different spec (or --set) would be ignored, or would change the search under a study made
    for another one (its space, its number of trials, its metric). Refuse it, naming the keys."""
    current = given.model_dump(mode="json")
    differ = []
    for key in sorted(set(stored) | set(current)):
        was, is_ = stored.get(key), current.get(key)
        if was == is_:
            continue
        if isinstance(was, dict) and isinstance(is_, dict) and key in ("space", "fixed"):
            differ += [f"{key}.{k} (was {was.get(k)!r}, given {is_.get(k)!r})" for k in sorted(set(was) | set(is_)) if was.get(k) != is_.get(k)]
        else:
            differ.append(f"{key} (was {was!r}, given {is_!r})")
    if differ:
        raise ResumeSpecError(f"the search in {run_dir} was started with another spec; a resume continues it as it was and "
                              f"cannot change it: differs in {'; '.join(differ)}. Resume with the spec (and --set) it was started "
                              "with, or start a new search under another name")


def find_run(run: str) -> str:
    candidates = [run, os.path.join(runs_root(), "tune", run)]
    for path in candidates:
        if os.path.exists(os.path.join(path, "search.json")):
            return os.path.abspath(path)
    raise RayloadError(f"no search run {run!r}: looked for search.json in {', '.join(candidates)}")


def read_state(run_dir: str, needs: tuple[str, ...] = ()) -> dict:
    """search.json, with the fields `needs` (else it is damaged: a KeyError named no file)."""
    path = os.path.join(run_dir, "search.json")
    try:
        with open(path) as f:
            state = json.load(f)
    except (ValueError, IsADirectoryError) as exc:  # a bare JSONDecodeError named no file
        raise RayloadError(f"{path} is damaged ({exc}); the search's trials are in its study") from None
    missing = [k for k in needs if k not in state] if isinstance(state, dict) else ["an object"]
    if missing:
        raise RayloadError(f"{path} is damaged (no {', '.join(missing)} in it); the search's trials are in its study")
    return state


def study_url(state: dict, run_dir: str) -> str:
    """Where the run's study is: its own storage, or the default SQLite file in the run folder
    wherever that folder is now (the stored absolute path pointed into the folder a moved or
    copied run was started in)."""
    url = state["storage"]
    if not (state.get("spec") or {}).get("storage") and url.startswith("sqlite:///") and url.endswith("/study.db"):
        return f"sqlite:///{os.path.join(os.path.abspath(run_dir), 'study.db')}"
    return url


def write_state(run_dir: str, **updates) -> None:
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "search.json")
    state = read_state(run_dir) if os.path.exists(path) else {"started": now()}
    state.update(updates, updated=now())
    # durable: a crash of the machine must not leave the renamed file empty; private: the study's URL may carry a password
    write_json(path, state, durable=True, private=True)


def status(run: str) -> dict:
    """State of a running, finished or interrupted search: its trials, counts and best trial."""
    from ._study_store import read_study
    from ._tune_report import best_row, trial_rows

    run_dir = find_run(run)
    state = read_state(run_dir, ("storage", "study", "total", "metric", "mode"))
    try:
        rows = trial_rows(read_study(study_url(state, run_dir), state["study"]))
    except RayloadError:
        if state.get("state") != "preparing":
            raise
        rows = []  # its data is being prepared: the study opens after that
    if state.get("state", "preparing") in ("running", "preparing"):
        silent = beats.silent_for(run_dir) if state.get("host") != socket.gethostname() else None
        if silent is not None and silent > beats.STALE_S:
            state["state"] = f"interrupted? (its driver on {state.get('host')} has not marked it for {silent:.0f} s; --resume checks and continues)"
        elif not _alive(state.get("pid"), state.get("host")) or _beat_stale(run_dir, state.get("pid"), state.get("host")):
            state["state"] = "interrupted (driver gone; continue with --resume)"
    return {"run_dir": run_dir, "state": state.get("state", "preparing"), "total": state["total"], "metric": state["metric"],
            "mode": state["mode"], "trials": rows, "best": best_row(rows), "ended": state.get("ended"),
            "spent_s": state.get("spent_s")}


def _beat_stale(run_dir: str, pid: int | None, host: str | None) -> bool:
    """Whether this machine's driver `pid` left its beat unmoved past STALE_S (this machine's
    own clock: same host only). False without a beat of that driver (an older rayload)."""
    beat = beats.read_beat(run_dir)
    if host != socket.gethostname() or beat is None or (beat.get("pid"), beat.get("host")) != (pid, host):
        return False
    silent = beats.silent_for(run_dir)
    return silent is not None and silent > beats.STALE_S


def _alive(pid: int | None, host: str | None) -> bool:
    if not pid or host != socket.gethostname():
        return host != socket.gethostname() and pid is not None  # another machine's driver: assume it runs
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user: a run folder shared on one host
        return True
    except OSError:
        return False


def now() -> str:
    return _dt.datetime.now().isoformat(timespec="seconds")
