"""Unit tests for the synthetic Criteo-like generator (no Ray; tiny sizes, a few seconds)."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from rayload.data import synthetic as synth
from rayload.data.synthetic import (
    SynthParams,
    feature_names,
    generate_table,
    generate_table_with_truth,
    weighted_auc,
    write_synthetic,
)

SMALL = SynthParams(rows=2_500, numeric=4, categorical=5, shard_rows=1_000, seed=7)
MEDIUM = SynthParams(rows=20_000, seed=3)  # default columns and cardinalities


def _read_shards(files: list[str]) -> pa.Table:
    return pa.concat_tables(pq.read_table(f) for f in files)


def test_feature_names_follow_criteo_convention() -> None:
    assert feature_names(SynthParams(numeric=2, categorical=3)) == (["I1", "I2"], ["C1", "C2", "C3"])


def test_schema_types_and_hex_ids() -> None:
    table = generate_table(SMALL, 0, 500)
    assert table.column_names == ["label", "I1", "I2", "I3", "I4", "C1", "C2", "C3", "C4", "C5"]
    assert "p_true" not in table.column_names
    assert table.schema.field("label").type == pa.int8()
    assert all(table.schema.field(f"I{i}").type == pa.int64() for i in range(1, 5))
    assert all(table.schema.field(f"C{j}").type == pa.string() for j in range(1, 6))
    assert set(table.column("label").to_pylist()) == {0, 1}
    ids = [v for v in table.column("C5").to_pylist() if v is not None]
    assert ids and all(re.fullmatch(r"[0-9a-f]{8}", v) for v in ids)
    numeric = pc.drop_null(table.column("I1")).to_numpy()
    assert numeric.min() >= 0


def test_same_params_give_identical_tables_and_other_seed_differs() -> None:
    assert generate_table(SMALL, 0, SMALL.rows).equals(generate_table(SMALL, 0, SMALL.rows))
    other = generate_table(SynthParams(**{**SMALL.__dict__, "seed": 8}), 0, SMALL.rows)
    assert not other.equals(generate_table(SMALL, 0, SMALL.rows))


def test_rows_do_not_depend_on_shard_layout(tmp_path) -> None:
    tables = []
    for shard_rows in (700, 1_000, 5_000):
        params = SynthParams(**{**SMALL.__dict__, "shard_rows": shard_rows})
        result = write_synthetic(str(tmp_path / f"s{shard_rows}"), params)
        assert len(result.files) == -(-SMALL.rows // shard_rows)
        tables.append(_read_shards(result.files))
    assert tables[0].equals(tables[1]) and tables[1].equals(tables[2])
    assert tables[0].equals(generate_table(SMALL, 0, SMALL.rows))
    # the total row count does not change earlier rows either
    longer = SynthParams(**{**SMALL.__dict__, "rows": 4_000})
    assert generate_table(longer, 0, SMALL.rows).equals(tables[0])


def test_slices_agree_across_chunk_boundaries(monkeypatch) -> None:
    monkeypatch.setattr(synth, "CHUNK_ROWS", 256)  # many small chunks inside a tiny data set
    full = generate_table(SMALL, 0, SMALL.rows)
    for start, stop in [(0, 1), (100, 900), (255, 257), (256, 512), (1_999, 2_500)]:
        assert generate_table(SMALL, start, stop).equals(full.slice(start, stop - start)), (start, stop)
    empty = generate_table(SMALL, 300, 300)
    assert empty.num_rows == 0 and empty.schema.equals(full.schema)


def test_generate_table_rejects_bad_ranges() -> None:
    for start, stop in [(-1, 10), (10, 5), (0, SMALL.rows + 1)]:
        with pytest.raises(ValueError, match="start"):
            generate_table(SMALL, start, stop)


def test_null_rate_close_to_missing_rate() -> None:
    params = SynthParams(rows=20_000, numeric=3, categorical=3, missing_rate=0.1, seed=1)
    table = generate_table(params, 0, params.rows)
    assert table.column("label").null_count == 0
    for name in table.column_names[1:]:  # sd of the rate is 0.002; allow 5 sd
        assert abs(table.column(name).null_count / params.rows - 0.1) < 0.011, name
    no_nulls = generate_table(SynthParams(rows=1_000, numeric=2, categorical=2, missing_rate=0.0), 0, 1_000)
    assert all(col.null_count == 0 for col in no_nulls.columns)


def test_positive_rate_is_criteo_like() -> None:
    labels = generate_table(MEDIUM, 0, MEDIUM.rows).column("label").to_numpy()
    assert 0.2 <= labels.mean() <= 0.3


def test_zipf_skew_and_cardinality_bound() -> None:
    params = SynthParams(rows=20_000, numeric=1, categorical=2, cardinalities=(5, 100_000), seed=2)
    table = generate_table(params, 0, params.rows)
    assert len(pc.unique(pc.drop_null(table.column("C1")))) <= 5
    counts = pc.value_counts(pc.drop_null(table.column("C2"))).field("counts").to_numpy()
    assert counts.max() >= 50 * np.median(counts)  # head IDs dominate a long tail of rare IDs
    assert len(counts) > 1_000


def test_a_cardinality_past_the_exact_table_draws_the_same_ranks_in_bounded_memory() -> None:
    """Validation allows cardinalities below 2**32, but the exact CDF held 8 bytes per rank: 16
    GiB at 2**31. Past _TABLE_MAX the tail is drawn in closed form; just past it, every draw
    equals the exact CDF's, and a 2**31 column generates within a few MB."""
    import tracemalloc

    card = synth._TABLE_MAX + 200_000
    u = np.random.default_rng(4).random(100_000)
    exact = np.minimum(np.searchsorted(synth._zipf_cdf(card, 1.05), u, side="right") + 1, card)
    drawn = synth._zipf_ranks(card, 1.05, u)
    assert (exact > synth._TABLE_MAX).sum() > 300 and np.array_equal(drawn, exact)
    synth._zipf_head(1.1)  # the head's table (16 MB) is cached like the exact CDF of a smaller column
    tracemalloc.start()
    table = generate_table(SynthParams(rows=2_000, numeric=1, categorical=1, cardinalities=(2**31,), seed=5), 0, 2_000)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 * 2**20, peak
    assert table.num_rows == 2_000 and len(pc.unique(pc.drop_null(table.column("C1")))) > 100


