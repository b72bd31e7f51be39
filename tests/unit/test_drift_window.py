"""Drift over a recent window: replicas count by period and readers merge the periods of the
last `drift.window_s`, so a shift reads at its full size once it fills the window and clears
once it has left it (cumulative counts diluted it behind everything served before, and kept a
flag long after the shift ended); a replica's periods count as one replica; rows older than
two windows are deleted. Real counters, a real SQLite store, an injected clock (no Ray)."""

import types

import pytest
from helpers import fit_features, frame

from rayload.serve import drift, monitor
from rayload.serve.events import EventReader

WINDOW = 2400.0  # 24 periods of 100 s


def _rows(df) -> list[dict]:
    return [{"price": None if p != p else p, "age": None if a != a else a} for p, a in zip(df["price"], df["age"])]


@pytest.fixture()
def served(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'events.db'}"
    EventReader(url).close()  # creates the store
    monkeypatch.setattr(monitor.DriftFlusher, "_export", lambda self: None)  # the Prometheus gauges are not under test
    clock = [1_800_000_000.0]
    features, _ = fit_features(frame(4000, seed=1), {})
    scorer = types.SimpleNamespace(drift=drift.DriftCounter(features, clock=lambda: clock[0]), version="v1")
    cfg = {"flush_s": 3600, "window_s": WINDOW, "threshold": 0.2, "min_rows": 500}
    f = monitor.DriftFlusher(url, "exp", {"a": scorer}, cfg, clock=lambda: clock[0])
    yield f, scorer, clock, url
    f._stop.set()
    f._thread.join(timeout=5)
    f.engine.dispose()


def _serve(f, scorer, clock, periods: int, seed: int, shift: float = 1.0) -> None:
    for i in range(periods):
        df = frame(100, seed=seed + i)
        df["price"] = df["price"] * shift
        scorer.drift.observe(_rows(df))
        f.flush()
        clock[0] += 100.0


def _price(url, scorer, window_s) -> dict:
    reader = EventReader(url)
    try:
        snapshots = reader.drift("exp")
    finally:
        reader.close()
    report = monitor.merged_report(snapshots, {"a": list(scorer.drift.bins.values())}, 0.2, 500, {"a": "v1"}, window_s)
    return next(r for r in report if r["feature"] == "price")


def test_a_counter_closes_a_period_when_the_next_begins():
    clock = [1000.0]
    counter = drift.DriftCounter(fit_features(frame(500, seed=1), {})[0], period_s=100.0, clock=lambda: clock[0])
    counter.observe(_rows(frame(30, seed=2)))
    clock[0] += 99.0
    counter.observe(_rows(frame(20, seed=3)))
    assert (counter.period, counter.rows, counter.closed) == (10, 50, [])
    clock[0] += 1.0
    counter.observe(_rows(frame(5, seed=4)))
    (period, snap), = counter.closed
    assert (period, snap["rows"], counter.period, counter.rows) == (10, 50, 11, 5)
    assert sum(snap["counts"]["price"]) == 50 and counter.period_end(10) == 1100.0


def test_a_shift_reads_at_full_size_in_the_window_and_clears_after_it(served):
    f, scorer, clock, url = served
    _serve(f, scorer, clock, 48, seed=100)  # two windows of normal traffic
    assert not _price(url, scorer, WINDOW)["flagged"]
    _serve(f, scorer, clock, 24, seed=200, shift=20.0)  # one window of shifted prices
    windowed = _price(url, scorer, WINDOW)
    everything = _price(url, scorer, None)
    assert windowed["flagged"] and windowed["replicas"] == 1 and 2400 <= windowed["rows"] <= 2600  # the window, give or take its periods at the ends
    assert windowed["psi"] > 2 * everything["psi"]  # the window holds the shifted traffic alone
    _serve(f, scorer, clock, 25, seed=300)  # the shift has left the window
    after = _price(url, scorer, WINDOW)
    assert not after["flagged"] and after["psi"] < 0.1, after
    reader = EventReader(url)
    try:
        kept = [s["ts"] for s in reader.drift("exp")["a"]]
    finally:
        reader.close()
    assert min(kept) >= clock[0] - 2 * WINDOW - 100 and len(kept) <= 2 * 24 + 2  # older periods deleted
    clock[0] += 10 * WINDOW  # the experiment stopped long ago: its last window is still read
    assert _price(url, scorer, WINDOW)["rows"] == after["rows"]


def test_a_window_of_none_keeps_one_cumulative_row_per_replica(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'events.db'}"
    EventReader(url).close()
    monkeypatch.setattr(monitor.DriftFlusher, "_export", lambda self: None)
    clock = [1_800_000_000.0]
    scorer = types.SimpleNamespace(drift=drift.DriftCounter(fit_features(frame(500, seed=1), {})[0], clock=lambda: clock[0]), version="v1")
    f = monitor.DriftFlusher(url, "exp", {"a": scorer}, {"flush_s": 3600, "window_s": None}, clock=lambda: clock[0])
    try:
        for i in range(3):
            scorer.drift.observe(_rows(frame(10, seed=i)))
            f.flush()
            clock[0] += 100_000.0
        reader = EventReader(url)
        try:
            rows = reader.drift("exp")["a"]
        finally:
            reader.close()
        assert [r["rows"] for r in rows] == [30] and "/" not in rows[0]["replica"]
        assert monitor.window_of({"window_s": None}) is None
    finally:
        f.close()
