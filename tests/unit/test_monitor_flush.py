"""The drift flusher: counts whose write failed are written on a later flush (and at close),
not marked as written and lost."""

import types

import pytest

from rayload.serve import monitor
from rayload.serve.events import EventReader


class _Counter:
    def __init__(self):
        self.version, self.rows = 0, 0

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
