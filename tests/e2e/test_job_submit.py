"""A real head (`ray start --head`, token auth) and real jobs: `ray job submit --working-dir .`
runs every spec in jobs/ (the pipeline's run is test_demo.py's), `rayload submit` wraps it, the
job API refuses a missing or wrong token, and `rayload doctor` checks the cluster."""

import glob
import json
import os
import shutil
import subprocess

import httpx
import pytest
from ray_head import BIN, ROOT, ensure_token
from small_jobs import ELSEWHERE, MOVIELENS_SMALL, SMALL, sets, submit_and_check

pytestmark = pytest.mark.e2e


def test_every_job_spec_has_a_small_run():
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "jobs", "*.yaml"))) == sorted([*SMALL, *ELSEWHERE])


@pytest.mark.parametrize("spec", sorted(SMALL))
def test_ray_job_submit_runs_every_job_spec(head, spec):
    submit_and_check(head, spec)


def test_upload_leaves_out_runs_venv_and_caches(head, tmp_path):
    """What `ray job submit --working-dir .` uploads: the job lists its own working directory. A
    runs/ folder is made for the check (the tests keep their runs elsewhere, and a fresh checkout
    has none, so without it the check could not fail)."""
    runs = os.path.join(ROOT, "runs")
    made = not os.path.exists(runs)
    probe = os.path.join(runs, "upload-probe")
    os.makedirs(probe, exist_ok=True)
    with open(os.path.join(probe, "x.txt"), "w") as f:
        f.write("not for the cluster")
    try:
        r = head.job_submit("python", "-c", "import os; print(sorted(os.listdir('.')))")
    finally:
        shutil.rmtree(runs if made else probe, ignore_errors=True)
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
                 *sets(MOVIELENS_SMALL))
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
