import textwrap

import pytest

from rayload import load_spec
from rayload.errors import SpecError


def write(tmp_path, text: str) -> str:
    p = tmp_path / "job.yaml"
    p.write_text(textwrap.dedent(text))
    return str(p)


GOOD = """
name: demo
data:
  source: {kind: movielens}
split: {kind: random, seed: 1}
features:
  numeric:
    year: {impute: mean, scale: minmax}
"""


def test_valid_spec_and_defaults(tmp_path):
    spec = load_spec(write(tmp_path, GOOD))
    assert spec.split.seed == 1 and spec.split.train == 0.8
    assert spec.data.resolved_label().threshold == 4.0
    assert {c.name for c in spec.data.resolved_columns()} >= {"userId", "movieId", "genres", "year"}


def test_overrides_apply_with_yaml_types(tmp_path):
    spec = load_spec(write(tmp_path, GOOD), ["split.seed=3", "features.numeric.year.log=true", "split.key=[userId]"])
    assert spec.split.seed == 3
    assert spec.features.numeric["year"].log is True
    assert spec.split.key == ["userId"]


def test_every_error_is_reported_with_path_value_and_file(tmp_path):
    path = write(tmp_path, """
        name: demo
        data:
          source: {kind: movielens}
          max_bad_fraction: 2
        split: {kind: randm}
        features:
          numeric:
            year: {scale: zscor, clipp: 1}
    """)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    err = info.value
    paths = {i.path for i in err.issues}
    assert {"data.max_bad_fraction", "split.kind", "features.numeric.year.scale", "features.numeric.year.clipp"} <= paths
    text = str(err)
    assert path in text and "'randm'" in text and "'zscor'" in text
    assert "did you mean 'clip'" in text
    assert "'random'" in text  # what is allowed


def test_cross_section_errors(tmp_path):
    path = write(tmp_path, """
        name: demo
        data:
          source: {kind: parquet, path: /nowhere}
          columns:
            - {name: a, role: numeric}
            - {name: b, role: multi_categorical}
          label: {column: y, task: regression, threshold: 1}
        split: {kind: temporal}
        rebalance: {method: upsample}
        features:
          numeric: {b: {}}
          categorical: {b: {encode: onehot}, zz: {}}
          crosses: [{columns: [a, b]}]
    """)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    paths = [i.path for i in info.value.issues]
    for expected in ["data.label.threshold", "rebalance.method", "features.numeric.b", "features.categorical.b.encode",
                     "features.categorical.zz", "features.crosses.0.columns", "split.kind"]:
        assert expected in paths, (expected, paths)


def test_split_fractions_must_sum_to_one(tmp_path):
    with pytest.raises(SpecError, match=r"sum to 1.0"):
        load_spec(write(tmp_path, GOOD), ["split.train=0.5"])


def test_file_source_needs_schema(tmp_path):
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, "name: x\ndata: {source: {kind: csv, path: a.csv}}\n"))
    assert {"data.columns", "data.label"} <= {i.path for i in info.value.issues}


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(SpecError, match="not found"):
        load_spec(str(tmp_path / "nope.yaml"))
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(write(tmp_path, "name: [unclosed\n"))
    with pytest.raises(SpecError, match="overrides look like"):
        load_spec(write(tmp_path, GOOD), ["split.seed"])


def test_clip_and_buckets_need_one_kind(tmp_path):
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, GOOD), ["features.numeric.year.clip={min: 3, quantiles: [0.1, 0.9]}",
                                          "features.numeric.year.buckets={}"])
    text = str(info.value)
    assert "either min/max bounds or quantiles" in text and "either boundaries" in text


