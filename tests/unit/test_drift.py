"""Drift statistics of served traffic against features.json: PSI per numeric feature, OOV rate
and PSI per categorical, merged over replicas, flagged past the threshold."""

import pytest

from rayload.data.pipeline import preprocess
from rayload.data.synthetic import SynthParams, generate_table
from rayload.serve import drift
from rayload.spec import JobSpec

SOURCE = {"kind": "synthetic-ctr", "rows": 20000, "numeric": 3, "categorical": 2, "cardinalities": [50, 400], "seed": 3}
PARAMS = SynthParams(rows=10_000_000,  # traffic rows come after the 20,000 training ones
                     numeric=3, categorical=2, cardinalities=(50, 400), seed=3)


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    folder = tmp_path_factory.mktemp("drift")
    spec = JobSpec.model_validate({"name": "drift", "data": {"source": SOURCE}})
    import os

    os.environ.setdefault("RAYLOAD_HOME", str(folder / "runs"))
    return preprocess(spec, out=str(folder / "pre"), engine="local").features


def traffic(start: int, n: int) -> list[dict]:
    """Rows the generator never gave the training split: same distribution, fresh draws."""
    return generate_table(PARAMS, start, start + n).drop(["label"]).to_pylist()


def flagged(features, rows: list[dict]) -> dict:
    counter = drift.DriftCounter(features)
    counter.observe(rows)
    return {r["feature"]: r for r in drift.report(list(counter.bins.values()), counter.snapshot())}


def test_traffic_from_the_training_distribution_is_not_flagged(features):
    draws, alarms, worst = 40, 0, 0.0
    for i in range(draws):
        out = flagged(features, traffic(1_000_000 + i * 1000, 1000))
        alarms += any(r["flagged"] for r in out.values())
        worst = max(worst, max(r["psi"] for r in out.values()))
    assert set(out) == {"I1", "I2", "I3", "C1", "C2"}
    assert alarms / draws <= 0.025, (alarms, worst)  # the false-alarm rate over repeated draws
    assert worst < 0.1, worst


def test_a_shifted_numeric_feature_is_flagged_and_the_others_are_not(features):
    rows = traffic(2_000_000, 2000)
    for r in rows:
        if r["I2"] is not None:
            r["I2"] = r["I2"] * 3 + 5
    out = flagged(features, rows)
    assert out["I2"]["flagged"] and out["I2"]["psi"] > 0.2
    assert not any(r["flagged"] for name, r in out.items() if name != "I2"), out


def test_the_threshold_given_decides_the_flag_on_either_side_of_the_psi(features):
    rows = traffic(2_000_000, 2000)
    for r in rows:
        if r["I2"] is not None:
            r["I2"] = r["I2"] * 3 + 5
    counter = drift.DriftCounter(features)
    counter.observe(rows)
    bins, snap = list(counter.bins.values()), counter.snapshot()
    psi = {r["feature"]: r["psi"] for r in drift.report(bins, snap)}["I2"]

    def i2(**kw) -> dict:
        return {r["feature"]: r for r in drift.report(bins, snap, **kw)}["I2"]

    assert not i2(threshold=psi + 0.01)["flagged"] and i2(threshold=psi - 0.01)["flagged"]
    assert not i2(threshold=psi)["flagged"]  # flagged past the threshold, not at it
    assert not i2(threshold=psi - 0.01, min_rows=2001)["flagged"]  # 2000 rows: fewer than asked


def test_unseen_categories_show_as_out_of_vocabulary_and_are_flagged(features):
    rows = traffic(3_000_000, 2000)
    for i, r in enumerate(rows[:1000]):
        r["C2"] = f"new-{i}"
    out = flagged(features, rows)
    assert out["C2"]["flagged"]
    assert out["C2"]["oov_rate"] > 0.45 and out["C2"]["training_oov_rate"] < 0.1
    assert not out["C1"]["flagged"]


def test_too_few_rows_are_never_flagged(features):
    rows = traffic(4_000_000, 100)
    for r in rows:
        r["I1"] = 1e9
    out = flagged(features, rows)
    assert out["I1"]["psi"] > 0.2 and not out["I1"]["flagged"]  # min_rows=500 not reached


def test_replica_snapshots_merge_to_the_whole_and_memory_stays_bounded(features):
    rows = traffic(5_000_000, 3000)
    whole, a, b = (drift.DriftCounter(features) for _ in range(3))
    whole.observe(rows)
    for i in range(0, 3000, 100):
        (a if i % 200 else b).observe(rows[i:i + 100])
    assert drift.merge([a.snapshot(), b.snapshot()]) == whole.snapshot()
    sizes = {k: len(v) for k, v in whole.counts.items()}
    whole.observe(traffic(6_000_000, 5000))
    assert {k: len(v) for k, v in whole.counts.items()} == sizes


def test_psi_of_identical_distributions_is_zero_and_grows_with_the_shift():
    expected = [0.25, 0.25, 0.25, 0.25]
    assert drift.psi(expected, [250, 250, 250, 250]) == pytest.approx(0.0, abs=1e-12)
    small, large = drift.psi(expected, [300, 250, 250, 200]), drift.psi(expected, [700, 100, 100, 100])
    assert 0 < small < 0.05 < 0.2 < large


def test_two_threads_observing_as_a_period_ends_close_it_once():
    """A shadow's thread and the serving loop may score the same model while shadow mode ends:
    two observes that both saw the period end each closed it (its counts written twice)."""
    import threading

    from rayload.serve.drift import DriftCounter
    from _loop import features

    both_starting = threading.Barrier(2, timeout=0.5)

    class Counter(DriftCounter):
        def _start(self, period):  # holds an observe between seeing the period end and starting the next
            if period == 1:
                try:
                    both_starting.wait()
                except threading.BrokenBarrierError:  # the other one never got this far: one at a time
                    pass
            super()._start(period)

    now = [0.0]
    counter = Counter(features(), period_s=10, clock=lambda: now[0])
    rows = [{"x": float(i % 7), "c": str(i % 30), "b": "p|q"} for i in range(5)]
    counter.observe(rows)
    now[0] = 15.0
    threads = [threading.Thread(target=counter.observe, args=(rows,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [(period, snap["rows"]) for period, snap in counter.closed] == [(0, 5)]
    assert counter.period == 1 and counter.snapshot()["rows"] == 10
