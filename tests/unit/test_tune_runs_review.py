"""Search-run review fixes (2026-11-27), without Ray: a new search that lost the race for its
study's name is marked failed and cannot drive the other run's study on a resume; a live driver
owned by another user is alive; a moved run folder finds its own default study (a resume from
the old path crashed and left an empty database there); a damaged search.json is named."""

import json
import os
import shutil

import optuna
import pytest

from rayload import tuning
from rayload._study_store import OWNER, open_study
from rayload._tune_runs import _alive, read_state, status, study_url, write_state
from rayload.errors import RayloadError
from rayload.search_spec import SearchSpec

SPACE = {"x": {"uniform": [0, 1]}}


def _sampler(n):
    return optuna.samplers.RandomSampler(seed=n)


def _plan(run_dir, storage, name="shared"):
    spec = SearchSpec(name=name, base="<python function>", space=SPACE, strategy="random", num_samples=2, mode="min")
    return tuning._Plan(spec, str(run_dir), storage, {"CPU": 1}, 1)


def test_a_new_search_that_lost_the_race_for_its_studys_name_is_failed_and_not_resumable(tmp_path):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    winner = open_study(url, "shared", "min", _sampler, create=True, owner="winner-run")
    winner.add_trial(optuna.trial.create_trial(params={"x": 0.5}, distributions={"x": optuna.distributions.FloatDistribution(0, 1)}, value=0.5))
    loser = tmp_path / "loser"
    write_state(str(loser), kind="function", spec=_plan(loser, url).spec.model_dump(mode="json"), storage=url, study="shared",
                total=2, metric="value", mode="min")
    with pytest.raises(RayloadError, match="a study named 'shared' already exists"):
        tuning._run(_plan(loser, url), None, {}, resume=False)
    state = read_state(str(loser))
    assert state["state"] == "failed" and "already exists" in state["ended"] and state["run_uid"]
    assert status(str(loser))["state"] == "failed"
    with pytest.raises(RayloadError, match="was made by another search run"):  # its resume would drive the winner's study
        open_study(url, "shared", "min", _sampler, create=False, owner=state["run_uid"])
    assert len(open_study(url, "shared", "min", _sampler, create=False, owner="winner-run").trials) == 1
    assert optuna.load_study(study_name="shared", storage=url).user_attrs[OWNER] == "winner-run"


def test_a_driver_owned_by_another_user_is_alive(monkeypatch):
    import socket

    def kill(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", kill)
    assert _alive(1, socket.gethostname()) is True

    def gone(pid, sig):
        raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr(os, "kill", gone)
    assert _alive(12345, socket.gethostname()) is False


def test_a_moved_run_folder_uses_its_own_default_study_and_a_missing_one_is_named_without_creating_it(tmp_path):
    old = tmp_path / "old"
    url = f"sqlite:///{old / 'study.db'}"
    spec = _plan(old, url).spec.model_dump(mode="json")
    write_state(str(old), kind="function", spec=spec, storage=url, study="s", total=2, metric="value", mode="min")
    open_study(url, "s", "min", _sampler, create=True)
    new = tmp_path / "new"
    shutil.copytree(old, new)
    state = read_state(str(new))
    assert study_url(state, str(new)) == f"sqlite:///{new / 'study.db'}"
    assert tuning._storage(_plan(new, url).spec, str(new), resume=True) == f"sqlite:///{new / 'study.db'}"
    shutil.rmtree(old)
    assert open_study(study_url(state, str(new)), "s", "min", _sampler, create=False) is not None
    with pytest.raises(RayloadError, match=r"the study database .*/old/study.db does not exist"):
        open_study(url, "s", "min", _sampler, create=False)
    assert not old.exists()  # no empty database made at the old path
    with pytest.raises(RayloadError, match="no study named 'other'"):
        open_study(study_url(state, str(new)), "other", "min", _sampler, create=False)
    explicit = dict(state, spec={**spec, "storage": url})  # a storage the spec named stays as it was
    assert study_url(explicit, str(new)) == url


def test_a_damaged_search_json_is_named(tmp_path):
    (tmp_path / "search.json").write_text('{"state": "runn')
    with pytest.raises(RayloadError, match=r"search.json is damaged"):
        read_state(str(tmp_path))


def test_a_pid_reused_by_another_process_does_not_keep_the_run_from_resuming(tmp_path, monkeypatch):
    """On this machine the pid alone said the driver was alive: a pid taken by another process
    (after a reboot, in a container) kept the run "running" and refused every resume."""
    import socket
    import time

    from rayload import _tune_beat as beats
    from rayload._tune_runs import _refuse_live_driver

    run = str(tmp_path)
    other = os.getppid()  # alive, and not this process
    url = f"sqlite:///{tmp_path / 'study.db'}"
    open_study(url, "s", "min", _sampler, create=True)
    write_state(run, state="running", pid=other, host=socket.gethostname(), storage=url, study="s", total=1,
                metric="value", mode="min")
    beat = beats.Beat(run)
    beat.beat()
    beat_file = os.path.join(run, beats.BEAT_FILE)
    with open(beat_file) as f:  # the beat of that pid, as its driver wrote it
        record = json.loads(f.read())
    with open(beat_file, "w") as f:
        f.write(json.dumps({**record, "pid": other}))
    with pytest.raises(tuning.SearchRunningError):  # beating recently: alive
        _refuse_live_driver(run, read_state(run))
    old = time.time() - beats.STALE_S - 30
    os.utime(beat_file, (old, old))
    _refuse_live_driver(run, read_state(run))  # silent for over a minute: not its driver any more
    assert status(run)["state"].startswith("interrupted")
