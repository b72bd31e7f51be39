"""Operations-surface review fixes (2026-11-27), without Ray: names that become folders are one
folder name (a --run-id of "." made a re-run delete runs/train); `rayload.evaluate` stays the SDK
function; arguments and options that were dropped without a word are refused by name; output
files are checked before the work; ~ and mount-table escapes in paths; true/false and inf in
number settings."""

import os
import shutil

import pytest
import yaml
from typer.testing import CliRunner

from _ops import JOB, cli_app
from rayload.errors import RayloadError, SpecError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEEPFM = os.path.join(ROOT, "jobs", "movielens_deepfm.yaml")


@pytest.fixture
def home(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path / "runs"))
    return tmp_path / "runs"


# ---------------------------------------------------------------- names that become folders


@pytest.mark.parametrize("run_id", [".", "..", "a/../train", "/abs/path", ".hidden"])
def test_a_run_id_that_is_not_one_folder_name_is_refused_before_anything_is_written(home, run_id):
    from rayload import stages
    from rayload.pipeline_spec import load_pipeline

    (home / "train" / "nightly").mkdir(parents=True)
    with pytest.raises(RayloadError, match=r"--run-id .* must be one folder name"):
        stages.run(load_pipeline(DEEPFM), run_id)
    assert os.listdir(home / "train") == ["nightly"] and sorted(os.listdir(home)) == ["train"]


