"""A real head (`ray start --head`, token auth) and real jobs: `ray job submit --working-dir .`
runs every spec in jobs/, `rayload submit` wraps it, the job API refuses a missing or wrong
token, and `rayload doctor` checks the cluster."""

import glob
import json
import os
import subprocess

import httpx
import pytest
from ray_head import BIN, ROOT, Head, ensure_token

pytestmark = pytest.mark.e2e

# Tiny versions of each spec, so every file in jobs/ runs as a job within seconds. A spec added
# to jobs/ without an entry here fails test_every_job_spec_has_a_small_run.
SMALL = {
    "movielens_deepfm.yaml": ["train.train.epochs=1", "train.model.hidden=[16]"],
    "synthetic_dlrm.yaml": ["train.data.source.rows=3000", "train.data.source.shard_rows=1500", "train.train.epochs=1",
                            "train.train.batch_size=256"],
    "ab_movielens.yaml": ['ab.arms.0.set=["train.epochs=1", "model.hidden=[16]"]', 'ab.arms.1.set=["train.epochs=1", "model.hidden=[16]"]',
                          "ab.simulate.requests=300", "ab.serving.port=8781"],
    "movielens_pipeline.yaml": ["baseline.train.epochs=1", "baseline.model.hidden=[16]", "search.num_samples=1",
                                "search.scheduler.max_epochs=1", "search.scheduler.grace_period=1", "search.startup_trials=1",
                                "ab.serving.port=8782", "ab.simulate.requests=300"],
}


@pytest.fixture(scope="module")
def head():
    ensure_token()
    h = Head(num_cpus=2)
    yield h
    h.stop()


def _sets(items):
    return [a for item in items for a in ("--set", item)]


def test_every_job_spec_has_a_small_run():
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "jobs", "*.yaml"))) == sorted(SMALL)


@pytest.mark.parametrize("spec", sorted(SMALL))
def test_ray_job_submit_runs_every_job_spec(head, spec):
    r = head.job_submit("rayload", "run", f"jobs/{spec}", *_sets(SMALL[spec]))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "succeeded" in r.stdout + r.stderr
    with open(os.path.join(head.home, _run_id(spec), "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["stages"] and all(s["outcome"] == "ok" for s in manifest["stages"])
    assert manifest["versions"]["ray"] == "2.60.0" and manifest["specs"]
    if spec == "ab_movielens.yaml":  # both arms run the same small job here (an A/A test): trained once, shared
        assert sorted(os.listdir(os.path.join(head.home, "train"))) == ["ab-ab_movielens-baseline"]
        checkpoints = manifest["stages"][0]["outputs"]["checkpoints"]
        assert checkpoints["baseline"] == checkpoints["challenger"], checkpoints


def _run_id(spec: str) -> str:
    import yaml

    with open(os.path.join(ROOT, "jobs", spec)) as f:
        return yaml.safe_load(f)["name"]


def test_upload_leaves_out_runs_venv_and_caches(head, tmp_path):
    """What `ray job submit --working-dir .` uploads: the job lists its own working directory."""
    r = head.job_submit("python", "-c", "import os; print(sorted(os.listdir('.')))")
    assert r.returncode == 0, r.stderr[-2000:]
    listed = r.stdout
    assert "'platform'" in listed and "'jobs'" in listed and "'cluster.yaml'" in listed
    for excluded in ("'runs'", "'.venv'", "'.git'", "'.pytest_cache'"):
        assert excluded not in listed


def test_job_api_refuses_missing_and_wrong_tokens(head):
    body = {"entrypoint": "echo hi"}
    assert httpx.post(f"{head.url}/api/jobs/", json=body, timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer " + "0" * 32}
    assert httpx.post(f"{head.url}/api/jobs/", json=body, headers=wrong, timeout=10).status_code == 403
    right = {"Authorization": f"Bearer {ensure_token()}"}
    r = httpx.post(f"{head.url}/api/jobs/", json=body, headers=right, timeout=10)
    assert r.status_code == 200 and r.json()["job_id"]


def test_rayload_submit_runs_a_spec_with_the_uploaded_code(head):
    r = head.run(os.path.join(BIN, "rayload"), "submit", "jobs/movielens_deepfm.yaml", "--address", head.url,
                 *_sets(SMALL["movielens_deepfm.yaml"]))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "SUCCEEDED" in r.stdout and "python -m rayload run jobs/movielens_deepfm.yaml" in r.stdout
    head_commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(head.home, "movielens_deepfm", "manifest.json")) as f:
        assert json.load(f)["git_commit"] == head_commit  # the client's commit travels with the upload


def test_rayload_submit_names_what_is_wrong(head, tmp_path):
    rayload = os.path.join(BIN, "rayload")
    r = head.run(rayload, "submit", "jobs/movielens_deepfm.yaml", "--address", "http://127.0.0.1:9")
    assert r.returncode == 2 and "cannot reach the Ray job API at http://127.0.0.1:9" in r.stderr
    r = head.run(rayload, "submit", "jobs/movielens_deepfm.yaml", "--address", head.url, env={"RAY_AUTH_TOKEN": "f" * 32})
    assert r.returncode == 2 and "refused the token in RAY_AUTH_TOKEN" in r.stderr
    r = head.run(rayload, "submit", "jobs/movielens_deepfm.yaml", "--address", head.url, env={"HOME": str(tmp_path)})
    assert r.returncode == 2 and "requires a token and none was found" in r.stderr


def test_doctor_checks_the_cluster_and_the_databases_the_specs_name(head, tmp_path):
    (tmp_path / "good.yaml").write_text("name: a\nevents: {url: postgresql://postgres@127.0.0.1:5432/test}\n")
    (tmp_path / "bad.yaml").write_text("name: b\nevents: {url: postgresql://postgres@127.0.0.1:5999/test}\n")
    r = head.run(os.path.join(BIN, "rayload"), "doctor", "--address", head.gcs, "--specs", str(tmp_path), "--serve-port", "8783",
                 env={"COLUMNS": "250"})
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in r.stdout.splitlines() if line.count("│") >= 3}
    for check in ("Ray reachable", "same versions on every node", "token authentication", "GPUs for the specs",
                  "shared storage", "Serve port 8783 free", "database postgresql://postgres@127.0.0.1:5432/test"):
        assert rows.get(check) == "pass", r.stdout
    assert rows["database postgresql://postgres@127.0.0.1:5999/test"] == "FAIL"
    assert r.returncode == 1  # one failing check fails the doctor
    bad = head.run(os.path.join(BIN, "rayload"), "doctor", "--address", "127.0.0.1:9", env={"COLUMNS": "200"}, timeout=120)
    assert bad.returncode == 1 and "nothing answers at 127.0.0.1:9" in bad.stdout
