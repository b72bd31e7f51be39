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