def test_training_settings_that_cannot_work_are_refused(tmp_path):
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, GOOD), ["train.sync_bn=true", "train.accumulation=8", "train.batch_size=4",
                                          "model.sparse_embeddings=true", "resources.gpus_per_worker=1"])
    paths = [i.path for i in info.value.issues]
    assert paths.count("train.sync_bn") == 1 and "train.batch_size" in paths and "model.sparse_embeddings" in paths
    with pytest.raises(SpecError, match="train.sparse_optimizer.*applies only to sparse embedding tables"):
        load_spec(write(tmp_path, GOOD), ["train.sparse_optimizer=adagrad", "model.sparse_embeddings=false"])
    with pytest.raises(SpecError, match="min must be <= max"):
        load_spec(write(tmp_path, GOOD), ["resources.workers={min: 3, max: 2}"])
    assert load_spec(write(tmp_path, GOOD), ["resources.workers={min: 1, max: 2}"]).resources.workers.max == 2


def test_target_raw_without_target_stats_is_refused(tmp_path):
    """It was silently ignored: no raw-label statistic, no error."""
    with pytest.raises(SpecError, match=r"features.categorical.userId.target_raw: .*set features.categorical.userId.target_stats: true"):
        load_spec(write(tmp_path, GOOD), ["features.categorical.userId={target_raw: true}"])
    spec = load_spec(write(tmp_path, GOOD), ["features.categorical.userId={target_raw: true, target_stats: true}"])
    assert spec.features.categorical["userId"].target_raw


def test_batch_norm_over_one_row_micro_batches_is_refused(tmp_path):
    with pytest.raises(SpecError, match=r"train.batch_size: model.batch_norm needs micro-batches of at least 2 rows \(batch_size / accumulation = 8 / 8\)"):
        load_spec(write(tmp_path, GOOD), ["model.batch_norm=true", "train.batch_size=8", "train.accumulation=8"])
    assert load_spec(write(tmp_path, GOOD), ["model.batch_norm=true", "train.batch_size=8", "train.accumulation=4"]).train.accumulation == 4


def test_early_stopping_follows_a_metric_the_task_reports(tmp_path):
    regression = ["data.label={column: rating, task: regression}"]
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, GOOD), regression + ["train.early_stopping={metric: auc, patience: 2}"])
    (issue,) = info.value.issues
    assert issue.path == "train.early_stopping.metric" and issue.value == "auc"
    assert "a regression label (data.label.task: regression) reports rmse" in issue.message
    with pytest.raises(SpecError, match=r"train.early_stopping.metric: a binary label .* reports auc or logloss"):
        load_spec(write(tmp_path, GOOD), ["train.early_stopping={metric: rmse}"])
    assert load_spec(write(tmp_path, GOOD), regression + ["train.early_stopping={metric: rmse}"]).train.early_stopping.metric == "rmse"
    assert load_spec(write(tmp_path, GOOD), regression + ["train.early_stopping={patience: 2}"]).train.early_stopping.metric is None


def test_a_training_seed_outside_what_the_generators_take_is_refused(tmp_path):
    """A negative train.seed loaded, then failed at epoch 1 in the worker cache's numpy order."""
    for bad in ("-1", str(2**64)):
        with pytest.raises(SpecError) as info:
            load_spec(write(tmp_path, GOOD), [f"train.seed={bad}"])
        assert [i.path for i in info.value.issues] == ["train.seed"]
    assert load_spec(write(tmp_path, GOOD), [f"train.seed={2**63}"]).train.seed == 2**63


def test_an_override_into_a_default_list_or_an_unset_section(tmp_path):
    """--set model.hidden.0=8 on a spec without model.hidden made hidden {'0': 8}; a misspelt
    field of an unset section (train.early_stopping) was 'unknown field' without the allowed ones."""
    assert load_spec(write(tmp_path, GOOD), ["model.hidden.0=8"]).model.hidden == [8, 128]
    with pytest.raises(SpecError, match=r"train.early_stopping.patiance: unknown field; allowed: metric, min_delta, patience; did you mean 'patience'"):
        load_spec(write(tmp_path, GOOD), ["train.early_stopping.patiance=3"])


