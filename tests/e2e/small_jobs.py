"""Every spec in jobs/ as a small `ray job submit --working-dir .` run (test_job_submit.py), except
those another test runs the same way (ELSEWHERE): the MovieLens job, which `rayload submit` runs
as the same job with the uploaded working dir."""

import json
import os

from ray_head import ROOT, Head

# Tiny versions of each spec, so every file in jobs/ runs as a job within seconds. A spec added
# to jobs/ without an entry here fails test_every_job_spec_has_a_small_run.
SMALL = {
    "synthetic_dlrm.yaml": ["train.data.source.rows=3000", "train.data.source.shard_rows=1500", "train.train.epochs=1",
                            "train.train.batch_size=256"],
    "ab_movielens.yaml": ['ab.arms.0.set=["train.epochs=1", "model.hidden=[16]"]', 'ab.arms.1.set=["train.epochs=1", "model.hidden=[16]"]',
                          "ab.simulate.requests=300", "ab.serving.port=8781"],
    # every stage kind as a submitted job (test_demo.py runs it whole, but through `rayload demo`'s
    # embedded Ray, not as a job with an uploaded working dir)
    "movielens_pipeline.yaml": ["baseline.train.epochs=1", "baseline.model.hidden=[16]",
                                "search.num_samples=1", "search.startup_trials=1", "search.scheduler.max_epochs=1",
                                "search.scheduler.grace_period=1", "ab.simulate.requests=300", "ab.serving.port=8782"],
}
# Specs a job here would only repeat: what runs them instead.
ELSEWHERE = {# the same `rayload run` of the same file as a job with the uploaded working dir, by `rayload submit`
             # (`ray job submit` itself: the other specs here, and test_fake_cluster.py's training job of this file)
             "movielens_deepfm.yaml": "tests/e2e/test_job_submit.py::test_rayload_submit_runs_a_spec_with_the_uploaded_code"}
# The small settings of the specs run elsewhere from here.
MOVIELENS_SMALL = ["train.train.epochs=1", "train.model.hidden=[16]"]


def sets(items):
    return [a for item in items for a in ("--set", item)]


def submit_and_check(head: Head, spec: str) -> None:
    r = head.job_submit("rayload", "run", f"jobs/{spec}", *sets(SMALL[spec]))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "succeeded" in r.stdout + r.stderr
    with open(os.path.join(head.home, _run_id(spec), "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["stages"] and all(s["outcome"] == "ok" for s in manifest["stages"])
    assert manifest["versions"]["ray"] == "2.60.0" and manifest["specs"]
    if spec == "ab_movielens.yaml":  # both arms run the same small job here (an A/A test): trained once, shared
        runs = os.listdir(os.path.join(head.home, "train"))  # one run, named by the arm and what it trains
        assert len(runs) == 1 and runs[0].startswith("ab-ab_movielens-baseline-"), runs
        checkpoints = manifest["stages"][0]["outputs"]["checkpoints"]
        assert checkpoints["baseline"] == checkpoints["challenger"], checkpoints


def _run_id(spec: str) -> str:
    import yaml

    with open(os.path.join(ROOT, "jobs", spec)) as f:
        return yaml.safe_load(f)["name"]
