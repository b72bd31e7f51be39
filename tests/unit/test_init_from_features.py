"""A job that starts from a checkpoint's fitted features (`train.init_from`, which every retrain
is): its training rows are encoded with all of the checkpoint's target statistics, never out of
fold by a split key its rows need not carry; its declared columns must be the checkpoint's; and
the compression gate of such a model reads the model's own features.json, not its ancestor's."""

import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import job
from rayload import target_stats
from rayload.data import pipeline
from rayload.errors import DataError
from rayload.features import FittedFeatures
from rayload.retraining import job_for
from rayload.spec import JobSpec

N = 1500


def _rows(n: int, seed: int, ids: str | None = "rid") -> pa.Table:
    rng = np.random.default_rng(seed)
    c = rng.integers(0, 12, n)
    columns = {"x": rng.normal(size=n), "c": c.astype(str), "ts": 1_700_000_000 + rng.integers(0, 86_400, n),
               "y": (rng.random(n) < np.where(c % 3 == 0, 0.6, 0.2)).astype(float)}
    if ids:
        columns[ids] = [f"{ids}{i}" for i in range(n)]
    return pa.table(columns)


def _champion_spec(path: str) -> JobSpec:
    """Target statistics on `c`, out of fold by the default split key (every declared column,
    the id `rid` included), and a derived feature from the timestamp `ts`."""
    return JobSpec.model_validate({
        "name": "champ", "data": {"source": {"kind": "parquet", "path": path}, "label": {"column": "y"},
                                  "columns": [{"name": "rid", "role": "id"}, {"name": "x", "role": "numeric"},
                                              {"name": "c", "role": "categorical"}, {"name": "ts", "role": "timestamp"}]},
        "features": {"categorical": {"c": {"target_stats": True}}, "derived": {"hour": {"source": "ts", "part": "hour"}}}})


@pytest.fixture()
def champion(tmp_path):
    """A checkpoint folder (features.json fitted by preprocess, a stub model.json)."""
    path = str(tmp_path / "champ.parquet")
    pq.write_table(_rows(N, 0), path)
    pre = pipeline.preprocess(_champion_spec(path), out=str(tmp_path / "champ-pre"), engine="local")
    assert "rid" in pre.features.target[0].key
    folder = tmp_path / "champ"
    folder.mkdir()
    pre.features.save(str(folder / "features.json"))
    (folder / "model.json").write_text(json.dumps({"config": {"name": "mlp", "hidden": [8]}}))
    (folder / "model.pt").write_bytes(b"")
    return str(folder), path


def _events(tmp_path, seed: int = 1) -> str:
    """Logged exposures as `training_rows` writes them: the request's features, the label and
    request_id; no `rid` (a request carries no id column)."""
    table = _rows(600, seed, ids="request_id")
    path = str(tmp_path / f"events-{seed}.parquet")
    pq.write_table(table, path)
    return path


def test_a_retrain_encodes_training_rows_with_all_of_the_champions_target_statistics(champion, tmp_path):
    """The retrain rows lack the champion's split-key column `rid`: preprocessing crashed with
    'Field "rid" does not exist in schema'. Now every training row gets the statistics a served
    request gets (the same value per category), since they never saw these rows' labels."""
    folder, _ = champion
    retrain_job = job_for(job(str(tmp_path / "unused.parquet")), folder, _events(tmp_path), "y", "retrain-x")
    pre = pipeline.preprocess(retrain_job, out=str(tmp_path / "pre"), engine="local")
    fixed = FittedFeatures.load(os.path.join(folder, "features.json"))
    assert pre.features == FittedFeatures(**{**fixed.__dict__, "label": pre.features.label})
    served = fixed.transform_table(pa.table({n: _rows(N, 0).column(n) for n in ("x", "c", "ts")}))
    by_id = dict(zip(served.column("c").to_pylist(), served.column("c__te").to_pylist()))
    train = pa.concat_tables(pq.read_table(f) for f in pre.files["train"])
    assert train.num_rows > 300
    assert all(by_id[i] == te for i, te in zip(train.column("c").to_pylist(), train.column("c__te").to_pylist()))


def test_training_rows_of_the_data_the_statistics_are_fitted_on_are_still_encoded_out_of_fold(champion, tmp_path):
    _, path = champion
    pre = pipeline.preprocess(_champion_spec(path), out=str(tmp_path / "again"), engine="local")
    train = pa.concat_tables(pq.read_table(f) for f in pre.files["train"])
    per_id: dict[int, set] = {}
    for i, te in zip(train.column("c").to_pylist(), train.column("c__te").to_pylist()):
        per_id.setdefault(i, set()).add(te)
    assert max(len(v) for v in per_id.values()) > 1  # a category's value depends on the row's fold