@pytest.mark.parametrize("field, raw", [("name", {"name": ".."}), ("train.run_name", {"train": {"run_name": "."}})])
def test_a_job_name_or_run_name_of_dots_is_refused(field, raw, tmp_path):
    from rayload.spec import load_spec

    spec = yaml.safe_load(open(DEEPFM))
    for key, value in raw.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) else value
    (tmp_path / "j.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError, match=rf"{field}: String should match pattern"):
        load_spec(str(tmp_path / "j.yaml"), [])


def test_pipeline_and_stage_names_of_dots_are_refused(tmp_path):
    from rayload.pipeline_spec import load_pipeline_spec

    shutil.copy(DEEPFM, tmp_path / "job.yaml")
    for raw, field in (({"name": ".", "stages": [{"name": "t", "kind": "train", "job": "job.yaml"}]}, "name"),
                       ({"name": "p", "stages": [{"name": "..", "kind": "train", "job": "job.yaml"}]}, "stages.0.name")):
        (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
        with pytest.raises(SpecError, match=rf"{field}: String should match pattern"):
            load_pipeline_spec(str(tmp_path / "p.yaml"))


# ---------------------------------------------------------------- the SDK


def test_rayload_evaluate_stays_the_sdk_function_after_the_submodule_is_imported(tmp_path):
    import importlib

    import rayload

    importlib.import_module("rayload.evaluate")
    from rayload import evaluate
    from rayload.evaluate import evaluate_checkpoint  # the module's functions are still importable

    assert callable(evaluate) and evaluate is rayload.evaluate and callable(evaluate_checkpoint)
    # refused before preprocessing (which would start Ray): a mistyped split, a folder that is no checkpoint
    with pytest.raises(RayloadError, match=r"--split must be train, val or test \(got 'tset'\)"):
        rayload.evaluate(DEEPFM, str(tmp_path), split="tset")
    with pytest.raises(RayloadError, match=r"nope does not exist; name a checkpoint folder"):
        rayload.evaluate(DEEPFM, str(tmp_path / "nope"))


def test_run_refuses_overrides_it_cannot_apply_to_a_loaded_pipeline():
    import rayload
    from rayload.pipeline_spec import load_pipeline

    with pytest.raises(TypeError, match="overrides apply to a spec file"):
        rayload.run(load_pipeline(DEEPFM), overrides=["train.train.epochs=1"])


def test_a_pipeline_set_whose_head_is_no_stage_names_the_stages_and_the_fix():
    from rayload.pipeline_spec import load_pipeline

    # a single job run as its own stage takes the job's paths as they are (since 2026-11-27)
    assert load_pipeline(DEEPFM, ["model.embedding_dim=8"]).stages[0].set == ["model.embedding_dim=8"]
    with pytest.raises(SpecError, match=r"--set: the first part names a stage of the pipeline \(train\) or the pipeline's own "
                                        r"name or stages: STAGE.field=value changes one stage"):
        load_pipeline(DEEPFM, ["folder=/tmp"])
    assert load_pipeline(DEEPFM, ["train.model.embedding_dim=8"]).stages[0].set == ["model.embedding_dim=8"]


# ---------------------------------------------------------------- the CLI


def test_kfold_below_two_is_refused_naming_the_option(tmp_path):
    from rayload.spec import load_spec
    from rayload.train.kfold import kfold

    app = cli_app()
    for k in ("0", "1", "-1"):
        r = CliRunner().invoke(app, ["train", DEEPFM, "--kfold", k])
        assert r.exit_code == 2 and "--kfold" in r.output and "at least 2 folds" in r.output, r.output
    with pytest.raises(SpecError, match="--kfold: k-fold cross-validation needs at least 2 folds"):
        kfold(load_spec(DEEPFM, []), 1)


def _said(result) -> str:
    """The CLI's output as one line: rich wraps an error in a box across lines."""
    return " ".join(result.output.replace("│", " ").split())


def test_arguments_and_options_that_were_dropped_are_refused(tmp_path):
    import rayload._cli_ab  # noqa: F401  (registers `rayload serve`)

    app = cli_app()
    r = CliRunner().invoke(app, ["tune", "tune/movielens_bayes.yaml", "movielens_bayes-1"])
    assert r.exit_code == 2 and "--resume movielens_bayes-1" in _said(r), r.output
    r = CliRunner().invoke(app, ["tune", "status", "run1", "--resume", "x"])
    assert r.exit_code == 2 and "takes no --resume or --set" in _said(r), r.output
    for extra in (["other.yaml"], ["--out", "x.yaml"]):
        r = CliRunner().invoke(app, ["serve", "jobs/ab_movielens.yaml", *extra])
        assert r.exit_code == 2 and "rayload serve build SPEC --out FILE" in _said(r), r.output


def test_output_files_in_a_missing_folder_are_refused_before_the_work(tmp_path, home):
    app = cli_app()
    missing = str(tmp_path / "nodir" / "out.json")
    (tmp_path / "job.yaml").write_text(JOB)
    for args in (["evaluate", str(tmp_path / "job.yaml"), "--checkpoint", str(tmp_path), "--out", missing],
                 ["report", "nosuchrun", "--out", missing],
                 ["cluster", "local", os.path.join(ROOT, "cluster.yaml"), "--out", missing]):
        r = CliRunner().invoke(app, args)
        want = f"--out {missing}: the folder {tmp_path / 'nodir'} does not exist"
        assert r.exit_code == 2 and want.replace(" ", "") in _said(r).replace(" ", ""), (args, r.output)  # long paths wrap
    r = CliRunner().invoke(app, ["report", "nosuchrun", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "a folder; give a file name" in _said(r)


def test_demo_options_of_0_reach_validation_instead_of_being_dropped(tmp_path):
    from rayload._cli_ops import demo_sets

    demo = os.path.join(ROOT, "jobs", "movielens_pipeline.yaml")
    sets = demo_sets(demo, 8000, trials=0, ab_requests=0)
    assert any(s.endswith(".num_samples=0") for s in sets) and any(s.endswith(".simulate.requests=0") for s in sets)


# ---------------------------------------------------------------- paths


def test_tilde_in_the_cache_and_shared_paths_and_escaped_mount_points(monkeypatch, tmp_path):
    from rayload.paths import cache_root, local_path
    from rayload.train import resources

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RAYLOAD_CACHE", "~/rl-cache")
    assert cache_root() == str(tmp_path / "rl-cache") and local_path("~/ck") == str(tmp_path / "ck")
    monkeypatch.setenv("RAYLOAD_SHARED_PATHS", "~/team")
    assert resources.is_shared(str(tmp_path / "team" / "runs"), mounts_file=str(tmp_path / "none"))
    monkeypatch.delenv("RAYLOAD_SHARED_PATHS")
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\nserver:/export /mnt/team\\040share nfs4 rw 0 0\n")
    assert resources.is_shared("/mnt/team share/runs", mounts_file=str(mounts))
    assert not resources.is_shared("/mnt/team/runs", mounts_file=str(mounts))
    link = tmp_path / "link"
    os.symlink("/mnt/team share/runs", link)  # a symlink into the mount is on it
    assert resources.is_shared(str(link), mounts_file=str(mounts))


def test_a_tilde_data_path_is_the_home_folder(monkeypatch, tmp_path):
    from rayload.data.sources import _expand

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "d.csv").write_text("a,y\n1,0\n")
    assert _expand("~/d.csv", "csv")[1] == [str(tmp_path / "d.csv")]


# ---------------------------------------------------------------- number settings


@pytest.mark.parametrize("item, message", [("train.epochs=true", "train.epochs: a number, not true or false"),
                                           ("model.dropout=false", "model.dropout: a number, not true or false"),
                                           ("train.lr=.inf", "train.lr: Input should be a finite number"),
                                           ("data.label.threshold=.nan", "data.label.threshold: Input should be a finite number")])
def test_true_false_and_non_finite_values_for_numbers_are_refused_by_field(item, message):
    from rayload.spec import load_spec

    with pytest.raises(SpecError, match=message):
        load_spec(DEEPFM, [item])


def test_a_regression_domain_with_low_above_high_is_refused_and_a_scalar_path_override_is_text(tmp_path):
    from rayload.spec import load_spec

    raw = yaml.safe_load(JOB)
    raw["data"]["label"] = {"column": "clicked", "task": "regression", "domain": [5, 1]}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(SpecError, match=r"domain is \[low, high\] with low <= high"):
        load_spec(str(tmp_path / "r.yaml"), [])
    (tmp_path / "j.yaml").write_text(JOB)
    assert load_spec(str(tmp_path / "j.yaml"), ["data.source.path=2024-06-01"]).data.source.path == "2024-06-01"


def test_the_sdk_functions_train_and_evaluate_are_also_their_modules():
    """`import rayload.train.checkpoint as ckpt` failed (ImportError: cannot import name
    'checkpoint' from 'train'): that form of import walks attributes, and `rayload.train` was
    the SDK function. Both names are now the module, callable as the SDK function."""
    import importlib
    import inspect
    import subprocess
    import sys

    import rayload

    code = ("import rayload.train.checkpoint as ckpt, rayload.evaluate as ev, rayload;"
            "print(ckpt.__name__, ev.__name__, rayload.train.checkpoint is ckpt, callable(rayload.train), callable(ev))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["rayload.train.checkpoint", "rayload.evaluate", "True", "True", "True"]
    assert rayload.train is importlib.import_module("rayload.train") and rayload.evaluate is importlib.import_module("rayload.evaluate")
    assert list(inspect.signature(rayload.train).parameters) == ["spec", "address", "evaluate_test", "overrides"]
    assert rayload.train.__doc__.startswith("Preprocess and train a job spec")
    from rayload.train import fit, load  # the subpackage's own names

    assert callable(fit) and callable(load)
    import pickle

    import ray.cloudpickle

    for dumps in (pickle.dumps, ray.cloudpickle.dumps):  # by reference, as a plain function was (Ray ships closures over it)
        assert pickle.loads(dumps(rayload.train)) is rayload.train and pickle.loads(dumps(rayload.evaluate)) is rayload.evaluate


def test_demo_trials_of_0_are_refused_as_the_option_given():
    """`demo --trials 0` was refused as the search spec's num_samples, a field the user never wrote."""
    from typer.testing import CliRunner

    from rayload import _cli_ops  # noqa: F401  (registers demo)
    from rayload.cli import app

    for option in ("--trials", "--search-epochs"):
        r = CliRunner().invoke(app, ["demo", option, "0"])
        assert r.exit_code == 2 and f"Invalid value for '{option}'" in r.output and "num_samples" not in r.output, r.output


def test_walkthrough_output_fixes():
    """The README's SDK names GateRefused (it was only rayload.compression.GateRefused); a
    finished search's status says 'best', not 'best so far'; a searched path is shown whole."""
    import rayload
    from rayload import compression
    from rayload.cli import console, print_search_status

    assert rayload.GateRefused is compression.GateRefused and "GateRefused" in rayload.__all__
    row = {"number": 0, "state": "complete", "value": 0.61, "epochs": 2, "seconds": 7.5,
           "params": {"model.embedding_dim": 4, "train.lr": 0.0035}}
    for state, said in (("finished", "best: trial 0"), ("running", "best so far: trial 0")):
        with console.capture() as shown:
            print_search_status({"run_dir": "r", "state": state, "total": 1, "metric": "val_auc", "trials": [row], "best": row})
        assert said in shown.get()
        assert "model.embedding_…" not in shown.get()
