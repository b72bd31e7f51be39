"""The command line as a new user meets it (a review's walk through it): a spec of another kind
named in one sentence, `rayload validate` for every kind, empty run names, a cluster file that is
a folder or not UTF-8, `submit --address host:port`, `doctor --specs` of nothing, and a search
spec's grace period refused before Ray starts. No Ray."""

import os

import pytest
from typer.testing import CliRunner

from _ops import JOB, cli_app
from rayload.errors import RayloadError, SpecError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BAYES, PIPELINE, AB, DEEPFM = (os.path.join(ROOT, *p) for p in (("tune", "movielens_bayes.yaml"), ("jobs", "movielens_pipeline.yaml"),
                                                                  ("jobs", "ab_movielens.yaml"), ("jobs", "movielens_deepfm.yaml")))


@pytest.mark.parametrize("command,spec,what,takes", [
    ("train", BAYES, "a search spec \\(it has `space:`\\): run it with `rayload tune`", "a job spec"),
    ("train", PIPELINE, "a pipeline \\(it has `stages:`\\): run it with `rayload run`", "a job spec"),
    ("evaluate", AB, "an A/B spec \\(it has `arms:`\\): serve it with `rayload serve`", "a job spec"),
    ("tune", DEEPFM, "a job spec \\(it has none of `stages:`, `space:`, `arms:`\\): train it with `rayload train`", "a search spec"),
    ("serve", DEEPFM, "a job spec .*: train it with `rayload train`", "an A/B spec")])
def test_a_spec_of_another_kind_is_named_in_one_sentence(command, spec, what, takes, monkeypatch):
    """A search spec given to `rayload train` listed 13 missing or unknown fields."""
    import importlib

    importlib.import_module("rayload._cli_ab")
    monkeypatch.setenv("RAYLOAD_HOME", "/nonexistent-rayload-home")  # nothing may be written: the spec is refused first
    args = [command, spec] + (["--checkpoint", "/x"] if command == "evaluate" else [])
    r = CliRunner().invoke(cli_app(), args)
    assert r.exit_code == 2, r.output
    assert "1 problem(s)" in r.output and __import__("re").search(f"this is {what}; this command takes {takes}", r.output), r.output


@pytest.mark.parametrize("spec,kind", [(BAYES, "search"), (PIPELINE, "pipeline"), (AB, "ab")])
def test_validate_takes_every_spec_kind(spec, kind):
    r = CliRunner().invoke(cli_app(), ["validate", spec])
    assert r.exit_code == 0 and f"{kind} spec valid" in r.output, r.output
    bad = CliRunner().invoke(cli_app(), ["validate", spec, "--set", "name=a b"])  # and refuses a bad one of that kind
    assert bad.exit_code == 2 and "name" in bad.output, bad.output


def test_an_empty_run_id_or_run_name_is_refused_not_read_as_none(tmp_path):
    """`run --run-id ''` ran the pipeline under its own name (Ray started); `train --run-name ''`
    skipped the run_name pattern and trained a fresh run."""
    from rayload import stages
    from rayload.pipeline_spec import load_pipeline

    with pytest.raises(RayloadError, match="--run-id must not be empty"):
        stages.run(load_pipeline(PIPELINE), run_id="")
    spec = tmp_path / "job.yaml"
    spec.write_text(JOB)
    r = CliRunner().invoke(cli_app(), ["train", str(spec), "--run-name", ""])
    assert r.exit_code == 2 and "train.run_name" in r.output, r.output


def test_a_cluster_file_that_is_a_folder_or_not_utf8_is_a_message(tmp_path):
    from rayload.cluster import read_cluster

    with pytest.raises(SpecError, match="is a folder, not a cluster file"):
        read_cluster(str(tmp_path))
    (tmp_path / "bin.yaml").write_bytes(b"\x00\xff\xfe")
    with pytest.raises(SpecError, match="not valid YAML"):
        read_cluster(str(tmp_path / "bin.yaml"))
    r = CliRunner().invoke(cli_app(), ["cluster", "lint", str(tmp_path)])
    assert r.exit_code == 2 and "is a folder" in r.output, r.output


def test_submit_takes_host_port_like_ray_job_submit(tmp_path, monkeypatch):
    """Without http:// the job API check failed with httpx's "missing an 'http://' or 'https://'
    protocol", read as an unreachable cluster."""
    from rayload import ops

    seen = []
    monkeypatch.setattr(ops, "check_job_api", lambda url, auth: (seen.append(url), (_ for _ in ()).throw(RayloadError("stop")))[1])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text(JOB)
    with pytest.raises(RayloadError, match="stop"):
        ops.submit("job.yaml", "127.0.0.1:8265")
    assert seen == ["http://127.0.0.1:8265"]