def test_out_of_fold_encoding_without_the_key_columns_is_a_data_error_naming_them(champion):
    folder, _ = champion
    state = FittedFeatures.load(os.path.join(folder, "features.json")).target[0]
    rows = pa.table({"c": ["1", "2"], "x": [0.0, 1.0]})
    with pytest.raises(DataError, match=r"its columns \['rid', 'x', 'c', 'ts', 'y'\].*lack \['rid', 'ts', 'y'\]"):
        target_stats.transform(state, rows, out_of_fold=True)
    assert len(target_stats.transform(state, rows, out_of_fold=False)["c__te"]) == 2


def _transfer(path: str, folder: str, columns: list[tuple[str, str]]) -> JobSpec:
    return JobSpec.model_validate({
        "name": "ft", "data": {"source": {"kind": "parquet", "path": path}, "label": {"column": "y"},
                               "columns": [{"name": c[0], "role": c[1], **({"unit": c[2]} if len(c) > 2 else {})}
                                           for c in columns]},
        "train": {"init_from": folder}})


@pytest.mark.parametrize("columns, message", [
    ([("x", "numeric"), ("ts", "timestamp")], r"\(missing: c\)"),
    ([("x", "numeric"), ("c", "categorical"), ("ts", "timestamp"), ("z", "numeric")], r"\(not in the checkpoint: z\)"),
    ([("x", "categorical"), ("c", "categorical"), ("ts", "timestamp")], r"x \(numeric in the checkpoint, categorical here\)"),
    ([("x", "numeric"), ("c", "categorical")], r"\(missing: ts\)"),  # the source of the derived feature `hour`
    # rows read as milliseconds, requests as the checkpoint's seconds: the hour of training and serving differed
    ([("x", "numeric"), ("c", "categorical"), ("ts", "timestamp", "ms")], r"ts \(unit s in the checkpoint, ms here\)"),
])
def test_init_from_a_checkpoint_fitted_on_other_columns_is_refused_naming_them(champion, tmp_path, columns, message):
    """A missing or retyped column failed with a bare pyarrow KeyError / ArrowTypeError, and an
    extra one was dropped without a word."""
    folder, path = champion
    with pytest.raises(DataError, match=message) as err:
        pipeline.preprocess(_transfer(path, folder, columns), out=str(tmp_path / "pre"), engine="local")
    assert not (tmp_path / "pre").exists()  # refused before anything is read or written
    assert "x: numeric, c: categorical, ts: timestamp" in str(err.value) and "drop train.init_from" in str(err.value)


def test_id_and_label_columns_may_differ_from_the_checkpoints(champion, tmp_path):
    folder, path = champion
    pq.write_table(_rows(300, 5, ids="other_id"), str(tmp_path / "other.parquet"))
    spec = _transfer(str(tmp_path / "other.parquet"), folder, [("x", "numeric"), ("c", "categorical"), ("ts", "timestamp"),
                                                               ("other_id", "id")])
    assert pipeline.preprocess(spec, out=str(tmp_path / "pre"), engine="local").counts["good"] == 300


def test_the_gate_of_a_model_fine_tuned_from_a_checkpoint_since_removed_reads_its_own_features(champion, tmp_path, monkeypatch):
    """compress preprocessed the model's manifest spec, whose train.init_from named its ancestor:
    with the ancestor gone (replaced by the model it was fine-tuned into), the gate failed."""
    from rayload import compression

    ancestor, _ = champion
    tuned = job_for(job(str(tmp_path / "unused.parquet")), ancestor, _events(tmp_path), "y", "retrain-x")
    pre = pipeline.preprocess(tuned, out=str(tmp_path / "tuned-pre"), engine="local")
    model = tmp_path / "tuned"
    model.mkdir()
    pre.features.save(str(model / "features.json"))
    shutil.rmtree(ancestor)
    real = pipeline.preprocess
    monkeypatch.setattr(pipeline, "preprocess", lambda spec, address=None: real(spec, out=str(tmp_path / "gate-pre"), engine="local"))
    source = SimpleNamespace(manifest={"spec": tuned.model_dump(mode="json")}, features=pre.features)
    spec, gate = compression._validation_data(str(model), source, None, None)
    assert gate.features == pre.features and gate.files.get("val")