TWO_STAMPS = """
name: demo
data:
  source: {kind: parquet, path: /nowhere}
  columns:
    - {name: signup_ts, role: timestamp}
    - {name: event_ts, role: timestamp}
    - {name: f, role: numeric}
  label: {column: y}
split: {kind: temporal}
"""



def test_a_temporal_split_over_two_timestamp_columns_must_name_one(tmp_path):
    """The first declared timestamp column was cut on silently (signup time, not event time)."""
    with pytest.raises(SpecError, match=r"split.time_column: data.columns declares 2 timestamp columns \(signup_ts, event_ts\); "
                                        r"name the one a temporal split cuts on"):
        load_spec(write(tmp_path, TWO_STAMPS))
    assert load_spec(write(tmp_path, TWO_STAMPS), ["split.time_column=event_ts"]).split.time_column == "event_ts"
    with pytest.raises(SpecError, match=r"split.time_column: 'f' is not a timestamp column; timestamp columns: signup_ts, event_ts"):
        load_spec(write(tmp_path, TWO_STAMPS), ["split.time_column=f"])
    with pytest.raises(SpecError, match=r"split.time_column: only a temporal split cuts on a time column; kind: random ignores it"):
        load_spec(write(tmp_path, TWO_STAMPS), ["split.time_column=event_ts", "split.kind=random"])


def test_a_batch_size_that_is_not_a_multiple_of_accumulation_is_refused(tmp_path):
    """Each optimizer step held batch_size // k * k rows: batch_size 10 with accumulation 6 stepped
    on 6 rows, silently."""
    with pytest.raises(SpecError, match=r"train.batch_size: must be a multiple of train.accumulation=6 .*6 or 12 would do\) \(got 10\)"):
        load_spec(write(tmp_path, GOOD), ["train.batch_size=10", "train.accumulation=6"])
    assert load_spec(write(tmp_path, GOOD), ["train.batch_size=12", "train.accumulation=6"]).train.batch_size == 12


def test_transform_outputs_named_like_a_column_are_refused(tmp_path):
    """A numeric column `color__oh0` beside one-hot `color`, or `user__te` beside user's target
    statistics: one output replaced the other in the prepared rows without a word."""
    path = write(tmp_path, """
        name: demo
        data:
          source: {kind: parquet, path: /nowhere}
          columns:
            - {name: color, role: categorical}
            - {name: color__oh0, role: numeric}
            - {name: color__oh, role: numeric}
            - {name: user, role: categorical}
            - {name: user__logcount, role: numeric}
            - {name: __label_raw, role: numeric}
          label: {column: y}
        features:
          categorical: {color: {encode: onehot}, user: {target_stats: true}}
    """)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    text = str(info.value)
    assert "features.categorical.color: its output column 'color__oh0'" in text
    assert "'color__oh'" not in text  # not an output name: one-hot slots are numbered
    assert "features.categorical.user: its output column 'user__logcount'" in text
    assert "'__label_raw' is reserved" in text


def test_a_data_column_named_label_is_refused_unless_it_is_the_label(tmp_path):
    """The prepared rows keep the label in a column named label: a feature of that name was
    replaced by the label, and the model trained on its own target."""
    text = """
        name: demo
        data:
          source: {kind: parquet, path: /nowhere}
          columns:
            - {name: label, role: numeric}
            - {name: c, role: categorical}
          label: {column: y}
    """
    with pytest.raises(SpecError, match=r"data.columns: column name 'label' is where the prepared rows keep the label"):
        load_spec(write(tmp_path, text))
    ok = text.replace("- {name: label, role: numeric}", "- {name: x, role: numeric}").replace("column: y", "column: label")
    assert load_spec(write(tmp_path, ok)).data.resolved_label().column == "label"
    # id columns never reach the prepared rows, so the label there cannot replace them
    as_id = text.replace("- {name: label, role: numeric}", "- {name: label, role: id}")
    assert load_spec(write(tmp_path, as_id)).data.resolved_label().column == "y"
