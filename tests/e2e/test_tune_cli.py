"""`rayload tune` as a user runs it: a search interrupted by Ctrl-C, then one whose driver is
SIGKILLed, resumes to N trials."""

import glob
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import optuna
import pytest
import yaml
from helpers import movielens_subset

pytestmark = pytest.mark.e2e
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAYLOAD = os.path.join(os.path.dirname(sys.executable), "rayload")


def specs(tmp_path) -> str:
    movielens_subset(tmp_path, 5000)
    job = {"name": "ml-tiny",
           "data": {"source": {"kind": "parquet", "path": str(tmp_path / "subset.parquet")},
                    "columns": [{"name": "userId", "role": "categorical"}, {"name": "movieId", "role": "categorical"},
                                {"name": "year", "role": "numeric"}],
                    "label": {"column": "rating", "threshold": 4.0}},
           "model": {"name": "mlp", "embedding_dim": 4, "hidden": [8]},
           "train": {"epochs": 2, "batch_size": 256}}
    (tmp_path / "job.yaml").write_text("# rayload train job.yaml\n" + yaml.safe_dump(job))
    search = {"name": "resumable", "base": str(tmp_path / "job.yaml"), "strategy": "random", "num_samples": 5,
              "max_concurrent": 1, "space": {"train.lr": {"loguniform": [1e-3, 3e-2]}}}
    (tmp_path / "search.yaml").write_text("# rayload tune search.yaml\n" + yaml.safe_dump(search))
    return str(tmp_path / "search.yaml")


def finished(run_dir: str) -> dict:
    """{trial number: completion time} of the study's complete trials, read through a read-only
    SQLite connection: optuna.load_study would write (it stamps Alembic's version table when it
    finds none), racing the driver that is creating the study (seen: UNIQUE constraint failed)."""
    path = os.path.join(run_dir, "study.db")
    if not os.path.exists(path):
        return {}
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        rows = db.execute("SELECT number, datetime_complete FROM trials WHERE state = 'COMPLETE'").fetchall()
    except sqlite3.OperationalError:  # the driver has not created the tables yet
        return {}
    finally:
        db.close()
    return dict(rows)


def _wait_for(driver, home, count: int) -> str | None:
    deadline, run_dir = time.time() + 240, None
    while time.time() < deadline and driver.poll() is None:
        runs = glob.glob(str(home / "tune" / "resumable-*"))
        run_dir = runs[0] if runs else None
        if run_dir and len(finished(run_dir)) >= count:
            break
        time.sleep(0.2)
    return run_dir


def test_interrupted_then_killed_search_resumes_to_n_trials_without_rerunning_finished_ones(cli, tmp_path):
    """Ctrl-C first: Tune catches it and returned as if the search were done ("all trials
    finished", exit 0, best.yaml from part of it); now the run is recorded interrupted and the
    command fails, naming --resume. Then a resumed driver is SIGKILLed and resumed again."""
    spec, home = specs(tmp_path), tmp_path / "runs"
    env = dict(os.environ, RAYLOAD_HOME=str(home), COLUMNS="200")
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen([RAYLOAD, "tune", spec], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        run_dir = _wait_for(first, home, 1)
        assert first.poll() is None, "the search ended before it could be interrupted"
        os.kill(first.pid, signal.SIGINT)
        assert first.wait(timeout=120) != 0
    finally:
        _kill_group(first)
    said = " ".join((tmp_path / "first.log").read_text().split())
    assert "interrupted (Ctrl-C)" in said and f"--resume {os.path.basename(run_dir)}" in said, said[-2000:]
    with open(os.path.join(run_dir, "search.json")) as f:
        assert json.load(f)["state"] == "interrupted"
    assert not os.path.exists(os.path.join(run_dir, "best.yaml"))
    interrupted = finished(run_dir)
    assert 1 <= len(interrupted) < 5
    driver = subprocess.Popen([RAYLOAD, "tune", spec, "--resume", os.path.basename(run_dir)], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for(driver, home, len(interrupted) + 1)
        assert driver.poll() is None, "the search ended before it could be killed"
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        before = finished(run_dir)
        assert 2 <= len(before) < 5 and all(before[n] == t for n, t in interrupted.items())
        stamps = {n: os.path.getmtime(os.path.join(run_dir, "trials", f"trial_{n:04d}", "checkpoints.json")) for n in before}
        status = cli("tune", "status", run_dir, env=env, timeout=60)
        assert status.returncode == 0 and "interrupted" in status.stdout, status.stdout + status.stderr
    finally:
        _kill_group(driver)
    time.sleep(2)
    resumed = cli("tune", spec, "--resume", os.path.basename(run_dir), env=env, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    done = finished(run_dir)
    study = optuna.load_study(study_name="resumable", storage=f"sqlite:///{run_dir}/study.db")
    assert len(study.trials) == 5 and len(done) == 5  # N in total: nothing re-run, nothing lost
    # and no finished trial's configuration proposed again (a resumed sampler draws anew)
    assert len({t.params["train.lr"] for t in study.trials}) == 5, [t.params for t in study.trials]
    for number, completed in before.items():
        assert done[number] == completed
        path = os.path.join(run_dir, "trials", f"trial_{number:04d}", "checkpoints.json")
        assert os.path.getmtime(path) == stamps[number]
    assert os.path.exists(os.path.join(run_dir, "best.yaml")) and "5 complete" in resumed.stdout
    status = cli("tune", "status", os.path.basename(run_dir), env=env, timeout=60)
    assert ": finished, 5 of 5 trials finished" in " ".join(status.stdout.split()), status.stdout


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver's embedded Ray, if it outlived the driver
    except ProcessLookupError:
        pass