def test_evaluate_of_a_model_fine_tuned_from_a_checkpoint_since_removed_reads_its_own_features(champion, tmp_path, monkeypatch):
    """rayload evaluate preprocessed the spec as given, whose train.init_from named the ancestor:
    with the ancestor gone it failed ("train.init_from=... is not a checkpoint"), though the
    fine-tuned checkpoint holds the same fitted features."""
    from helpers import tiny_checkpoint
    from rayload import evaluate

    ancestor, _ = champion
    data = str(tmp_path / "feedback.parquet")
    pq.write_table(_rows(600, 7).drop(["rid"]), data)
    tuned = _transfer(data, ancestor, [("x", "numeric"), ("c", "categorical"), ("ts", "timestamp")])
    pre = pipeline.preprocess(tuned, out=str(tmp_path / "tuned-pre"), engine="local")
    model = tiny_checkpoint(tmp_path / "tuned", pre.features, seed=3)
    shutil.rmtree(ancestor)
    real = pipeline.preprocess
    monkeypatch.setattr(pipeline, "preprocess", lambda spec, address=None: real(spec, out=str(tmp_path / "eval-pre"), engine="local"))
    metrics = evaluate.evaluate_split(tuned, model, "test")
    assert metrics.rows == pre.counts["split_rows"]["test"] > 0 and 0.0 <= metrics.auc <= 1.0


def _with_manifest(folder: str, path: str) -> None:
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump({"spec": _champion_spec(path).model_dump(mode="json")}, f)


def _transfer_with_features(path: str, folder: str, features: dict) -> JobSpec:
    spec = _transfer(path, folder, [("rid", "id"), ("x", "numeric"), ("c", "categorical"), ("ts", "timestamp")])
    return spec.model_copy(update={"features": JobSpec.model_validate({**spec.model_dump(), "features": features}).features})


def test_a_features_section_the_checkpoints_features_would_override_is_refused_naming_the_fields(champion, tmp_path):
    """The job's own features: section was ignored without a word under train.init_from (the
    checkpoint's fitted transforms apply): a user's new log transform was never applied."""
    folder, path = champion
    _with_manifest(folder, path)
    features = {**_champion_spec(path).model_dump(mode="json")["features"], "numeric": {"x": {"log": True}}}
    with pytest.raises(DataError, match=r"features\.numeric\.x\.log.*Remove the features: section") as err:
        pipeline.preprocess(_transfer_with_features(path, folder, features), out=str(tmp_path / "pre"), engine="local")
    assert "features.categorical" not in str(err.value)  # only what differs is named
    assert not (tmp_path / "pre").exists()


def test_a_features_section_equal_to_the_checkpoints_or_none_is_accepted(champion, tmp_path):
    folder, path = champion
    _with_manifest(folder, path)
    same = _transfer_with_features(path, folder, _champion_spec(path).model_dump(mode="json")["features"])
    assert pipeline.preprocess(same, out=str(tmp_path / "same"), engine="local").counts["good"] == N
    none = _transfer_with_features(path, folder, {})
    assert pipeline.preprocess(none, out=str(tmp_path / "none"), engine="local").counts["good"] == N


def test_a_features_section_applying_the_checkpoints_transforms_in_other_words_is_accepted(champion, tmp_path):
    """Fitting gives a feature column with no entry the default entry, so the checkpoint's section
    plus `x: {}`, or with x's defaults spelled out, applies the same transforms; both were refused.
    The hour feature derived from ts is a numeric column too."""
    folder, path = champion
    _with_manifest(folder, path)
    section = _champion_spec(path).model_dump(mode="json", exclude_defaults=True)["features"]
    for i, numeric in enumerate([{"x": {}}, {"x": {"impute": "median", "scale": "zscore"}, "hour": {}}]):
        spec = _transfer_with_features(path, folder, {**section, "numeric": numeric, "categorical": {"c": {"target_stats": True}, "rid": {}}})
        assert pipeline.preprocess(spec, out=str(tmp_path / f"same-{i}"), engine="local").counts["good"] == N
    other = _transfer_with_features(path, folder, {**section, "numeric": {"x": {"scale": "minmax"}}})
    with pytest.raises(DataError, match=r"features\.numeric\.x\.scale"):
        pipeline.preprocess(other, out=str(tmp_path / "other"), engine="local")


