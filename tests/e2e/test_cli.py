"""The `rayload` console script as a user runs it: exit codes, messages, real runs."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAYLOAD = os.path.join(os.path.dirname(sys.executable), "rayload")


def test_validate_ok(cli, tmp_path):
    r = cli("validate", "jobs/movielens_deepfm.yaml", home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "spec valid" in r.stdout


def test_bad_spec_exits_2_with_every_error_and_no_traceback(cli, tmp_path):
    r = cli("validate", "jobs/movielens_deepfm.yaml", "--set", "split.kind=randm", "--set", "features.numeric.year.scale=zz", home=tmp_path)
    assert r.returncode == 2
    assert "split.kind" in r.stderr and "features.numeric.year.scale" in r.stderr and "movielens_deepfm.yaml" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_missing_data_path_exits_2(cli, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "# rayload preprocess job.yaml\nname: x\ndata:\n  source: {kind: csv, path: /no/such/dir}\n"
        "  columns: [{name: a, role: numeric}]\n  label: {column: y}\n"
    )
    r = cli("validate", str(spec), home=tmp_path)
    assert r.returncode == 2 and "'/no/such/dir' does not exist" in r.stderr and "Traceback" not in r.stderr


def test_synth_then_preprocess(cli, tmp_path):
    out = tmp_path / "synth"
    r = cli("data", "synth", "--rows", "20000", "--shard-rows", "5000", "--out", str(out), home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Bayes-optimal AUC" in r.stdout and len(list(out.glob("*.parquet"))) == 4
    meta = json.loads((out / "synthetic.json").read_text())
    assert 0.7 < meta["bayes_auc"] < 0.9
    spec = tmp_path / "job.yaml"
    cols = "\n".join(f"    - {{name: I{i}, role: numeric}}" for i in range(1, 14))
    cats = "\n".join(f"    - {{name: C{i}, role: categorical}}" for i in range(1, 27))
    spec.write_text(
        f"# rayload preprocess job.yaml\nname: synth\ndata:\n  source: {{kind: parquet, path: '{out}/*.parquet'}}\n"
        f"  columns:\n{cols}\n{cats}\n  label: {{column: label}}\n"
    )
    r = cli("preprocess", str(spec), "--out", str(tmp_path / "pre"), home=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "pre" / "summary.json").read_text())
    assert summary["counts"]["input"] == 20000 and summary["counts"]["quarantined"] == 0
    assert "features (fitted on train)" in r.stdout and "C26" in r.stdout


def test_train_then_evaluate_a_checkpoint(cli, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(open(os.path.join(ROOT, "jobs", "movielens_deepfm.yaml")).read())
    r = cli("train", str(spec), "--set", "train.epochs=1", "--set", "model.hidden=[16]", "--run-name", "e2e", home=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    checkpoint = r.stdout.split("best checkpoint: ")[1].split()[0]
    assert os.path.basename(checkpoint) == "epoch_0000" and "test metrics" in r.stdout
    out = tmp_path / "metrics.json"
    r = cli("evaluate", str(spec), "--set", "train.epochs=1", "--checkpoint", checkpoint, "--split", "test", "--out", str(out), home=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads(out.read_text())
    assert metrics["rows"] > 15000 and 0.6 < metrics["auc"] < 0.9
    r = cli("evaluate", str(spec), "--set", "features.categorical.userId.min_count=3", "--checkpoint", checkpoint, home=tmp_path)
    said = " ".join(r.stderr.split())
    assert r.returncode == 2 and "trained with other preprocessing than the spec gives (features.categorical.userId.min_count" in said, said[-2000:]
    # The lifecycle commands on the same MovieLens checkpoint: int8 passes the gate, an
    # over-pruned model is refused with both AUCs and exit 1, and nothing is written for it.
    r = cli("compress", checkpoint, "--method", "int8", home=tmp_path)
    assert r.returncode == 0 and "wrote" in r.stdout and "validation AUC" in r.stdout, r.stdout + r.stderr[-3000:]
    assert os.path.exists(os.path.join(checkpoint + "-int8", "model.pt"))
    # The gate is tightened for this model: its FM and first-order parts carry most of the
    # signal (more so since the job's per-ID embedding prior), so pruning 99% of the MLP's
    # weights costs it about 0.002 AUC, right at the default allowance.
    r = cli("compress", checkpoint, "--method", "prune", "--amount", "0.99", "--max-auc-drop", "0.0005", home=tmp_path)
    assert r.returncode == 1 and "refused" in r.stderr and "validation AUC" in r.stderr, r.stdout + r.stderr[-3000:]
    assert not os.path.exists(checkpoint + "-prune99")


def _kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid` at once, until none is left: the driver and its
    embedded Ray, as when the machine or container running them dies. (A process group is not
    enough: Ray puts each worker in a group of its own, and orphaned Train workers go on for
    about two seconds, long enough to finish and register the next epoch.)"""
    import time

    import psutil

    def gone(p: psutil.Process) -> bool:
        try:
            return p.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        mine = []
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == sid:
                    p.kill()
                    mine.append(p)
            except (psutil.Error, ProcessLookupError, PermissionError):
                continue
        if all(gone(p) for p in mine):
            return
        time.sleep(0.1)
    raise AssertionError(f"processes of session {sid} survived SIGKILL for 30 s")


