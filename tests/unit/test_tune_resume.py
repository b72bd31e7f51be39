"""`rayload tune SPEC --resume RUN`: a spec (or --set) other than the run's own is refused, not ignored."""

import os

import pytest
import yaml

from rayload import load_search_spec, tuning
from rayload._tune_runs import write_state

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = os.path.join(ROOT, "jobs", "movielens_deepfm.yaml")


class Reached(Exception):
    pass


def started(tmp_path, monkeypatch):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": BASE, "space": {"train.lr": {"loguniform": [1e-4, 1e-2]}},
                                    "strategy": "random", "num_samples": 4}))
    run = tmp_path / "run"
    write_state(str(run), kind="job", spec=load_search_spec(str(path)).model_dump(mode="json"), base_raw={})

    def reached(address):
        raise Reached

    monkeypatch.setattr(tuning, "ensure_ray", reached)
    return str(path), str(run)


def test_resume_with_a_changed_spec_or_set_is_refused_naming_the_keys(tmp_path, monkeypatch):
    path, run = started(tmp_path, monkeypatch)
    with pytest.raises(tuning.ResumeSpecError) as info:
        tuning.tune(path, resume=run, overrides=["num_samples=9", "metric=val_logloss"])
    msg = str(info.value)
    assert "num_samples (was 4, given 9)" in msg and "metric (was 'val_auc', given 'val_logloss')" in msg and "strategy" not in msg
    with pytest.raises(tuning.RayloadError, match="overrides"):
        tuning.tune(None, resume=run, overrides=["num_samples=9"])
    for same in (path, None):  # the same spec, or none: the stored one runs
        with pytest.raises(Reached):
            tuning.tune(same, resume=run)


def test_tune_function_resume_with_other_arguments_is_refused(tmp_path, monkeypatch):
    run = tmp_path / "run"
    space = {"x": {"uniform": [0, 1]}}
    spec = tuning.SearchSpec(name="function", base="<python function>", space=space, strategy="random", num_samples=3, metric="value", mode="min",
                              max_failures=0)
    write_state(str(run), kind="function", spec=spec.model_dump(mode="json"))
    monkeypatch.setattr(tuning, "ensure_ray", lambda address: (_ for _ in ()).throw(Reached()))
    with pytest.raises(tuning.ResumeSpecError, match=r"num_samples \(was 3, given 5\)"):
        tuning.tune_function(lambda c: c["x"], space, strategy="random", num_samples=5, resume=str(run))
    with pytest.raises(Reached):
        tuning.tune_function(lambda c: c["x"], space, strategy="random", num_samples=3, resume=str(run))


def running(run, pid, host=None, state="running"):
    import socket

    write_state(run, state=state, pid=pid, host=host or socket.gethostname())


def test_a_resume_is_refused_while_the_runs_driver_is_alive(tmp_path, monkeypatch):
    """A second driver re-attached the first one's running trial and told the same Optuna
    trial twice ('Cannot tell a COMPLETE trial'); it is refused, naming the run, pid and host."""
    import socket
    import subprocess

    path, run = started(tmp_path, monkeypatch)
    function_run = str(tmp_path / "function_run")
    space = {"x": {"uniform": [0, 1]}}
    spec = tuning.SearchSpec(name="function", base="<python function>", space=space, metric="value", mode="min", max_failures=0)
    write_state(function_run, kind="function", spec=spec.model_dump(mode="json"))
    live = subprocess.Popen(["sleep", "60"])
    try:
        for state in ("running", "preparing"):
            running(run, live.pid, state=state)
            with pytest.raises(tuning.SearchRunningError) as info:
                tuning.tune(path, resume=run)
            assert f"the search {run} is still {state}: its driver, pid {live.pid} on {socket.gethostname()}, is alive" in str(info.value)
            running(function_run, live.pid, state=state)
            with pytest.raises(tuning.SearchRunningError, match=f"the search {function_run} is still {state}: its driver, pid {live.pid}"):
                tuning.tune_function(lambda c: c["x"], space, resume=function_run)
    finally:
        live.kill()
        live.wait()
    with pytest.raises(Reached):  # its driver is gone: the resume goes on
        tuning.tune(None, resume=run)
    running(run, 4242, host="another-host")  # another machine's driver cannot be checked: assumed alive, with the way out
    with pytest.raises(tuning.SearchRunningError, match=r"pid 4242 on another-host, another machine.*\"state\": \"interrupted\""):
        tuning.tune(None, resume=run)
    write_state(run, state="finished")
    with pytest.raises(Reached):
        tuning.tune(None, resume=run)


def test_this_process_may_resume_a_run_only_when_none_of_its_calls_drives_it(tmp_path, monkeypatch):
    """Its own pid is alive whether or not a call of this process still drives the run (a
    notebook's interrupted search is resumed in the same kernel)."""
    path, run = started(tmp_path, monkeypatch)
    running(run, os.getpid())
    inner = {}

    def nested(address):  # the first resume drives the run now; a second one in this process is refused
        with pytest.raises(tuning.SearchRunningError, match=f"pid {os.getpid()}") as info:
            tuning.tune(None, resume=run)
        inner["refused"] = str(info.value)
        raise Reached

    monkeypatch.setattr(tuning, "ensure_ray", nested)
    with pytest.raises(Reached):
        tuning.tune(None, resume=run)
    assert inner["refused"]
    monkeypatch.setattr(tuning, "ensure_ray", lambda address: (_ for _ in ()).throw(Reached()))
    with pytest.raises(Reached):  # that call has ended (with an error): this process may resume the run
        tuning.tune(None, resume=run)


