"""Search-spec review fixes (2026-11-27), each refused before a trial or before Ray starts:
searched paths that overlap (or a fixed value under a searched one), infinite bounds, a step that
does not divide its range, a key written twice in the YAML; best.yaml keeps an integer field an
integer; tune_function minimises a known maximised metric no more, and checks `cpus` first."""

import math
import os

import pytest
import yaml

from rayload import load_search_spec, tuning
from rayload._tune_report import write_best_spec
from rayload.errors import SpecError
from rayload.search_job import base_raw, job_from
from rayload.search_spec import SearchSpec
from rayload.spec import load_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = os.path.join(ROOT, "jobs", "movielens_deepfm.yaml")


def _problems(tmp_path, **fields) -> str:
    raw = {"name": "s", "base": BASE, "space": {"train.lr": {"loguniform": [1e-4, 1e-2]}}, **fields}
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(SpecError) as info:
        load_search_spec(str(path))
    return str(info.value)


def test_overlapping_searched_paths_and_a_fixed_value_under_a_searched_one_are_refused(tmp_path):
    msg = _problems(tmp_path, space={"model.hidden.0": {"choice": [16, 32]}, "model.hidden": {"choice": [[128, 64], [256, 128]]}})
    assert "space.model.hidden.0: lies inside space.model.hidden, which is searched too" in msg, msg
    msg = _problems(tmp_path, fixed={"train.lr": 0.5})
    assert "fixed.train.lr: is also searched as space.train.lr" in msg, msg
    msg = _problems(tmp_path, fixed={"model.hidden.0": 8}, space={"model.hidden": {"choice": [[128, 64], [256, 128]]}})
    assert "fixed.model.hidden.0: is inside searched as space.model.hidden" in msg or "fixed.model.hidden.0: is inside" in msg, msg
    # a fixed section with a searched field in it stays legal: the searched value is applied after
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": BASE, "space": {"model.hidden.0": {"choice": [16, 32]}},
                                    "fixed": {"model.hidden": [64, 32]}}))
    assert load_search_spec(str(path)).space


@pytest.mark.parametrize("bounds", [[0.001, math.inf], [-math.inf, 0.1], [0.0, math.nan]])
def test_infinite_or_nan_bounds_are_refused_naming_the_path(tmp_path, bounds, tune_before_ray):
    msg = _problems(tmp_path, space={"model.dropout": {"uniform": bounds}})
    assert "space.model.dropout: uniform bounds must be finite numbers" in msg, msg
    with pytest.raises(SpecError, match="space.x: loguniform bounds must be finite"):
        tuning.tune_function(lambda c: c["x"], {"x": {"loguniform": [1e-3, math.inf]}})


@pytest.mark.parametrize("param, last", [({"uniform": [0.1, 0.3], "step": 0.5}, "0.1"), ({"int": [8, 16], "step": 32}, "8"),
                                         ({"uniform": [0.0, 0.9], "step": 0.4}, "0.8")])
def test_a_step_that_does_not_divide_the_range_is_refused_with_the_last_value_drawn(tmp_path, param, last):
    path = "model.embedding_dim" if "int" in param else "model.dropout"
    msg = _problems(tmp_path, space={path: param})
    if param["step"] > param.get("uniform", param.get("int"))[1] - param.get("uniform", param.get("int"))[0]:
        assert f"space.{path}: step {param['step']:g} is larger than the range" in msg and f"every trial would draw {last}" in msg, msg
    else:
        assert f"space.{path}: [" in msg and f"the sampler would never draw past {last}" in msg, msg


def test_steps_that_divide_the_range_pass(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": BASE, "space": {"model.dropout": {"uniform": [0.0, 0.3], "step": 0.1},
                                                                        "model.embedding_dim": {"int": [8, 64], "step": 8}}}))
    assert set(load_search_spec(str(path)).space) == {"model.dropout", "model.embedding_dim"}


def test_a_key_written_twice_in_the_yaml_is_refused_naming_it_and_its_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(f"name: s\nbase: {BASE}\nspace:\n  train.lr: {{loguniform: [0.0003, 0.01]}}\n"
                    "  train.lr: {loguniform: [0.1, 0.5]}\n")
    with pytest.raises(SpecError) as info:
        load_search_spec(str(path))
    assert "found the key 'train.lr' twice (first on line 4)" in str(info.value) and "line 5" in str(info.value)
    job = tmp_path / "job.yaml"
    job.write_text(open(BASE).read() + "\ntrain:\n  lr: 0.5\n")  # a second `train:` section
    with pytest.raises(SpecError, match="found the key 'train' twice"):
        load_spec(str(job), [])
    anchors = tmp_path / "anchors.yaml"  # a merge may still be overridden, as YAML intends
    anchors.write_text("a: &a {x: 1, y: 2}\nb:\n  <<: *a\n  x: 3\n")
    from rayload._spec_load import read_yaml

    assert read_yaml(str(anchors))["b"] == {"x": 3, "y": 2}


