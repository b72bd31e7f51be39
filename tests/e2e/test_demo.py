"""`rayload demo` (= `make demo`) and `rayload run` as a user runs them: the pipeline's five
stages in their folders, the progress bars and summary, the manifest, skipping what did not
change and re-running what did, a failing stage, and the report opened in headless Chromium.
One demo run (small settings) serves the whole module."""

import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import yaml
from small_jobs import sets

pytestmark = pytest.mark.e2e
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PIPELINE = os.path.join(ROOT, "jobs", "movielens_pipeline.yaml")
# The demo's own options plus small stages; `rayload run` with the same items finds them unchanged.
SETS = ["ab.serving.port=8771", "search.num_samples=2", "search.startup_trials=2", "search.scheduler.max_epochs=2",
        "ab.simulate.requests=300", "baseline.train.epochs=2"]


@pytest.fixture(scope="module")
def demo(cli, tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    r = cli("demo", "--trials", "2", "--search-epochs", "2", "--port", "8771", "--ab-requests", "300",
            "--set", "baseline.train.epochs=2", home=home, timeout=800)
    assert r.returncode == 0, r.stderr[-3000:]
    return home, r.stdout


def _manifest(home, run_id="demo"):
    with open(os.path.join(home, run_id, "manifest.json")) as f:
        return json.load(f)


def test_demo_runs_the_pipeline_and_prints_the_summary(demo):
    home, out = demo
    for stage in ("prepare (prepare)", "baseline (train)", "search (tune)", "ab (ab)", "decide (decide)"):
        assert stage in out  # one progress bar per stage
    assert "data: 100004 ratings" in out
    auc = float(out.split("baseline: val AUC ")[1].split("; test AUC ")[1].split()[0])
    assert 0.75 < auc < 0.9
    best = float(out.split("best tuned (trial ")[1].split("test AUC ")[1].split(";")[0])
    assert 0.7 < best < 0.9  # two trials of at most two epochs: below the baseline is expected
    assert os.path.exists(out.split("configuration ")[1].split()[0])  # best.yaml
    decision = out.split("A/B decision: ")[1].split()[0]
    assert decision in ("promote", "rollback", "continue")
    # Never in favour of the model that is worse offline; `continue` says how many units it lacks.
    if decision == "promote":
        assert best > auc
    if decision == "rollback":
        assert best < auc
    if decision == "continue":
        assert "more units" in out or "needs" in out
    assert out.split("report: ")[1].split()[0] == str(home / "demo" / "report.html")


def test_each_stage_writes_its_folder(demo):
    home, _ = demo
    run_dir = home / "demo"
    for name in ("prepare", "baseline", "search", "ab", "decide"):
        assert json.loads((run_dir / name / "stage.json").read_text())["outcome"] == "ok"
    assert (run_dir / "prepare" / "features.json").exists()
    outputs = {s["name"]: s["outputs"] for s in _manifest(home)["stages"]}
    assert outputs["baseline"]["checkpoint"].startswith(str(run_dir / "baseline"))
    assert outputs["search"]["checkpoint"].startswith(str(run_dir / "search"))
    assert (run_dir / "ab" / "events.db").exists()
    decision = json.loads((run_dir / "decide" / "decision.json").read_text())
    assert set(decision["arms"]) == {"baseline", "challenger"}
    assert sum(a["exposures"] for a in decision["arms"].values()) >= 300


def test_manifest_has_versions_commit_seeds_hashes_specs_and_durations(demo):
    home, _ = demo
    manifest = _manifest(home)
    assert manifest["versions"]["ray"] == "2.60.0" and manifest["versions"]["torch"].startswith("2.13")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert manifest["git_commit"] == head
    assert manifest["seeds"]["baseline"] == 0 and "search" in manifest["seeds"]
    # the prepared data's content hash (sha256), as the checkpoints record it; the inputs' cache key apart
    assert len(manifest["data_hashes"]["prepare"]) == 64 and manifest["data_hashes"]["prepare"] == manifest["data_hashes"]["baseline"]
    assert len(manifest["data_cache_keys"]["prepare"]) == 16 and manifest["data_cache_keys"]["prepare"] == manifest["data_cache_keys"]["baseline"]
    assert manifest["specs"]["baseline"]["train"]["epochs"] == 2
    assert [s["name"] for s in manifest["stages"]] == ["prepare", "baseline", "search", "ab", "decide"]
    assert all(s["seconds"] > 0 and s["outcome"] == "ok" for s in manifest["stages"])


def test_a_rerun_skips_unchanged_stages_and_reruns_changed_ones(cli, demo):
    home, _ = demo
    r = cli("run", PIPELINE, "--run-id", "demo", *sets(SETS), home=home, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [s["outcome"] for s in _manifest(home)["stages"]] == ["skipped"] * 5
    changed = [s for s in SETS if not s.startswith("ab.simulate")] + ["ab.simulate.requests=100"]
    r = cli("run", PIPELINE, "--run-id", "demo", *sets(changed), home=home, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    stages = _manifest(home)["stages"]
    assert [s["outcome"] for s in stages] == ["skipped", "skipped", "skipped", "ok", "ok"]
    # the changed experiment starts from an empty folder: none of the first run's events
    assert sum(a["exposures"] for a in stages[4]["outputs"]["arms"].values()) < 300


def test_a_failing_stage_stops_the_run_and_says_why(cli, demo, tmp_path):
    import pandas as pd

    home, _ = demo
    pd.DataFrame({"a": [1.0, 2.0, 3.0], "y": [0, 1, 0]}).to_parquet(tmp_path / "part.parquet")
    job = {"name": "broken_job", "data": {"source": {"kind": "parquet", "path": str(tmp_path)},
                                          "columns": [{"name": "a", "role": "numeric"}, {"name": "b", "role": "numeric"}],
                                          "label": {"column": "y"}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    raw = {"name": "broken", "stages": [{"name": "prepare", "kind": "prepare", "job": "job.yaml"},
                                        {"name": "baseline", "kind": "train", "job": "job.yaml"},
                                        {"name": "again", "kind": "train", "job": "job.yaml"}]}
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(raw))
    r = cli("run", str(tmp_path / "broken.yaml"), home=home, timeout=600)
    assert r.returncode == 2  # a user's error (the missing column), as `rayload train` exits
    assert "stage prepare failed" in r.stdout and "'b'" in r.stdout  # the missing column is named
    assert [s["outcome"] for s in _manifest(home, "broken")["stages"]] == ["failed"]  # nothing after it ran


def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None:  # Debian's package; the test installs it when it is missing
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        if subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], capture_output=True, timeout=900, env=env).returncode:
            subprocess.run(["apt-get", "update", "-q"], check=True, capture_output=True, timeout=600)
            subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], check=True, capture_output=True, timeout=900, env=env)
        path = shutil.which("chromium")
    return path