def test_killed_training_driver_resumes_with_the_same_run_name(cli, tmp_path):
    """`rayload train` with two Ray Train workers is SIGKILLed (every process of its session:
    the driver and its embedded Ray) after the first checkpoint is registered; the relaunch
    with the same --run-name starts at the next epoch and keeps the first epoch's metrics."""
    import glob
    import time

    import yaml
    from helpers import movielens_subset

    from rayload.train.checkpoint import load_train_state

    movielens_subset(tmp_path, 20_000)
    job = {"name": "ml-kill", "data": {"source": {"kind": "parquet", "path": str(tmp_path / "subset.parquet")},
                                       "columns": [{"name": "userId", "role": "categorical"}, {"name": "movieId", "role": "categorical"},
                                                   {"name": "year", "role": "numeric"}],
                                       "label": {"column": "rating", "threshold": 4.0}},
           "model": {"name": "deepfm", "embedding_dim": 8, "hidden": [16]},
           "train": {"epochs": 2, "batch_size": 256, "keep_checkpoints": 2}, "resources": {"workers": 2}}
    (tmp_path / "job.yaml").write_text("# rayload train job.yaml\n" + yaml.safe_dump(job))
    args = ["train", str(tmp_path / "job.yaml"), "--run-name", "killme"]
    env = dict(os.environ, RAYLOAD_HOME=str(tmp_path), COLUMNS="200")
    driver = subprocess.Popen([RAYLOAD, *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    snapshot = None
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and driver.poll() is None:
            found = glob.glob(str(tmp_path / "**" / "killme" / "checkpoint_manager_snapshot.json"), recursive=True)
            if found and "epoch_0000" in open(found[0]).read():
                snapshot = found[0]
                break
            time.sleep(0.2)
    finally:
        _kill_session(driver.pid)
        driver.wait(timeout=60)
    assert snapshot, "the first checkpoint was never registered"
    assert "epoch_0001" not in open(snapshot).read()  # killed before training ended
    run_dir = os.path.dirname(snapshot)
    first = json.loads(open(os.path.join(run_dir, "epoch_0000", "manifest.json")).read())
    r = cli(*args, home=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    history = load_train_state(os.path.join(run_dir, "epoch_0001"))["state"].history
    assert [h["epoch"] for h in history] == [0, 1]
    assert history[-1]["restarts"] == 1  # the relaunch resumed from the checkpoint instead of starting over
    assert history[0]["val_auc"] == first["metrics"]["val_auc"]  # epoch 0 was not trained again
    # The embedded Ray hides Ray Train's once-a-second State API warning (rayload/_ray.py), and
    # only it: the train workers' own lines still reach the console.
    assert "Failed to query Ray Train Controller" not in r.stdout + r.stderr
    assert "RayTrainWorker" in r.stderr