def test_numeric_columns_are_heavy_tailed() -> None:
    table = generate_table(MEDIUM, 0, MEDIUM.rows)
    ratios = []
    for name in feature_names(MEDIUM)[0]:
        values = pc.drop_null(table.column(name)).to_numpy()
        ratios.append(values.max() / max(np.median(values), 1))
    assert max(ratios) > 100


def test_write_synthetic_outputs_and_bayes_auc(tmp_path) -> None:
    out = tmp_path / "data"
    result = write_synthetic(str(out), MEDIUM)
    assert [f.rsplit("/", 1)[-1] for f in result.files] == ["part-00000.parquet"]
    meta = json.loads((out / "synthetic.json").read_text())
    assert meta["rows"] == result.rows == MEDIUM.rows
    assert meta["params"]["seed"] == MEDIUM.seed and meta["bayes_auc"] == result.bayes_auc
    assert 0.75 <= result.bayes_auc <= 0.85
    table, p_true = generate_table_with_truth(MEDIUM, 0, MEDIUM.rows)
    labels = table.column("label").to_numpy().astype(np.float64)
    assert result.positive_rate == pytest.approx(labels.mean())
    assert result.bayes_auc == pytest.approx(weighted_auc(p_true, p_true, 1 - p_true))
    # realised AUC of the truth on drawn labels is close to the noise-free value
    assert abs(weighted_auc(p_true, labels, 1 - labels) - result.bayes_auc) < 0.02
    # a model-free single-feature score is clearly below the Bayes limit
    proxy = pc.fill_null(table.column("I1"), -1).to_numpy()
    assert weighted_auc(np.log1p(proxy + 1.0), labels, 1 - labels) < result.bayes_auc - 0.05


def test_write_synthetic_accepts_file_uri(tmp_path) -> None:
    result = write_synthetic(f"file://{tmp_path}/uri", SMALL)
    assert all(f.startswith("file://") for f in result.files)
    assert (tmp_path / "uri" / "part-00002.parquet").exists()
    assert (tmp_path / "uri" / "synthetic.json").exists()
    assert _read_shards([str(tmp_path / "uri" / f"part-0000{k}.parquet") for k in range(3)]).num_rows == 2_500


