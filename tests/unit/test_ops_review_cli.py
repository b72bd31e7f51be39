"""`rayload demo --spec` on a pipeline whatever its stages are named, and the cluster commands'
and doctor's user errors as exit-2 messages instead of tracebacks."""

import os
import shutil

import pytest
import yaml
from typer.testing import CliRunner

from _ops import cli_app
from rayload.errors import RayloadError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------- rayload demo --spec


def _pipeline(tmp_path, stages) -> str:
    for name in ("movielens_deepfm.yaml", "ab_movielens.yaml"):
        shutil.copy(os.path.join(ROOT, "jobs", name), tmp_path / name)
    shutil.copy(os.path.join(ROOT, "tune", "movielens_bayes.yaml"), tmp_path / "bayes.yaml")
    text = (tmp_path / "bayes.yaml").read_text().replace("../jobs/", "")
    (tmp_path / "bayes.yaml").write_text(text)
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump({"name": "p", "stages": stages}))
    return str(path)


def test_demo_options_go_to_the_pipelines_stages_of_each_kind_whatever_their_names(tmp_path):
    from rayload._cli_ops import demo_sets
    from rayload.pipeline_spec import load_pipeline

    path = _pipeline(tmp_path, [{"name": "base", "kind": "train", "job": "movielens_deepfm.yaml"},
                                {"name": "hpo", "kind": "tune", "search": "bayes.yaml"},
                                {"name": "experiment", "kind": "ab", "spec": "ab_movielens.yaml", "champion": "base", "challenger": "hpo"}])
    sets = demo_sets(path, 8123, trials=6, search_epochs=3, ab_requests=500)
    assert sets == ["experiment.serving.port=8123", "experiment.simulate.requests=500", "hpo.num_samples=6", "hpo.startup_trials=3",
                    "hpo.scheduler.max_epochs=3"]
    load_pipeline(path, sets)  # every item reaches its stage


def test_demo_trials_on_a_random_search_stage_set_no_startup_trials(tmp_path):
    """startup_trials is for Bayesian searches; `--trials` set it on every tune stage, which a random one refuses."""
    from rayload._cli_ops import demo_sets
    from rayload.pipeline_spec import load_pipeline

    shutil.copy(os.path.join(ROOT, "tune", "movielens_random.yaml"), tmp_path / "random.yaml")
    (tmp_path / "random.yaml").write_text((tmp_path / "random.yaml").read_text().replace("../jobs/", ""))
    path = _pipeline(tmp_path, [{"name": "base", "kind": "train", "job": "movielens_deepfm.yaml"},
                                {"name": "hpo", "kind": "tune", "search": "bayes.yaml"},
                                {"name": "wide", "kind": "tune", "search": "random.yaml"}])
    sets = demo_sets(path, 8123, trials=6)
    assert sets == ["hpo.num_samples=6", "hpo.startup_trials=3", "wide.num_samples=6"]
    load_pipeline(path, sets)


def test_demo_on_a_pipeline_without_an_ab_stage_sets_no_port(tmp_path):
    from rayload._cli_ops import demo_sets

    path = _pipeline(tmp_path, [{"name": "base", "kind": "train", "job": "movielens_deepfm.yaml"}])
    assert demo_sets(path, 8000) == []
    with pytest.raises(RayloadError, match="--trials: the pipeline .* has no tune stage"):
        demo_sets(path, 8000, trials=4)
    r = CliRunner().invoke(cli_app(), ["demo", "--spec", path, "--trials", "4"])
    assert r.exit_code == 2 and "no tune stage" in r.output, r.output


# ---------------------------------------------------------------- cluster commands and doctor: exit 2, no traceback


def test_cluster_commands_report_bad_files_and_options_as_messages(tmp_path):
    app = cli_app()
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    bare = tmp_path / "bare.yaml"
    bare.write_text("cluster_name: x\n")
    listed = tmp_path / "listed.yaml"
    listed.write_text("cluster_name: x\navailable_node_types: [head]\nhead_node_type: head\n")
    out = str(tmp_path / "fake.json")
    runs = {
        ("cluster", "lint", str(bad)): "not valid YAML",
        ("cluster", "lint", str(listed)): "available_node_types",
        ("cluster", "local", str(bad), "--out", out): "not valid YAML",
        ("cluster", "local", str(bare), "--out", out): "available_node_types",
        ("cluster", "local", os.path.join(ROOT, "cluster.yaml"), "--gcs-address", "6380", "--out", out): "--gcs-address",
    }
    for args, said in runs.items():
        r = CliRunner().invoke(app, list(args))
        assert r.exit_code == 2 and said in r.output and "Traceback" not in r.output, (args, r.output)
    assert not os.path.exists(out)


