"""The A/B commands as a user runs them: `rayload serve` in one process, `rayload ab ...` in
others (set-weights reaches the serving process's Ray with its token), an API key on the
ingress, `serve build` writing a config Serve's own schema accepts."""

import json
import re
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

pytestmark = pytest.mark.e2e
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAYLOAD = os.path.join(os.path.dirname(sys.executable), "rayload")
PORT = 8772
KEY = "s3cret-test-key"


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    home = tmp_path_factory.mktemp("abcli")
    spec = home / "ab.yaml"
    job = os.path.join(ROOT, "jobs", "movielens_deepfm.yaml")
    spec.write_text("# rayload serve ab.yaml\n" + yaml.safe_dump({
        "name": "ab_cli",
        "arms": [{"name": "baseline", "weight": 0.9, "job": job, "set": ["train.epochs=1", "model.embedding_dim=8"]},
                 {"name": "challenger", "weight": 0.1, "job": job, "set": ["train.epochs=2", "model.embedding_dim=8"]}],
        "serving": {"port": PORT, "api_key_env": "RAYLOAD_TEST_KEY"},
        "analysis": {"min_units": 50}, "ramp": {"min_units_per_step": 10},
        "simulate": {"source": "movielens", "users": 300, "requests": 700, "concurrency": 8}}))
    env = dict(os.environ, RAYLOAD_HOME=str(home / "runs"), RAYLOAD_TEST_KEY=KEY, COLUMNS="200")
    log = open(home / "serve.log", "w")  # a file, not a pipe: an unread pipe would fill and block the server
    proc = subprocess.Popen([RAYLOAD, "serve", str(spec), "--no-auto"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None and "serving ab_cli at" not in (home / "serve.log").read_text():
        time.sleep(1)
    text = (home / "serve.log").read_text()
    assert "serving ab_cli at http://127.0.0.1:" in text, text[-4000:]
    yield {"spec": str(spec), "env": env, "home": home}
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=60) == 0  # stops cleanly: deletes its app, shuts its Ray down
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def test_api_key_guards_the_ingress(running):
    url = f"http://127.0.0.1:{PORT}"
    assert httpx.get(f"{url}/healthz").status_code == 401
    assert httpx.get(f"{url}/healthz", headers={"x-api-key": "wrong"}).status_code == 401
    assert httpx.get(f"{url}/healthz", headers={"x-api-key": KEY}).status_code == 200


def test_set_weights_from_another_process_and_bad_weights_refused(cli, running):
    r = cli("ab", "set-weights", running["spec"], "baseline=0.75", "challenger=0.25", env=running["env"])
    assert r.returncode == 0, r.stdout + r.stderr
    health = httpx.get(f"http://127.0.0.1:{PORT}/healthz", headers={"x-api-key": KEY}).json()
    assert health["weights"] == {"baseline": 0.75, "challenger": 0.25}
    bad = cli("ab", "set-weights", running["spec"], "baseline=0.75", "challenger=0.5", env=running["env"])
    assert bad.returncode == 2 and "sum to 1.0" in bad.stderr and "Traceback" not in bad.stderr
    assert httpx.get(f"http://127.0.0.1:{PORT}/healthz", headers={"x-api-key": KEY}).json()["weights"]["challenger"] == 0.25


def test_simulate_status_and_report(cli, running):
    r = cli("ab", "simulate", running["spec"], env=running["env"], timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    decision = r.stdout.split("decision: ")[-1].split()[0]
    assert decision in ("promote", "rollback", "continue")
    status = cli("ab", "status", running["spec"], "--json", env=running["env"])
    assert status.returncode == 0, status.stderr
    analysis = json.loads(status.stdout)
    assert sum(a["exposures"] for a in analysis["arms"]) > 300 and analysis["srm_flagged"] is False
    # the decision printed is the experiment's (its three values alone were all the check took):
    # a promote or rollback is final, and status reports it; a continue says why
    if decision in ("promote", "rollback"):
        assert analysis["decision"] == decision, analysis["reasons"]
        weights = httpx.get(f"http://127.0.0.1:{PORT}/healthz", headers={"x-api-key": KEY}).json()["weights"]
        assert weights["challenger"] == (1.0 if decision == "promote" else 0.0), weights
    else:
        assert analysis["reasons"], analysis
    report = cli("ab", "report", running["spec"], env=running["env"])
    assert report.returncode == 0
    page = (running["home"] / "runs" / "ab" / "ab_cli" / "report.html").read_text()
    assert "data:image/png;base64," in page and f'id="decision">{analysis["decision"]}<' in page


def test_retrain_from_the_logged_movielens_feedback_writes_the_next_experiment(cli, running):
    # After test_simulate_status_and_report: hundreds of MovieLens exposures with their clicks.
    run = running["home"] / "runs" / "ab" / "ab_cli"
    address = json.loads((run / "serve.json").read_text())["address"]  # the serving process's Ray
    time.sleep(1.5)  # every exposure older than the 1 s attribution window: all labels known
    r = cli("retrain", "jobs/movielens_deepfm.yaml", "--from-events", "ab_cli", "--window", "all", "--attribution", "1s",
            "--min-auc-gain=-1", "--weight", "0.2", "--set", "train.epochs=1", "--address", address, env=running["env"], timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "labelled exposures" in r.stdout and "next experiment" in r.stdout
    assert re.search(r"held-out AUC \(test split of the event rows, \d+ rows, \d+ positive\): champion [\d.]+, retrained", r.stdout)
    assert re.search(r"95% interval \[[-+][\d.]+, [-+][\d.]+\], p=\S+ \(DeLong, paired\)", r.stdout), r.stdout
    path = r.stdout.split("rayload serve ")[-1].split()[0]
    nxt = yaml.safe_load(open(path).read())
    assert [(a["name"], a["weight"]) for a in nxt["arms"]] == [("baseline", 0.8), ("retrained", 0.2)] and nxt["name"] != "ab_cli"
    manifest = json.loads(open(os.path.join(nxt["arms"][1]["checkpoint"], "manifest.json")).read())
    assert manifest["spec"]["train"]["init_from"] == nxt["arms"][0]["checkpoint"]  # warm-started from the champion


def test_serve_build_writes_a_config_serve_accepts(cli, running, tmp_path):
    from ray.serve.schema import ServeDeploySchema

    out = tmp_path / "serve_config.yaml"
    r = cli("--verbose", "serve", "build", running["spec"], "--out", str(out), env=running["env"])
    assert r.returncode == 0, r.stderr
    # the arms' runs trained to their end when serving started: read off their records, not relaunched
    assert r.stderr.count("trained to its end") == 2 and "Started a local Ray instance" not in r.stderr, r.stderr[-3000:]
    config = yaml.safe_load(out.read_text())
    schema = ServeDeploySchema.model_validate(config)
    assert schema.applications[0].import_path == "rayload.serve.app:build_app"
    assert config["http_options"]["host"] == "127.0.0.1"