def test_doctor_with_no_specs_to_read_says_so(tmp_path, monkeypatch):
    """A missing or empty --specs folder made the GPU and database checks pass on nothing."""
    from rayload import ops

    for name in ("_ray_check", "_versions", "_auth", "_storage"):
        monkeypatch.setattr(ops, name, lambda *a, name=name: ops.Check(name, True, ""))
    monkeypatch.setattr(ops, "_port", lambda port: ops.Check("port", True, ""))
    for folder in (tmp_path / "nosuch", tmp_path):
        checks = ops.doctor(specs=str(folder))
        assert checks[-1].name == "specs" and checks[-1].detail.startswith(f"skipped: no *.yaml specs in {str(folder)!r}")
        assert not any("GPU" in c.name or "database" in c.name for c in checks)


def test_a_grace_period_past_the_trials_epochs_is_refused_before_ray_starts(monkeypatch):
    from rayload import tuning

    def no_ray(*a, **k):
        raise AssertionError("Ray started before the spec was checked")

    monkeypatch.setattr(tuning, "ensure_ray", no_ray)
    with pytest.raises(SpecError, match=r"scheduler.grace_period: must be at most the trials' epochs"):
        tuning.tune(BAYES, overrides=["scheduler.max_epochs=null", "scheduler.grace_period=50"])


def test_an_ab_command_before_serve_or_with_a_missing_spec_says_which(tmp_path, monkeypatch):
    """`ab status nosuch.yaml` read the missing spec as a run name, and a run never served listed
    one folder twice with no word of `rayload serve`."""
    from rayload.serve.run_state import load_state

    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path))
    with pytest.raises(RayloadError, match=r"^spec file not found: nosuch.yaml$"):
        load_state("nosuch.yaml")
    folder = str(tmp_path / "ab" / "exp")
    with pytest.raises(RayloadError, match=r"no serve.json in .*; an experiment gets its run folder when `rayload serve SPEC` starts it") as info:
        load_state(folder)
    assert str(info.value).split("no serve.json in ")[1].count(folder) == 1  # listed once, not twice


def test_structured_without_prune_is_refused_not_ignored():
    """`compress --structured` with the default --method int8 wrote an int8 model."""
    from rayload.compression import compress

    with pytest.raises(RayloadError, match="--structured applies to --method prune only"):
        compress("/no/such/checkpoint", "int8", structured=True)


def test_amount_without_prune_is_refused_not_ignored(tmp_path):
    """`compress --amount 0.9` with the default --method int8 was ignored: an int8 model was
    written; left out, prune still cuts half."""
    from typer.testing import CliRunner

    from rayload import _cli_life  # noqa: F401  (registers compress)
    from rayload.cli import app
    from rayload.compression import compress

    with pytest.raises(RayloadError, match="--amount applies to --method prune only"):
        compress("/no/such/checkpoint", "int8", amount=0.9)
    out = CliRunner().invoke(app, ["compress", str(tmp_path / "none"), "--amount", "0.9"])
    assert out.exit_code == 2 and "--amount applies to --method prune only" in out.output
    with pytest.raises(RayloadError, match="no checkpoint|does not exist|not found"):  # the default amount passes the checks
        compress(str(tmp_path / "none"), "prune")


def test_brackets_in_paths_and_values_are_printed_as_they_are(tmp_path):
    """Messages went through Rich markup: '[/x]' in a path raised MarkupError (a traceback) and
    '[draft]' vanished from the path shown."""
    folder = tmp_path / "exp [draft]"
    (folder / "[").mkdir(parents=True)
    odd = folder / "[" / "x]ok.yaml"  # ".../exp [draft]/[/x]ok.yaml"
    odd.write_text(open(BAYES).read().replace("../jobs/", os.path.join(ROOT, "jobs") + "/"))
    r = CliRunner().invoke(cli_app(), ["validate", str(odd)])
    assert r.exit_code == 0 and f"{odd}: search spec valid" in r.output.replace("\n", ""), r.output
    r = CliRunner().invoke(cli_app(), ["validate", str(folder / "nope.yaml")])
    assert r.exit_code == 2 and "exp [draft]" in r.output and "Traceback" not in r.output, r.output
    r = CliRunner().invoke(cli_app(), ["validate", BAYES, "--set", "space.train.lr={loguniform: [nan, 0.01]}"])
    assert r.exit_code == 2 and "[nan, 0.01]" in r.output.replace("\n", ""), r.output


def test_column_names_with_brackets_print_in_the_feature_table():
    """A data column named clicks[/7d] raised MarkupError after preprocessing had finished;
    price[usd] was shown as price."""
    import io

    from rich.console import Console

    from rayload.cli import feature_table
    from rayload.features import CategoricalState, FittedFeatures, LabelState, NumericState

    renamed = FittedFeatures(numeric=[NumericState("clicks[/7d]", 0.0, None, None, False, "zscore")],
                             categorical=[CategoricalState("price[usd]", "vocab", vocab=["1", "2"])], crosses=[],
                             label=LabelState("y", "binary"), columns=[])
    out = io.StringIO()
    Console(file=out, width=200).print(feature_table(renamed))
    assert "clicks[/7d]" in out.getvalue() and "price[usd]" in out.getvalue()
