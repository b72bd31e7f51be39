"""The event store on real SQLite and PostgreSQL: group commit, idempotent outcomes, schema
version, and no acknowledged event lost when the writing process is killed with SIGKILL."""

import os
import signal
import subprocess
import sys
import time

import pytest
import sqlalchemy as sa
from helpers import pg_database

from rayload.errors import RayloadError
from rayload.serve.events import EventReader, EventWriter, meta

@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'events.db'}"
        return
    with pg_database("rayload_ab") as url:
        yield url


def exposure(i: int) -> dict:
    return {"request_id": f"r{i}", "experiment": "e", "unit_id": f"u{i % 7}", "arm": "a" if i % 2 else "b", "model_version": "v1",
            "score": 0.5, "status": "ok", "latency_ms": 1.0, "layout": "{}", "ts": time.time()}


def test_group_commit_idempotent_outcomes_and_join(url):
    writer = EventWriter(url, flush_ms=5, max_batch=64)
    futures = [writer.submit("exposure", exposure(i)) for i in range(300)]
    for f in futures:
        f.result(timeout=30)
    for _ in range(3):  # the same feedback three times is one outcome
        writer.submit("outcome", {"request_id": "r1", "event": "click", "value": 1.0, "ts": time.time()}).result(timeout=30)
    writer.submit("exposure", exposure(5)).result(timeout=30)  # a retried exposure is not a second row
    writer.close()
    reader = EventReader(url)
    assert reader.counts() == {"exposure": 300, "shadow": 0, "outcome": 1}
    assert reader.exposure_exists("r7") and not reader.exposure_exists("nope")
    frame = reader.frame("e")
    assert len(frame) == 300 and frame.set_index("request_id").loc["r1", "outcome"] == 1.0 and frame["outcome"].sum() == 1.0
    reader.close()


def test_a_newer_schema_version_is_refused(url):
    EventReader(url).close()
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(meta.update().where(meta.c.key == "schema_version").values(value="99"))
    engine.dispose()
    with pytest.raises(RayloadError, match="schema version 99"):
        EventReader(url)


WRITER = """
import sys, time
from rayload.serve.events import EventWriter
w = EventWriter(sys.argv[1], flush_ms=2, max_batch=32)
i = 0
while True:
    rid = f"k{i}"
    w.submit("exposure", {"request_id": rid, "experiment": "e", "unit_id": "u", "arm": "a", "model_version": "v",
                          "score": 0.1, "status": "ok", "latency_ms": 1.0, "layout": "{}", "ts": time.time()}).result()
    print(rid, flush=True)  # acknowledged: only now may a client be told 2xx
    i += 1
"""


def test_sigkill_loses_no_acknowledged_event(url, tmp_path):
    EventReader(url).close()  # schema first, so the writer starts at once
    proc = subprocess.Popen([sys.executable, "-c", WRITER, url], stdout=subprocess.PIPE, text=True)
    acked = []
    deadline = time.monotonic() + 60
    while len(acked) < 300 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            acked.append(line.strip())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    acked += [line.strip() for line in proc.stdout.read().splitlines() if line.strip()]  # printed before the kill
    reader = EventReader(url)
    stored = set(reader.frame("e")["request_id"])
    reader.close()
    assert len(acked) >= 300
    assert set(acked) <= stored


OPENER = """
import sys, time
from rayload.serve.events import EventWriter
start = float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))
EventWriter(sys.argv[1]).close()
print("opened")
"""


def test_replicas_opening_a_new_store_at_once_all_start(url):
    """Serve starts an experiment's replicas together: each creates the schema of the same new
    store at the same moment (the race once stopped a replica with "table ab_meta already
    exists")."""
    for round_ in range(3):  # a fresh store each round: the race is in creating it
        target = url if url.startswith("postgresql") else url.replace("events.db", f"events-{round_}.db")
        if url.startswith("postgresql") and round_:
            engine = sa.create_engine(url)
            with engine.begin() as conn:
                for table in ("ab_drift", "ab_outcomes", "ab_shadow", "ab_exposures", "ab_meta"):
                    conn.execute(sa.text(f"DROP TABLE IF EXISTS {table}"))
            engine.dispose()
        start = time.time() + 3  # past every interpreter's start-up
        procs = [subprocess.Popen([sys.executable, "-c", OPENER, target, str(start)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(4)]
        outs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0] * 4, [err[-1500:] for _, err in outs]
        reader = EventReader(target)
        assert reader.counts() == {"exposure": 0, "shadow": 0, "outcome": 0}
        reader.close()
