"""Spec values that loaded and failed later, and errors that named no spec path: a spec file
that is not UTF-8 or is a folder, sleeps longer than time.sleep takes, a grid too large to
count, resource amounts Ray cannot place, hash tables past int64, and union fields whose errors
carried pydantic's member tags (`resources.workers.int`, `data.source.csv.path.str`)."""

import os
import subprocess
import sys

import pytest
import yaml

from rayload.ab_spec import ab_from_dict
from rayload.errors import SpecError
from rayload.search_spec import grid_size
from rayload.spec import load_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "jobs", "movielens_deepfm.yaml")


def _job(tmp_path, **sections):
    raw = yaml.safe_load(open(JOB))
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _issues(path) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return [issue.render() for issue in info.value.issues]


def test_a_spec_file_that_is_not_utf8_or_is_a_folder_is_a_spec_error_exit_2(tmp_path):
    """A byte that is not UTF-8 (even in a comment) raised UnicodeDecodeError, a folder
    IsADirectoryError: tracebacks with exit 1."""
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"# caf\xe9\nname: t\n")
    assert any("not valid YAML" in i and "position" in i for i in _issues(str(bad)))
    assert any("is a folder, not a spec file" in i for i in _issues(str(tmp_path)))
    utf8 = tmp_path / "utf8.yaml"  # UTF-8 reads whatever the locale
    utf8.write_bytes(b"# caf\xc3\xa9\n" + open(JOB, "rb").read())
    code = f"from rayload.spec import load_spec; print(load_spec({str(utf8)!r}).name)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C", "LANG": "C"})
    assert done.returncode == 0 and done.stdout.strip() == "movielens_deepfm", done.stderr
    cli = subprocess.run([os.path.join(os.path.dirname(sys.executable), "rayload"), "validate", str(bad)], capture_output=True, text=True)
    assert cli.returncode == 2 and "not valid YAML" in cli.stderr + cli.stdout and "Traceback" not in cli.stderr


def test_resource_amounts_ray_cannot_place_are_refused_at_load(tmp_path):
    """1.5 GPUs per worker (Ray takes fractions only below 1) and 1e-5 CPUs (Ray's unit is
    0.0001) loaded and failed when the workers were placed."""
    assert _issues(_job(tmp_path, resources={"gpus_per_worker": 1.5})) == [
        "resources.gpus_per_worker: Ray places GPUs above 1 only in whole units: use 1 or 2 (got 1.5)"]
    assert _issues(_job(tmp_path, resources={"cpus_per_worker": 0.00001})) == [
        "resources.cpus_per_worker: Ray counts resources in steps of 0.0001 (got 1e-05)"]
    for fine in (0.25, 2, 0.0001):
        assert load_spec(_job(tmp_path, resources={"gpus_per_worker": fine})).resources.gpus_per_worker == fine
    assert load_spec(_job(tmp_path, resources={"cpus_per_worker": 1.5})).resources.cpus_per_worker == 1.5  # Ray places 1.5 CPUs


def test_union_fields_are_named_by_their_spec_path_with_only_the_fitting_members_error(tmp_path):
    """`workers: {min: 3, max: 2}` printed `resources.workers.int: Input should be a valid
    integer` beside the real error under `resources.workers.function-after[_order(),
    ElasticWorkers]`; `workers: 0` was reported at `resources` with the whole section."""
    assert _issues(_job(tmp_path, resources={"workers": {"min": 3, "max": 2}})) == [
        "resources.workers: min must be <= max, got min=3, max=2 (got {'max': 2, 'min': 3})"]
    assert _issues(_job(tmp_path, resources={"workers": 0})) == ["resources.workers: Input should be greater than or equal to 1 (got 0)"]
    assert _issues(_job(tmp_path, resources={"workers": {"mn": 1, "max": 2}})) == [
        "resources.workers.min: Field required", "resources.workers.mn: unknown field; allowed: max, min; did you mean 'min'?"]
    assert _issues(_job(tmp_path, data={"source": {"kind": "csv", "path": 5}})) == [
        "data.source.path: Input should be a valid string or a valid list (got 5)"]
    assert _issues(_job(tmp_path, data={"source": {"kind": "csv", "path": "a.csv", "sep": ","}})) == [
        "data.source.sep: unknown field; allowed: kind, path"]


