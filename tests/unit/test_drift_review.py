"""Drift review fixes (2026-11-27): a features.json without the training histogram (older files)
splits the reference by where its deciles sit, tied ones together (an even share per distinct
edge flagged a column of 70% zeros on traffic drawn from the training data itself, every time);
a feature with fewer rows than min_rows reads "too few rows", not "ok"."""

import numpy as np

from rayload.features import NumericState
from rayload.serve import drift


def _column(rng, n):
    values = np.where(rng.random(n) < 0.7, 0.0, np.round(rng.lognormal(3, 1.5, n)))
    return values


def test_an_older_features_json_with_tied_deciles_does_not_flag_the_training_distribution():
    rng = np.random.default_rng(0)
    train = _column(rng, 20_000)
    quantiles = [float(v) for v in np.quantile(train, np.linspace(0, 1, 11))]
    assert quantiles[:8] == [0.0] * 8  # eight tied deciles
    state = NumericState("price", 0.0, None, None, False, "none", stats={"null_rate": 0.0, "quantiles": quantiles})
    bins = drift._numeric_bins(state)
    assert abs(sum(bins.expected) - 1.0) < 1e-9
    for seed in range(10):  # fresh draws from the same distribution
        values = _column(np.random.default_rng(100 + seed), 2_000)
        counts = np.bincount(np.searchsorted(np.asarray(bins.edges), values, side="right") + 1, minlength=len(bins.expected))
        assert drift.psi(bins.expected, counts) < 0.2, seed
    continuous = NumericState("x", 0.0, None, None, False, "none",
                              stats={"null_rate": 0.0, "quantiles": [float(v) for v in np.linspace(0, 10, 11)]})
    assert np.allclose(drift._numeric_bins(continuous).expected[1:], 0.1)  # distinct deciles: an even split, as before


def test_a_feature_below_min_rows_is_not_judged_and_says_so():
    bins = [drift.Bins("price", "numeric", ("missing", "< 1", ">= 1"), (0.0, 0.5, 0.5), edges=(1.0,))]
    rows = drift.report(bins, {"counts": {"price": [0, 0, 100]}, "rows": 100}, threshold=0.2, min_rows=500)
    assert rows[0]["psi"] > 0.2 and rows[0]["flagged"] is False and rows[0]["judged"] is False
    rows = drift.report(bins, {"counts": {"price": [0, 0, 600]}, "rows": 600}, threshold=0.2, min_rows=500)
    assert rows[0]["flagged"] is True and rows[0]["judged"] is True


def test_a_value_tied_inside_the_range_does_not_flag_the_training_distribution():
    """Signed values, 60% zeros: the share below 0 lies anywhere within a decile, and giving it
    the first decile's flagged the training data itself (PSI 0.5-0.7)."""
    def column(rng, n):
        return np.where(rng.random(n) < 0.6, 0.0, rng.normal(0, 3, n))

    train = column(np.random.default_rng(0), 20_000)
    quantiles = [float(v) for v in np.quantile(train, np.linspace(0, 1, 11), method="inverted_cdf")]
    state = NumericState("x", 0.0, None, None, False, "none", stats={"null_rate": 0.0, "quantiles": quantiles})
    bins = drift._numeric_bins(state)
    for seed in range(10):
        values = column(np.random.default_rng(100 + seed), 2_000)
        counts = np.bincount(np.searchsorted(np.asarray(bins.edges), values, side="right") + 1, minlength=len(bins.expected))
        assert drift.psi(bins.expected, counts) < 0.2, seed


def test_the_html_report_says_too_few_rows_for_a_feature_not_judged():
    from rayload.serve.report import drift_table

    page = drift_table([{"arm": "a", "feature": "price", "rows": 100, "psi": 4.6, "flagged": False, "judged": False}])
    assert "too few rows" in page and ">ok<" not in page