def _brute_auc(s: np.ndarray, wp: np.ndarray, wn: np.ndarray) -> float:
    total = 0.0
    for i in range(len(s)):
        for j in range(len(s)):
            total += wp[i] * wn[j] * (1.0 if s[i] > s[j] else 0.5 if s[i] == s[j] else 0.0)
    return total / (wp.sum() * wn.sum())


@pytest.mark.parametrize("seed", range(5))
def test_weighted_auc_matches_brute_force_with_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 60
    scores = rng.integers(0, 6, n).astype(float)  # many ties
    wp, wn = rng.random(n), rng.random(n)
    wp[rng.random(n) < 0.3] = 0.0
    assert weighted_auc(scores, wp, wn) == pytest.approx(_brute_auc(scores, wp, wn), abs=1e-12)
    labels = (rng.random(n) < 0.4).astype(float)  # plain 0/1 labels too
    assert weighted_auc(scores, labels, 1 - labels) == pytest.approx(_brute_auc(scores, labels, 1 - labels))


def test_weighted_auc_edge_cases() -> None:
    y = np.array([0.0, 0.0, 1.0, 1.0])
    assert weighted_auc(np.array([1, 2, 3, 4]), y, 1 - y) == 1.0
    assert weighted_auc(np.array([4, 3, 2, 1]), y, 1 - y) == 0.0
    assert weighted_auc(np.ones(4), y, 1 - y) == 0.5
    with pytest.raises(ValueError, match="positive and negative"):
        weighted_auc(np.arange(3), np.zeros(3), np.ones(3))
    with pytest.raises(ValueError, match="lengths"):
        weighted_auc(np.arange(3), np.ones(2), np.ones(3))


def test_rows_error_message_is_exact() -> None:
    with pytest.raises(ValueError, match=r"^rows must be > 0, got rows=0$"):
        SynthParams(rows=0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rows": -5}, "rows"),
        ({"numeric": -1}, "numeric"),
        ({"categorical": -1}, "categorical"),
        ({"numeric": 0, "categorical": 0}, "numeric"),
        ({"zipf": 1.0}, "zipf"),
        ({"missing_rate": 1.0}, "missing_rate"),
        ({"missing_rate": -0.1}, "missing_rate"),
        ({"shard_rows": 0}, "shard_rows"),
        ({"seed": -1}, "seed"),
        ({"categorical": 2, "cardinalities": (10,)}, "cardinalities"),
        ({"categorical": 2, "cardinalities": (10, 0)}, "cardinalities"),
    ],
)
def test_param_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SynthParams(**kwargs)


@pytest.mark.parametrize("seed, drift_seed", [(0, 1), (7, 11), (1, 0)])
def test_a_drifted_world_keeps_the_items_positive_rate_and_spread_and_changes_the_effects(seed, drift_seed):
    """The drifted truth was calibrated on the drift seed's own numeric distributions and then
    scored the base's items: its positive rate landed at 0.47, 0.16, 0.17 for these seeds."""
    params = SynthParams(rows=30_000, seed=seed)
    table, p = generate_table_with_truth(params, 0, 30_000)
    drifted, q = generate_table_with_truth(params, 0, 30_000, drift_seed=drift_seed)
    assert table.drop(["label"]).equals(drifted.drop(["label"]))  # the same items
    assert abs(q.mean() - p.mean()) < 0.01 and abs(q.mean() - 0.25) < 0.01
    logit = lambda x: np.log(x / (1 - x))  # noqa: E731
    assert abs(np.std(logit(q)) - np.std(logit(p))) < 0.15
    assert np.corrcoef(p, q)[0, 1] < 0.5  # the effects are drawn afresh


def test_writing_into_a_folder_of_an_earlier_run_replaces_its_shards(tmp_path):
    """A 1-shard run after a 3-shard one left part-00001/00002 of the earlier seed: a reader of the
    folder took 3,000 rows of two click models that synthetic.json did not describe."""
    import dataclasses

    first = synth.write_synthetic(str(tmp_path), dataclasses.replace(synth.SynthParams(), rows=3000, shard_rows=1000, seed=1))
    second = synth.write_synthetic(str(tmp_path), dataclasses.replace(synth.SynthParams(), rows=1000, shard_rows=1000, seed=2))
    assert len(first.files) == 3 and len(second.files) == 1
    assert sorted(p.name for p in tmp_path.glob("*.parquet")) == ["part-00000.parquet"]
    assert sum(pq.read_metadata(str(p)).num_rows for p in tmp_path.glob("*.parquet")) == 1000