def test_hash_buckets_past_an_embedding_table_are_refused(tmp_path):
    """2**64 buckets loaded and overflowed np.uint64 in the transform; from 2**63 IDs went negative."""
    issues = _issues(_job(tmp_path, features={"categorical": {"userId": {"encode": "hash", "buckets": 2**64}}}))
    assert len(issues) == 1 and issues[0].startswith("features.categorical.userId.buckets: Input should be less than 2147483648")
    issues = _issues(_job(tmp_path, features={"crosses": [{"columns": ["userId", "movieId"], "buckets": 2**40}]}))
    assert len(issues) == 1 and issues[0].startswith("features.crosses.0.buckets: Input should be less than 2147483648")


@pytest.mark.parametrize("section, field, value, limit", [
    ("events", "flush_ms", 1e300, 60_000), ("events", "fsync_s", 1e300, 86_400),
    ("drift", "flush_s", 1e300, 86_400), ("ramp", "interval_s", 1e300, 86_400),
])
def test_sleeps_longer_than_a_day_are_refused_at_load(section, field, value, limit):
    """1e300 passed the inf/NaN check and overflowed time.sleep / Event.wait inside the event
    writer (whose thread died, so every later submit hung), the drift monitor and the ramp loop."""
    arms = [{"name": "a", "weight": 0.5, "checkpoint": "x"}, {"name": "b", "weight": 0.5, "checkpoint": "x"}]
    with pytest.raises(SpecError, match=rf"{section}\.{field}: Input should be less than or equal to {limit}"):
        ab_from_dict({"name": "ab", "arms": arms, section: {field: value}})
    assert getattr(getattr(ab_from_dict({"name": "ab", "arms": arms, section: {field: limit}}), section), field) == limit


def test_a_grid_too_large_to_run_is_refused_by_its_size_not_an_overflow(tmp_path):
    """`{int: [1, 10**30]}` raised OverflowError from len(range(...)) (a traceback, exit 1)."""
    from rayload.search_job import load_search_spec

    def search(space):
        path = tmp_path / "s.yaml"
        path.write_text(yaml.safe_dump({"name": "s", "base": JOB, "strategy": "grid", "space": space}))
        return str(path)

    with pytest.raises(SpecError) as info:
        load_search_spec(search({"train.epochs": {"int": [1, 10**30]}}))
    text = str(info.value)
    assert "space.train.epochs: int bounds must fit in 64 bits" in text and "the grid has 1,000,000,000,000,000,000,000,000,000,000 points" in text
    with pytest.raises(SpecError, match=r"space: the grid has 1,000,000 points, each a trial.*at most 100,000"):
        load_search_spec(search({"train.epochs": {"int": [1, 1000]}, "train.batch_size": {"int": [1, 1000]}}))
    assert grid_size(load_search_spec(search({"train.epochs": {"int": [2, 10], "step": 4}}))) == 3  # 2, 6, 10


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_search_specs_trial_resources_must_be_finite(tmp_path, value):
    """A search spec may write numbers as .inf: cpus_per_worker .inf raised OverflowError from
    the whole-units check, .nan said "cannot convert float NaN to integer"."""
    from rayload.search_job import load_search_spec

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": JOB, "strategy": "random", "num_samples": 2,
                                    "space": {"train.lr": {"loguniform": [0.001, 0.01]}},
                                    "trial_resources": {"cpus_per_worker": value}}))
    with pytest.raises(SpecError, match=r"trial_resources.cpus_per_worker: must be a finite number"):
        load_search_spec(str(path))
