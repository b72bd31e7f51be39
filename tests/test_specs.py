"""Every YAML under jobs/ and tune/ loads and validates, and starts with the command that runs it."""

import glob
import os

import pytest

from rayload import load_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AB = sorted(glob.glob(os.path.join(ROOT, "jobs", "ab_*.y*ml")))
PIPELINES = sorted(glob.glob(os.path.join(ROOT, "jobs", "*_pipeline.y*ml")))
JOBS = sorted(set(glob.glob(os.path.join(ROOT, "jobs", "*.y*ml"))) - set(AB) - set(PIPELINES))
TUNE = sorted(glob.glob(os.path.join(ROOT, "tune", "*.y*ml")))


def test_there_are_job_specs():
    assert any(p.endswith("movielens_deepfm.yaml") for p in JOBS)


@pytest.mark.parametrize("path", JOBS + TUNE + AB + PIPELINES, ids=os.path.basename)
def test_spec_starts_with_its_command(path):
    with open(path) as f:
        head = [f.readline() for _ in range(3)]
    assert any(line.startswith("# rayload ") or line.startswith("# ray job submit") for line in head), head


@pytest.mark.parametrize("path", JOBS, ids=os.path.basename)
def test_job_spec_validates(path):
    spec = load_spec(path)
    assert spec.name


@pytest.mark.parametrize("path", TUNE, ids=os.path.basename)
def test_search_spec_validates(path):
    from rayload import load_search_spec  # arrives with the tuning issue

    assert load_search_spec(path)


@pytest.mark.parametrize("path", AB, ids=os.path.basename)
def test_ab_spec_validates(path):
    from rayload.ab_spec import load_ab_spec

    spec = load_ab_spec(path)
    assert len(spec.arms) == 2 and all(a.checkpoint or os.path.exists(a.job) for a in spec.arms)


@pytest.mark.parametrize("path", PIPELINES, ids=os.path.basename)
def test_pipeline_spec_validates_with_every_spec_it_names(path):
    from rayload.pipeline_spec import load_pipeline_spec

    spec = load_pipeline_spec(path)
    assert [s.kind for s in spec.stages] == ["prepare", "train", "tune", "ab", "decide"]


@pytest.mark.parametrize("path", JOBS + TUNE + AB + PIPELINES, ids=os.path.basename)
def test_every_spec_runs_with_rayload_run(path):
    """`rayload run` (and so `ray job submit ... -- rayload run FILE`) takes every spec file."""
    from rayload.pipeline_spec import load_pipeline

    assert load_pipeline(path).stages