def test_report_is_self_contained_and_renders_in_chromium_with_plots_and_key_numbers(cli, demo, tmp_path):
    from PIL import Image

    home, _ = demo
    r = cli("report", "demo", home=home, timeout=600)
    assert r.returncode == 0, r.stderr
    path = str(home / "demo" / "report.html")
    stages = {s["name"]: s["outputs"] for s in _manifest(home)["stages"]}
    base_auc, best_auc = stages["baseline"]["test"]["auc"], stages["search"]["best"]["test"]["auc"]
    decision = stages["decide"]["decision"]
    shot = tmp_path / "report.png"
    # One Chromium run: the screenshot, the DOM after scripts ran, and the console on stderr.
    r = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
                        f"--screenshot={shot}", "--dump-dom", "--window-size=1200,3000", f"file://{path}"],
                       capture_output=True, text=True, timeout=120)
    console = [line for line in r.stderr.splitlines() if "CONSOLE" in line]
    assert not [line for line in console if "Uncaught" in line or "Error" in line], console
    # What the page promises (report.py: no script, no network), which the console cannot show: a
    # missing image or stylesheet logs no console line
    html = open(path).read()
    assert "<script" not in html.lower()
    linked = re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)""", html, re.I)
    assert all(link.startswith(("data:", "#")) for link in linked), [link[:80] for link in linked if not link.startswith(("data:", "#"))]
    pixels = np.asarray(Image.open(shot).convert("L"), dtype=float)
    assert pixels.std() > 20  # not a blank page
    dom = r.stdout
    for text in (f"{base_auc:.4f}", f"{best_auc:.4f}", f'id="decision">{decision}<', "Training curves", "Search", "A/B experiment"):
        assert text in dom
    # training curves, search history, CTR per arm (and the lift when there is a challenger)
    assert dom.count('src="data:image/png;base64,') >= 3
