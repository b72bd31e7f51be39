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