def test_best_yaml_writes_an_integer_field_drawn_from_a_stepped_uniform_range_as_an_integer(tmp_path):
    spec = SearchSpec.model_validate({"name": "t", "base": BASE, "strategy": "random", "num_samples": 2,
                                      "space": {"model.embedding_dim": {"uniform": [8, 64], "step": 8}, "train.lr": {"loguniform": [1e-4, 1e-2]}}})
    raw = base_raw(spec, None)
    params = {"model.embedding_dim": 40.0, "train.lr": 0.003}
    job_from(raw, params)
    write_best_spec(raw, params, str(tmp_path / "best.yaml"), ["best"])
    text = (tmp_path / "best.yaml").read_text()
    assert "embedding_dim: 40\n" in text and "40.0" not in text, text
    assert load_spec(str(tmp_path / "best.yaml"), []).model.embedding_dim == 40


@pytest.mark.parametrize("cpus", [-1, 0, math.nan, "2", True])
def test_tune_function_refuses_bad_cpus_naming_it_before_ray_and_leaves_no_run_folder(tune_before_ray, cpus):
    with pytest.raises(SpecError) as info:
        tuning.tune_function(lambda c: c["x"], {"x": {"uniform": [0, 1]}}, cpus=cpus)
    assert "cpus: each trial's CPUs: a number > 0" in str(info.value)
    assert not (tune_before_ray / "tune").exists()


def test_a_cluster_that_cannot_be_reached_leaves_no_empty_run_folder(tune_before_ray):
    with pytest.raises(AssertionError, match="Ray was started"):
        tuning.tune_function(lambda c: c["x"], {"x": {"uniform": [0, 1]}})
    assert not (tune_before_ray / "tune").exists()


def test_a_key_written_twice_in_a_set_value_is_refused_as_in_a_file():
    from rayload.spec import load_spec

    with pytest.raises(SpecError, match=r"--set: found the key 'patience' twice"):
        load_spec(BASE, ["train.early_stopping={metric: auc, patience: 2, patience: 5}"])
    assert load_spec(BASE, ["train.early_stopping={metric: auc, patience: 5}"]).train.early_stopping.patience == 5


def test_merges_of_merges_load_and_a_text_field_takes_a_repeated_key_as_its_text(tmp_path):
    """Flattening a mapping that merges another copied the other's merged keys into it, which the
    repeated-key check then read as keys written twice (yaml.safe_load reads it fine)."""
    from rayload._spec_load import read_yaml

    path = tmp_path / "m.yaml"
    path.write_text("l: [&base {x: 0}, &mid {<<: *base, x: 1}]\ntop: {<<: *mid, y: 1}\n")
    assert read_yaml(str(path)) == {"l": [{"x": 0}, {"x": 1}], "top": {"x": 1, "y": 1}}
    # A job spec whose train section is a merge of a merge, with a --set text value holding a repeated key
    job = yaml.safe_load(open(os.path.join(ROOT, "jobs", "movielens_deepfm.yaml")))
    job.pop("train")
    path.write_text(yaml.safe_dump(job, sort_keys=False) + "train: {<<: &mid {<<: &base {epochs: 3, lr: 0.01}, epochs: 2}, seed: 5}\n")
    spec = load_spec(str(path), ["data.label.column={a, a}"])
    assert (spec.train.epochs, spec.train.lr, spec.train.seed) == (2, 0.01, 5)
    assert spec.data.label.column == "{a, a}"  # a text field takes the text as given


def test_a_searched_path_inside_a_section_the_base_job_writes_null_starts_that_section(tmp_path):
    """`early_stopping: null` loads as the section left out, and known_paths took
    train.early_stopping.patience; then every value failed with "cannot set a field inside a
    value that is not a section"."""
    job = yaml.safe_load(open(os.path.join(ROOT, "jobs", "movielens_deepfm.yaml")))
    job["train"]["early_stopping"] = None
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(job))
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({"name": "s", "base": "base.yaml", "strategy": "random", "num_samples": 2,
                                                     "space": {"train.early_stopping.patience": {"choice": [2, 3]}}}))
    search = load_search_spec(str(tmp_path / "s.yaml"))
    assert job_from(base_raw(search, None), {"train.early_stopping.patience": 3}).train.early_stopping.patience == 3


def test_a_searched_section_with_mapping_values_is_refused_and_null_stays_a_choice(tmp_path):
    """fixed.<section> was refused for replacing the section whole, space.<section> was not: a
    choice of {patience: 5} gave every trial (and best.yaml) early stopping without the base's
    metric, and a choice of {name: deepfm, embedding_dim: 8} dropped the base's hidden layers."""
    msg = _problems(tmp_path, space={"train.early_stopping": {"choice": [{"patience": 2}, {"patience": 5}]}})
    assert ("space.train.early_stopping: names a section of the job spec, which each value here would replace whole" in msg
            and "space.train.early_stopping.patience" in msg), msg
    msg = _problems(tmp_path, space={"model": {"choice": [{"name": "deepfm", "embedding_dim": 8}]}})
    assert "space.model: names a section" in msg and "space.model.name" in msg, msg
    path = tmp_path / "off.yaml"  # a section searched as on or off: null with the base's own section is not a mapping choice
    path.write_text(yaml.safe_dump({"name": "s", "base": BASE, "space": {"train.early_stopping": {"choice": [None]},
                                                                        "train.lr": {"loguniform": [1e-4, 1e-2]}}}))
    assert load_search_spec(str(path)).space