def test_a_resumed_search_is_preparing_by_its_new_driver_before_it_prepares(tmp_path, monkeypatch):
    """`rayload tune status` said 'interrupted' while a resumed search prepared its data: the
    killed driver's state and pid stayed in search.json until the study opened."""
    import socket
    import subprocess

    path, run = started(tmp_path, monkeypatch)
    dead = subprocess.Popen(["true"])
    dead.wait()
    import optuna

    storage = f"sqlite:///{run}/study.db"
    optuna.create_study(storage=storage, study_name="s", direction="maximize")
    write_state(run, state="running", pid=dead.pid, host=socket.gethostname(), storage=storage, study="s", total=4,
                metric="val_auc", mode="max")
    assert tuning.status(run)["state"].startswith("interrupted")
    seen = {}

    def preparing(address):  # what search.json and status say once the resume starts to prepare
        seen["json"], seen["status"] = tuning.read_state(run), tuning.status(run)["state"]
        raise Reached

    monkeypatch.setattr(tuning, "ensure_ray", preparing)
    with pytest.raises(Reached):
        tuning.tune(None, resume=run)
    assert seen["status"] == "preparing"
    assert (seen["json"]["state"], seen["json"]["pid"], seen["json"]["host"]) == ("preparing", os.getpid(), socket.gethostname())


def test_a_resume_that_fails_before_its_search_starts_leaves_the_runs_state_as_it_was(tmp_path, monkeypatch):
    """The resume marks the run preparing by itself; if it stops before the search starts (no
    Ray at that address, data that cannot be prepared) a finished run must not read interrupted."""
    path, run = started(tmp_path, monkeypatch)
    write_state(run, state="finished", pid=1, host="elsewhere", ended="all trials finished")
    with pytest.raises(Reached):
        tuning.tune(None, resume=run)
    state = tuning.read_state(run)
    assert (state["state"], state["pid"], state["host"], state["ended"]) == ("finished", 1, "elsewhere", "all trials finished")


def _foreign_beat(run, count, pid=4242, host="another-host"):
    """What a driver on another machine writes to the shared run folder (_tune_beat's record)."""
    import json

    with open(os.path.join(run, "driver.beat"), "r+b" if os.path.exists(os.path.join(run, "driver.beat")) else "wb") as f:
        f.write(json.dumps({"pid": pid, "host": host, "beat": count}).ljust(256).encode())


def test_a_resume_from_another_machine_waits_for_its_drivers_beat_and_goes_on_once_it_stopped(tmp_path, monkeypatch, caplog):
    """A run folder on shared storage whose driver ran on another machine: its pid cannot be
    checked from here, so the resume watches the beat that driver keeps writing. A moving beat
    is refused; a beat that stopped (the machine went down) is resumed, with no hand edit."""
    import threading

    from rayload import _tune_beat

    monkeypatch.setattr(_tune_beat, "WATCH_S", 1.0)
    path, run = started(tmp_path, monkeypatch)
    running(run, 4242, host="another-host")
    stop, counts = threading.Event(), iter(range(1, 10**6))

    def beating():
        while not stop.wait(0.1):
            _foreign_beat(run, next(counts))

    _foreign_beat(run, 0)
    t = threading.Thread(target=beating)
    t.start()
    try:
        with pytest.raises(tuning.SearchRunningError, match=r"pid 4242 on another-host, another machine, still runs it .*driver\.beat moved"):
            tuning.tune(None, resume=run)
    finally:
        stop.set()
        t.join()
    assert tuning.read_state(run)["host"] == "another-host"  # a refused resume claims nothing
    with caplog.at_level("WARNING", logger="rayload._tune_runs"), pytest.raises(Reached):
        tuning.tune(None, resume=run)  # the beat stopped: the resume goes on past the check, to Ray
    assert "pid 4242 on another-host, has not marked it" in caplog.text


def test_the_driving_process_beats_while_it_drives_and_stops_after(tmp_path, monkeypatch):
    import socket

    from rayload import _tune_beat

    path, run = started(tmp_path, monkeypatch)
    seen = {}

    def reached(address):  # inside the resume: this process beats in the run folder
        seen["beat"] = _tune_beat.read_beat(run)
        raise Reached

    monkeypatch.setattr(tuning, "ensure_ray", reached)
    with pytest.raises(Reached):
        tuning.tune(None, resume=run)
    assert (seen["beat"]["pid"], seen["beat"]["host"]) == (os.getpid(), socket.gethostname())
    beat = _tune_beat.Beat(run, every=0.05).start()
    try:
        assert _tune_beat.still_beating(run, os.getpid(), socket.gethostname(), watch=5.0) is True
    finally:
        beat.stop()
    assert beat.count >= 2
    assert _tune_beat.still_beating(run, os.getpid(), socket.gethostname(), watch=0.5) is False
    assert _tune_beat.still_beating(run, 4242, "another-host", watch=0.5) is None  # no beat of that driver to watch


def test_status_calls_another_machines_silent_driver_interrupted(tmp_path, monkeypatch):
    import time

    path, run = started(tmp_path, monkeypatch)
    write_state(run, state="preparing", pid=4242, host="another-host", total=4, metric="val_auc", mode="max",
                storage=f"sqlite:///{run}/none.db", study="s")
    _foreign_beat(run, 7)
    assert tuning.status(run)["state"] == "preparing"  # it beat just now
    old = time.time() - 600
    os.utime(os.path.join(run, "driver.beat"), (old, old))
    assert tuning.status(run)["state"].startswith("interrupted? (its driver on another-host has not marked it for 6")