def test_a_non_ascii_feature_name_is_exported_to_prometheus_and_shown_by_ab_status(tmp_path, monkeypatch):
    """Ray's metrics refuse non-ASCII tag values (UnicodeEncodeError): a column named 'âge'
    stopped every flush's export (and the features after it). ab status printed feature names as
    Rich markup: 'price[usd]' lost its unit, 'weird[/]' crashed the command."""
    import helpers
    from helpers import fit_features, frame
    from types import SimpleNamespace

    from rayload._cli_ab import console, print_analysis
    from rayload.serve.events import create_schema, engine_for
    from rayload.serve.monitor import DriftFlusher, metric_tag

    assert metric_tag("âge") == "\\xe2ge" and metric_tag("price") == "price" and metric_tag("âge") != metric_tag("age")
    monkeypatch.setattr(helpers, "COLUMNS", [dict(c, name="âge") if c["name"] == "age" else c for c in helpers.COLUMNS])
    df = frame(1000, seed=1).rename(columns={"age": "âge"})
    features, _ = fit_features(df, {})
    db = f"sqlite:///{tmp_path}/events.db"
    create_schema(engine_for(db))
    counter = drift.DriftCounter(features)
    flusher = DriftFlusher(db, "exp", {"A": SimpleNamespace(drift=counter, version="v1")},
                           {"flush_s": 3600, "threshold": 0.2, "min_rows": 10, "window_s": None})
    try:
        rows = frame(50, seed=2).rename(columns={"age": "âge"})[["user", "item", "price", "âge"]]
        counter.observe([{k: (None if v != v else v) for k, v in r.items()} for r in rows.to_dict("records")])
        flusher.flush()  # raised UnicodeEncodeError from Ray's Gauge.set
        assert ("A", "âge") in flusher._exported and ("A", "price") in flusher._exported
    finally:
        flusher._stop.set()
    drift_rows = [{"arm": "A", "feature": name, "rows": 900, "psi": 0.31, "flagged": True, "judged": True}
                  for name in ("price[usd]", "weird[/]", "âge")]
    result = SimpleNamespace(experiment="e", live_champion=None, champion="A", arms=[], weights={}, diff=None, srm_p=0.5, ci_label="95% CI",
                             srm_flagged=False, sequential_mde_now=None, shadow_scores=None, decision="continue", reasons=[],
                             drift=drift_rows)
    with console.capture() as shown:
        print_analysis(result)  # 'weird[/]' raised MarkupError
    lines = [line for line in shown.get().splitlines() if "0.3100" in line]
    assert ["price[usd]" in lines[0], "weird[/]" in lines[1], "âge" in lines[2]] == [True] * 3, lines


def test_drift_counts_only_requests_the_model_answered(tmp_path):
    """Rows were counted before the model ran: requests answered 500 (the model raised, or
    scored NaN) still moved the drift statistics."""
    import os

    from helpers import fit_features, frame, tiny_checkpoint
    from rayload.serve.batch_scoring import ModelError, score_grouped
    from rayload.serve.scorer import Scorer

    features, _ = fit_features(frame(1500, seed=1), {})
    scorer = Scorer.load("a", tiny_checkpoint(os.path.join(tmp_path, "run", "epoch_0001"), features, 0), drift=True, torchscript=False)
    rows = [{k: (None if r[k] != r[k] else r[k]) for k in ("user", "item", "tags", "price", "age")} for r in frame(6, seed=3).to_dict("records")]
    items = [("a", [r]) for r in rows[:4]] + [("a", rows[4:])]  # four one-row requests and one of two rows
    forward = scorer.forward

    def crash(*inputs):
        raise RuntimeError("model crashed")

    scorer.forward = crash
    assert all(isinstance(o, ModelError) for o in score_grouped({"a": scorer}, items))
    assert scorer.drift.rows == 0

    def nan_in_rows(*inputs):  # the second request's row and one row of the two-row request score NaN
        out = forward(*inputs).clone()
        out[[1, 4]] = float("nan")
        return out

    scorer.forward = nan_in_rows
    out = score_grouped({"a": scorer}, items)
    assert [isinstance(o, ModelError) for o in out] == [False, True, False, False, True]
    assert scorer.drift.rows == 3  # the three answered requests
    scorer.forward = forward
    score_grouped({"a": scorer}, items)
    assert scorer.drift.rows == 8
