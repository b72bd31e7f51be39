"""`rayload compress CHECKPOINT --set ...` without --spec: the overrides apply to the job spec in
the checkpoint's manifest (they were silently dropped); a bad one is named before any work."""

from types import SimpleNamespace

import pytest
import yaml
from typer.testing import CliRunner

from helpers import job
from rayload import compression
from rayload.errors import SpecError


class _Stop(Exception):
    pass


@pytest.fixture()
def preprocessed(monkeypatch):
    seen = []

    def preprocess(spec, address=None):
        seen.append(spec)
        raise _Stop

    monkeypatch.setattr("rayload.data.pipeline.preprocess", preprocess)
    return seen


def _source(tmp_path):
    return SimpleNamespace(manifest={"spec": job(str(tmp_path / "train.parquet")).model_dump(mode="json")}, features=None)


def test_overrides_apply_to_the_manifests_job_spec(tmp_path, preprocessed):
    with pytest.raises(_Stop):
        compression._validation_data("ck", _source(tmp_path), None, None, ["data.source.path=/data/moved.parquet", "train.batch_size=64"])
    assert preprocessed[0].data.source.path == "/data/moved.parquet" and preprocessed[0].train.batch_size == 64


def test_a_bad_override_is_named_before_preprocessing(tmp_path, preprocessed):
    with pytest.raises(SpecError, match=r"train.batch_sise: unknown field.*did you mean 'batch_size'") as err:
        compression._validation_data("ck", _source(tmp_path), None, None, ["train.batch_sise=64"])
    assert "ck/manifest.json" in str(err.value) and preprocessed == []


def test_the_cli_hands_set_to_compress_without_spec_and_to_the_spec_with_it(tmp_path, monkeypatch):
    from rayload import _cli_life  # noqa: F401  (registers `compress`, as cli.main does)
    from rayload.cli import app

    calls = []
    monkeypatch.setattr(compression, "compress", lambda checkpoint, method, **options: calls.append(options) or (_ for _ in ()).throw(_Stop()))
    CliRunner().invoke(app, ["compress", "ck", "--set", "train.batch_size=64"])
    assert calls[-1]["overrides"] == ["train.batch_size=64"] and calls[-1]["spec"] is None
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(job(str(tmp_path / "d.parquet")).model_dump(mode="json", exclude_none=True)))
    CliRunner().invoke(app, ["compress", "ck", "--spec", str(spec), "--set", "train.batch_size=64"])
    assert calls[-1]["overrides"] == [] and calls[-1]["spec"].train.batch_size == 64


def test_overrides_with_a_spec_given_are_refused_naming_both(tmp_path):
    with pytest.raises(compression.RayloadError, match=r"overrides \['train.epochs=1'\] change the job spec in the checkpoint's manifest"):
        compression.compress("ck", "int8", spec=job(str(tmp_path / "d.parquet")), overrides=["train.epochs=1"])


def test_relative_data_paths_of_the_manifest_mean_the_folder_training_ran_in(tmp_path, preprocessed, monkeypatch):
    """Compressing from another folder read `synth/*.parquet` against that folder: no files."""
    spec = job("synth/*.parquet").model_dump(mode="json")
    source = SimpleNamespace(manifest={"spec": spec, "workdir": "/train/here"}, features=None)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(_Stop):
        compression._validation_data("ck", source, None, None, [])
    assert preprocessed[-1].data.source.path == "/train/here/synth/*.parquet"
    monkeypatch.chdir("/")  # the same folder as training: as written, so the preprocessing cache entry is the same
    source.manifest["workdir"] = "/"
    with pytest.raises(_Stop):
        compression._validation_data("ck", source, None, None, [])
    assert preprocessed[-1].data.source.path == "synth/*.parquet"


def test_a_features_mismatch_says_whether_the_data_or_the_spec_changed(tmp_path):
    """Data rewritten since training was blamed on the spec ('pass the job spec it was trained
    with'), which the user had passed; the manifest's data hash tells the two apart."""
    from rayload.evaluate import _not_a_checkpoint
    from rayload.train.identity import features_differ

    trained = job("/data/a.parquet")
    manifest = {"spec": trained.model_dump(mode="json"), "data_hash": "135ac6", "cache_key": "k"}
    moved = job("/elsewhere/a.parquet")  # the same sections, the files moved: the rows are what changed
    assert "trained on other data than the spec reads now" in features_differ("ck", manifest, moved, "fix it")
    other = job("/data/a.parquet", split={"seed": 7})
    assert features_differ("ck", manifest, other, "fix it") == \
        "ck was trained with other preprocessing than the spec gives (split.seed 0 -> 7): features.json differs; fix it"
    assert features_differ("ck", {}, other, "fix it").endswith("(features.json differs); fix it")
    assert "does not exist" in _not_a_checkpoint("runs/x", str(tmp_path / "x"))
    (tmp_path / "run" / "epoch_0001").mkdir(parents=True)
    assert _not_a_checkpoint("runs/run", str(tmp_path / "run")).endswith("is a run folder; name one of its checkpoints: epoch_0001")


def test_a_fine_tuned_checkpoints_mismatch_does_not_blame_init_from(tmp_path, monkeypatch):
    """compress points init_from at the checkpoint itself to read its features; the mismatch
    message compared that rewritten spec and blamed train.init_from for a change in the data."""
    from rayload.errors import DataError
    from rayload.train.identity import features_differ

    trained = job("/data/a.parquet", train={"init_from": "/runs/train/parent/epoch_0003"})
    monkeypatch.setattr("rayload.data.pipeline.preprocess", lambda spec, address=None: SimpleNamespace(features="now", files={"val": [1]}))
    source = SimpleNamespace(manifest={"spec": trained.model_dump(mode="json"), "git_commit": "abc123"}, features="then")
    with pytest.raises(DataError) as err:
        compression._validation_data("/runs/train/child/epoch_0001", source, None, None, [])
    assert "trained on other data than the spec reads now" in str(err.value) and "at commit abc123" in str(err.value)
    # a stored spec this rayload cannot read gives the plain message, not every default as a difference
    old = dict(trained.model_dump(mode="json"), retired_section={})
    assert features_differ("ck", {"spec": old}, trained, "fix it").endswith("(features.json differs); fix it")