def test_doctor_prints_a_users_error_as_a_message(monkeypatch):
    import rayload.ops

    def refuse(*a):
        raise RayloadError("nothing answers at 10.0.0.9:6379")

    monkeypatch.setattr(rayload.ops, "doctor", refuse)
    r = CliRunner().invoke(cli_app(), ["doctor", "--address", "10.0.0.9:6379"])
    assert r.exit_code == 2 and "nothing answers" in r.output, r.output


def test_user_errors_of_synth_doctor_report_and_ab_status_exit_2_naming_the_path(tmp_path, monkeypatch):
    """Each was a traceback with exit 1: `data synth --out` onto a file, `doctor --serve-port
    80000` (after every cluster check had run), `report` of a damaged manifest.json, and `ab
    status` of a serve.json without its config."""
    import importlib

    importlib.import_module("rayload._cli_ab")  # registers `ab` on the app
    runner = CliRunner()
    app = cli_app()
    (tmp_path / "afile.txt").write_text("x")
    out = runner.invoke(app, ["data", "synth", "--rows", "10", "--out", str(tmp_path / "afile.txt")])
    assert out.exit_code == 2 and f"cannot write the synthetic data to {tmp_path / 'afile.txt'}" in out.output, out.output
    out = runner.invoke(app, ["doctor", "--address", "127.0.0.1:1", "--serve-port", "80000"])
    assert out.exit_code == 2 and "Invalid value for '--serve-port'" in out.output, out.output
    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path / "runs"))
    (tmp_path / "runs" / "mypipe").mkdir(parents=True)
    (tmp_path / "runs" / "mypipe" / "manifest.json").write_text('{"run_id": "mypipe", "stages": [')
    out = runner.invoke(app, ["report", "mypipe"])
    assert out.exit_code == 2 and "manifest.json is damaged" in out.output, out.output
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "serve.json").write_text('{"address": null}')
    out = runner.invoke(app, ["ab", "status", str(tmp_path / "ab")])
    assert out.exit_code == 2 and "serve.json is damaged (no Serve config in it)" in out.output, out.output


def test_a_uri_for_the_run_folders_or_the_cache_is_refused_naming_the_variable(monkeypatch):
    """RAYLOAD_CACHE=s3://bucket/cache became a local folder named "s3:" under the working directory."""
    from rayload.paths import cache_root, runs_root

    monkeypatch.setenv("RAYLOAD_CACHE", "s3://bucket/cache")
    with pytest.raises(RayloadError, match=r"RAYLOAD_CACHE=s3://bucket/cache: a folder path, not a URI"):
        cache_root()
    monkeypatch.delenv("RAYLOAD_CACHE")
    monkeypatch.setenv("RAYLOAD_HOME", "gs://bucket/runs")
    with pytest.raises(RayloadError, match=r"RAYLOAD_HOME=gs://bucket/runs: a folder path"):
        runs_root()


@pytest.mark.parametrize("name, text", [("serve.json", '{"config": {}}'), ("serve.json", '{"config": {"applications": []}}'),
                                        ("serve.json", '{"config": {"applications": [{"args": {}}]}}'), ("serve.json", None),
                                        ("search.json", "[1]"), ("search.json", "{}"), ("search.json", None),
                                        ("manifest.json", "{}"), ("manifest.json", '{"stages": [1]}'), ("manifest.json", None)])
def test_damaged_run_files_are_named_not_a_traceback(tmp_path, monkeypatch, name, text):
    """A serve.json without its Serve application, a search.json that is a list or lacks its
    study, a manifest whose stages are not stages, or any of them a folder: KeyError,
    IndexError, TypeError or IsADirectoryError tracebacks from ab status, tune status and report."""
    import importlib

    importlib.import_module("rayload._cli_ab")
    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path / "home"))
    run = tmp_path / "run"
    run.mkdir()
    if text is None:
        (run / name).mkdir()
    else:
        (run / name).write_text(text)
    command = {"serve.json": ["ab", "status"], "search.json": ["tune", "status"], "manifest.json": ["report"]}[name]
    out = CliRunner().invoke(cli_app(), [*command, str(run)])
    assert out.exit_code == 2 and f"{name} is damaged" in out.output and "Traceback" not in out.output, out.output


def test_data_synth_refuses_a_blank_out(tmp_path, monkeypatch):
    """--out '' wrote part-00000.parquet into the working folder and printed 'to ' with exit 0."""
    monkeypatch.chdir(tmp_path)
    out = CliRunner().invoke(cli_app(), ["data", "synth", "--out", " ", "--rows", "10"])
    assert out.exit_code == 2 and "--out" in out.output and "give a folder or URI" in out.output, out.output
    assert os.listdir(tmp_path) == []