def test_a_rerun_stopped_part_way_leaves_no_old_truth_and_lists_and_constant_parts_are_named(tmp_path, monkeypatch):
    """A rerun into the same folder stopped after its first shard left the old run's
    synthetic.json (another seed, file list and Bayes AUC) beside the new shards; a list of
    cardinalities failed as an unhashable cache key; all-constant features (cardinality 1, no
    missing values) gave every label the same value, then an unrelated AUC error."""
    import pyarrow.parquet as pq_

    from rayload.data import synthetic, synthetic_files
    from rayload.errors import DataError

    out = str(tmp_path / "s")
    synthetic.write_synthetic(out, synthetic.SynthParams(rows=12, numeric=2, categorical=1, shard_rows=3, seed=1))
    real, calls = pq_.write_table, []

    def stop_at_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(synthetic_files.pq, "write_table", stop_at_second)
    with pytest.raises(KeyboardInterrupt):
        synthetic.write_synthetic(out, synthetic.SynthParams(rows=12, numeric=2, categorical=1, shard_rows=3, seed=2))
    monkeypatch.setattr(synthetic_files.pq, "write_table", real)
    assert sorted(os.listdir(out)) == ["part-00000.parquet"]  # no synthetic.json: not a complete generation
    params = synthetic.SynthParams(rows=50, numeric=1, categorical=2, cardinalities=[10, 20])
    assert params.cardinalities == (10, 20) and synthetic.generate_table(params, 0, 50).num_rows == 50
    with pytest.raises(DataError, match="the synthetic features carry no signal"):
        synthetic.write_synthetic(str(tmp_path / "c"), synthetic.SynthParams(rows=100, numeric=0, categorical=2,
                                                                            cardinalities=(1, 1), missing_rate=0.0))


def test_a_failing_synth_leaves_the_folder_it_would_have_replaced_and_bad_counts_and_uris_are_named(tmp_path):
    """A model without signal (or rows=1e4's TypeError deep in numpy) failed after the earlier data
    set's shards and synthetic.json were deleted; a count of 2.5 passed construction; an unknown URI
    scheme was a traceback; shards numbered past 99,999 survived a rerun."""
    from rayload.errors import DataError, RayloadError

    out = tmp_path / "o"
    write_synthetic(str(out), SynthParams(rows=1000, numeric=2, categorical=2, shard_rows=500, seed=1))
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(DataError, match="carry no signal"):
        write_synthetic(str(out), SynthParams(rows=100, numeric=0, categorical=1, cardinalities=(1,), missing_rate=0.0))
    assert sorted(p.name for p in out.iterdir()) == before == ["part-00000.parquet", "part-00001.parquet", "synthetic.json"]
    for field, value in (("rows", 2.5), ("numeric", "2"), ("shard_rows", True), ("seed", 1.5), ("rows", float("inf")),
                         ("rows", float("nan"))):
        with pytest.raises(ValueError, match=rf"^{field} must be a whole number, got {field}="):
            SynthParams(**{field: value})
    for card in (2.5, "7", float("nan")):
        with pytest.raises(ValueError, match=r"^cardinalities must be a whole number"):
            SynthParams(numeric=1, categorical=1, cardinalities=(card,))
    assert SynthParams(rows=1e4).rows == 10_000 and isinstance(SynthParams(rows=1e4).rows, int)
    with pytest.raises(RayloadError, match=r"cannot write the synthetic data to bogus://x/y"):
        write_synthetic("bogus://x/y", SynthParams(rows=10, numeric=2, categorical=1))
    (out / "part-100000.parquet").write_bytes((out / "part-00000.parquet").read_bytes())
    write_synthetic(str(out), SynthParams(rows=100, numeric=2, categorical=2, seed=2))
    assert sorted(p.name for p in out.iterdir()) == ["part-00000.parquet", "synthetic.json"]