def test_a_fine_tune_of_a_fine_tune_compares_with_the_section_its_ancestor_applied(champion, tmp_path):
    """A child trained from the champion with features: left out records {} in its manifest,
    though its features.json is the champion's; a grandchild writing the champion's section,
    which is what transforms its data, was refused."""
    folder, path = champion
    _with_manifest(folder, path)
    child_spec = _transfer_with_features(path, folder, {})
    pre = pipeline.preprocess(child_spec, out=str(tmp_path / "child-pre"), engine="local")
    child = tmp_path / "child"
    child.mkdir()
    pre.features.save(str(child / "features.json"))
    (child / "manifest.json").write_text(json.dumps({"spec": child_spec.model_dump(mode="json")}))
    grandchild = _transfer_with_features(path, str(child), _champion_spec(path).model_dump(mode="json")["features"])
    assert pipeline.preprocess(grandchild, out=str(tmp_path / "g"), engine="local").counts["good"] == N
    changed = _transfer_with_features(path, str(child), {"numeric": {"x": {"log": True}}})
    with pytest.raises(DataError, match=r"features\.numeric\.x\.log"):
        pipeline.preprocess(changed, out=str(tmp_path / "g2"), engine="local")


def test_a_features_section_with_a_checkpoint_that_records_no_spec_is_refused(champion, tmp_path):
    folder, path = champion  # no manifest.json
    spec = _transfer_with_features(path, folder, {"numeric": {"x": {"log": True}}})
    with pytest.raises(DataError, match="manifest.json holds no job spec"):
        pipeline.preprocess(spec, out=str(tmp_path / "pre"), engine="local")


def test_a_retrain_records_the_features_section_its_champion_was_trained_with(champion, tmp_path):
    """SPEC's features: section does not transform retrain rows (the champion's features do):
    the retrain job carries the champion's section, so it and later retrains from it pass the check."""
    folder, path = champion
    spec = job(str(tmp_path / "unused.parquet"))
    spec = spec.model_copy(update={"features": JobSpec.model_validate(
        {**spec.model_dump(), "features": {"numeric": {"x": {"log": True}}}}).features})
    assert job_for(spec, folder, _events(tmp_path), "y", "r1").features == JobSpec.model_validate(
        {**spec.model_dump(), "features": {}}).features  # no manifest: none recorded
    _with_manifest(folder, path)
    retrain_job = job_for(spec, folder, _events(tmp_path), "y", "r2")
    assert retrain_job.features == _champion_spec(path).features
    assert pipeline.preprocess(retrain_job, out=str(tmp_path / "pre"), engine="local").counts["good"] == 600


def test_init_from_a_checkpoint_whose_bags_have_another_separator_is_refused_naming_both(tmp_path):
    """The job's separator read the bags and the checkpoint's split them: with "," declared
    against a checkpoint fitted with "|", every training bag became one unknown token (ID 1)
    while serving the model split the same rows into their real IDs."""
    rng = np.random.default_rng(0)
    tags = [list(rng.choice(["a", "b", "c", "d"], 2, replace=False)) for _ in range(400)]
    pq.write_table(pa.table({"tags": pa.array(tags, pa.list_(pa.string())), "x": rng.normal(size=400),
                             "y": (rng.random(400) < 0.3).astype(float)}), str(tmp_path / "a.parquet"))

    def spec(separator: str, init_from: str | None = None) -> JobSpec:
        return JobSpec.model_validate({
            "name": "t", "data": {"source": {"kind": "parquet", "path": str(tmp_path / "a.parquet")}, "label": {"column": "y"},
                                  "columns": [{"name": "tags", "role": "multi_categorical", "separator": separator},
                                              {"name": "x", "role": "numeric"}]},
            **({"train": {"init_from": init_from}} if init_from else {})})

    fitted = pipeline.preprocess(spec("|"), out=str(tmp_path / "fit"), engine="local")
    os.makedirs(tmp_path / "ck")
    shutil.copy(os.path.join(fitted.out_dir, "features.json"), tmp_path / "ck")
    with pytest.raises(DataError, match=r"tags \(separator '\|' in the checkpoint, ',' here\)"):
        pipeline.preprocess(spec(",", str(tmp_path / "ck")), out=str(tmp_path / "bad"), engine="local")
    same = pipeline.preprocess(spec("|", str(tmp_path / "ck")), out=str(tmp_path / "ok"), engine="local")
    bags = pq.read_table(os.path.join(same.out_dir, "train")).column("tags").to_pylist()
    assert all(len(bag) == 2 and 1 not in bag for bag in bags)  # the same separator: every tag known
