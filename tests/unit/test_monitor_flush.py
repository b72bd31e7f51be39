"""The drift flusher: counts whose write failed are written on a later flush (and at close),
not marked as written and lost."""

import types

import pytest

from rayload.serve import monitor
from rayload.serve.events import EventReader

REAL_EXPORT = monitor.DriftFlusher._export  # the fixture stubs it out


class _Counter:
    """The flusher's side of a DriftCounter (one period: `window_s` unset)."""

    def __init__(self):
        self.version, self.rows, self.period, self.closed = 0, 0, 0, []

    def count_by(self, period_s):
        assert period_s is None

    def period_end(self, period):
        return None

    def observe(self, n):
        self.rows += n
        self.version += 1

    def snapshot(self):
        return {"rows": self.rows, "counts": {"c": [self.rows, 0]}}


@pytest.fixture()
def flusher(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'events.db'}"
    EventReader(url).close()  # creates the store
    monkeypatch.setattr(monitor.DriftFlusher, "_export", lambda self: None)  # the Prometheus gauges are not under test
    counter = _Counter()
    f = monitor.DriftFlusher(url, "exp", {"a": types.SimpleNamespace(drift=counter, version="v1")}, {"flush_s": 3600})
    yield f, counter, url
    f._stop.set()
    f._thread.join(timeout=5)
    f.engine.dispose()


def _stored_rows(url):
    reader = EventReader(url)
    try:
        return [s["rows"] for s in reader.drift("exp").get("a", [])]
    finally:
        reader.close()


def test_counts_of_a_failed_write_are_written_by_the_next_flush_and_at_close(flusher, monkeypatch):
    f, counter, url = flusher
    counter.observe(7)
    real = monitor.upsert_drift
    monkeypatch.setattr(monitor, "upsert_drift", lambda engine, rows: (_ for _ in ()).throw(OSError("database is locked")))
    with pytest.raises(OSError):
        f.flush()
    monkeypatch.setattr(monitor, "upsert_drift", real)
    f.close()  # no traffic since the failure: the last counts are still written
    assert _stored_rows(url) == [7]


def test_a_successful_flush_is_not_repeated_without_new_counts(flusher, monkeypatch):
    f, counter, url = flusher
    counter.observe(3)
    f.flush()
    writes = []
    monkeypatch.setattr(monitor, "upsert_drift", lambda engine, rows: writes.append(rows))
    f.flush()
    assert writes == [] and _stored_rows(url) == [3]
    counter.observe(2)
    f.flush()
    assert [[r["rows"] for r in rows] for rows in writes] == [[5]]


def test_only_replicas_of_the_arms_current_model_are_merged():
    """An experiment restarted under its name after an arm's checkpoint changed leaves the old
    replicas' rows in the store; their counts are in the old model's bins and must not be added
    to the new one's (zip would also cut the longer list short)."""
    from rayload.serve import drift

    new = drift.Bins("price", "numeric", ("missing", "<= 10", "> 10"), (0.0, 0.5, 0.5), edges=(10.0,))
    snaps = {"b": [{"model_version": "run-b@ffff000000", "replica": "r1", "rows": 4000, "counts": {"price": [0, 1000, 1000, 1000, 1000]}},
                   {"model_version": "run-b@0000aaaaaa", "replica": "r2", "rows": 1000, "counts": {"price": [0, 900, 100]}},
                   {"model_version": "run-b@0000aaaaaa", "replica": "r3", "rows": 1000, "counts": {"price": [0, 800, 200]}}]}
    row, = monitor.merged_report(snaps, {"b": [new]}, 0.2, 500, {"b": "run-b@0000aaaaaa"})
    assert (row["model_version"], row["replicas"], row["rows"]) == ("run-b@0000aaaaaa", 2, 2000)
    assert row["psi"] == pytest.approx(drift.psi(new.expected, [0, 1700, 300]))
    assert monitor.merged_report(snaps, {"b": [new]}, 0.2, 500, {"b": "run-b@1111"}) == []  # no replica of it has reported yet


class _Gauge:
    def __init__(self):
        self.values = {}

    def set(self, value, tags):
        self.values[(tags["arm"], tags["feature"])] = value


def test_gauges_say_whether_a_psi_is_judged_and_features_gone_from_the_window_are_cleared(flusher, monkeypatch):
    """The PSI gauge was set for features not judged yet (a PSI of 8 on 20 rows) with nothing to
    tell them apart, and a feature whose rows all left the window kept its last values,
    flagged=1 included."""
    f, counter, _ = flusher
    counter.bins = {}  # what _export hands merged_report, stubbed here
    gauges = tuple(_Gauge() for _ in range(4))  # psi, flagged, oov_rate, judged
    monkeypatch.setattr(f, "_metrics", lambda: gauges)
    reports = iter([[{"arm": "a", "feature": "x", "psi": 8.0, "flagged": False, "rows": 20, "judged": False},
                     {"arm": "a", "feature": "y", "psi": 0.5, "flagged": True, "rows": 900, "oov_rate": 0.3, "judged": True}],
                    [{"arm": "a", "feature": "x", "psi": 0.01, "flagged": False, "rows": 600, "judged": True}]])
    monkeypatch.setattr(monitor, "merged_report", lambda *a, **k: next(reports))
    monkeypatch.setitem(f.cfg, "threshold", 0.2)
    monkeypatch.setitem(f.cfg, "min_rows", 100)
    REAL_EXPORT(f)
    assert gauges[3].values == {("a", "x"): 0.0, ("a", "y"): 1.0} and gauges[1].values[("a", "y")] == 1.0
    REAL_EXPORT(f)  # y's rows left the window
    assert gauges[1].values[("a", "y")] == 0.0 and gauges[3].values[("a", "y")] == 0.0 and gauges[3].values[("a", "x")] == 1.0