def test_tune_function_with_asha_needs_its_most_steps_before_ray(tune_before_ray):
    """ASHA's max_t was 100 unsaid: a function reporting more steps was cut at 100 and recorded complete."""
    with pytest.raises(SpecError, match="scheduler.max_epochs: a searched function has no epochs to default to"):
        tuning.tune_function(lambda c: c["x"], {"x": {"uniform": [0, 1]}}, scheduler={"kind": "asha"})
    with pytest.raises(AssertionError, match="Ray was started"):  # with it, the checks pass
        tuning.tune_function(lambda c: c["x"], {"x": {"uniform": [0, 1]}}, scheduler={"kind": "asha", "max_epochs": 500})


@pytest.mark.parametrize("fn, field", [("not a function", "fn"), (None, "fn"), (lambda: 1.0, "fn"), (lambda a, b: a, "fn")])
def test_tune_function_refuses_an_objective_that_cannot_take_one_dict_before_ray(tune_before_ray, fn, field):
    """A string or a lambda of no arguments started Ray and failed every trial inside it."""
    with pytest.raises(SpecError, match=f"{field}: the objective"):
        tuning.tune_function(fn, {"x": {"uniform": [0, 1]}})
    with pytest.raises(SpecError, match="address: a Ray address"):
        tuning.tune_function(lambda c, scale=1: c["x"] * scale, {"x": {"uniform": [0, 1]}}, address=5)
    with pytest.raises(AssertionError, match="Ray was started"):  # one dict, extra defaults: the checks pass
        tuning.tune_function(lambda c, scale=1: c["x"] * scale, {"x": {"uniform": [0, 1]}})


@pytest.mark.parametrize("values", [[1, 1.0], [8, 8.0, 16], [[64, 32], [64.0, 32.0]]])
@pytest.mark.parametrize("kind", ["grid", "choice"])
def test_a_list_with_a_value_twice_by_value_is_refused(tmp_path, values, kind):
    """8 and 8.0 are one value once the job spec reads them: a grid ran that trial twice, a choice drew it twice as often."""
    space = {"model.embedding_dim": values if kind == "grid" else {"choice": values}}
    if isinstance(values[0], list):
        space = {"model.hidden": values if kind == "grid" else {"choice": values}}
    assert "lists a value twice" in _problems(tmp_path, space=space, strategy="grid" if kind == "grid" else "random")


def test_true_and_one_stay_two_values_of_a_choice(tmp_path):
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": BASE, "strategy": "random",
                                    "space": {"train.lr": {"loguniform": [1e-4, 1e-2]}, "model.batch_norm": {"choice": [True, False]}}}))
    assert load_search_spec(str(path)).space["model.batch_norm"].choice == [True, False]


@pytest.mark.parametrize("strategy", ["random", "grid"])
def test_startup_trials_outside_bayes_is_said_when_the_search_starts_and_a_resume_still_takes_it(tmp_path, strategy):
    """It was ignored without a word. Refusing it instead left a search started with it unresumable
    (its spec refused, or else differing from the stored one), so the search says it ignores it."""
    from rayload.search_spec import ignored_settings

    space = {"train.lr": [0.001, 0.01]} if strategy == "grid" else {"train.lr": {"loguniform": [1e-4, 1e-2]}}
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": BASE, "space": space, "strategy": strategy, "startup_trials": 3}))
    spec = load_search_spec(str(path))
    assert ignored_settings(spec, 8) == [f"startup_trials 3 is for strategy bayes; a {strategy} search draws every trial alike "
                                         "and ignores it"]
    bayes = spec.model_copy(update={"strategy": "bayes", "space": {"train.lr": spec.space["train.lr"]}})
    assert ignored_settings(bayes, 3) == ["startup_trials 3 >= the search's 3 trials: every trial is drawn at random, none by the TPE model"]
    assert ignored_settings(bayes, 8) == []


def test_fixed_null_turns_an_optional_section_off(tmp_path):
    """fixed train.early_stopping: null was refused as 'names a section' (the benchmark's way to let
    every trial run its epochs), though None replaces nothing field by field."""
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": BASE, "strategy": "random", "space": {"train.lr": {"loguniform": [1e-4, 1e-2]}},
                                    "fixed": {"train.early_stopping": None}}))
    spec = load_search_spec(str(path))
    assert job_from(base_raw(spec, str(path)), {"train.lr": 0.001}).train.early_stopping is None


def test_a_job_whose_built_in_source_gives_the_label_can_be_searched(tmp_path):
    """data.label left out (synthetic-ctr names its own): the search's metric check read
    base.data.label.task and raised AttributeError, a traceback before anything ran."""
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": os.path.join(ROOT, "jobs", "synthetic_dlrm.yaml"), "strategy": "random",
                                    "space": {"train.lr": {"loguniform": [1e-3, 1e-2]}}, "num_samples": 2, "metric": "val_auc"}))
    assert load_search_spec(str(path)).metric == "val_auc"
