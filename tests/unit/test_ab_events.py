"""The event store on real SQLite and PostgreSQL: group commit, idempotent outcomes, schema
version, and no acknowledged event lost when the writing process is killed with SIGKILL; a
version-3 store is migrated to version 4 (exposures.generation, ab_shadow.status and latency_ms)
with its rows kept; the analysis reads one generation; an outcome's insert says whether it was
new, also for concurrent repeats."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import sqlalchemy as sa
from helpers import pg_database

from rayload.errors import RayloadError
from rayload.serve.event_writer import EventWriter
from rayload.serve.events import SCHEMA_VERSION, EventReader, meta


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'events.db'}"
        return
    with pg_database("rayload_ab") as url:
        yield url


def exposure(i: int, generation=None) -> dict:
    row = {"request_id": f"r{i}", "experiment": "e", "unit_id": f"u{i % 7}", "arm": "a" if i % 2 else "b", "model_version": "v1",
           "score": 0.5, "status": "ok", "latency_ms": 1.0, "layout": "{}", "ts": time.time()}
    return {**row, "generation": generation} if generation is not None else row


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


def test_async_writes_wake_the_loop_once_per_commit_and_fail_loudly(url, monkeypatch):
    """`await writer.write(...)` from many coroutines: every event is committed before its await
    returns, the writer wakes the event loop once per commit (not once per event), a bad row
    fails only its own coroutine (the good one beside it is committed), a write that fails
    raises in its coroutine, and a closed writer refuses at once."""
    writer = EventWriter(url, flush_ms=5, max_batch=64)
    wakeups, commits = [], []
    settle = writer._settle  # every commit (or failed commit) settles its batch once
    monkeypatch.setattr(writer, "_settle", lambda batch, error: (commits.append(len(batch)), settle(batch, error))[1])

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a, **k: (wakeups.append(1), real(*a, **k))[1]
        # an exposure plus one shadow score per request, awaited together
        await asyncio.gather(*[writer.write(("exposure", exposure(i)), ("shadow", {"request_id": f"r{i}", "arm": "b", "model_version": "v2",
                                                                                  "score": 0.4, "ts": time.time()}))
                               for i in range(200)])
        bad = {**exposure(1000), "arm": None}  # NOT NULL column: the commit fails
        results = await asyncio.gather(writer.write(("exposure", bad)), writer.write(("exposure", exposure(1001))), return_exceptions=True)
        integrity = writer.engine.dialect.loaded_dbapi.IntegrityError  # the driver's own: the writer runs its cursor
        assert isinstance(results[0], integrity), results
        assert results[1] is None, results  # a good event sharing the failed commit is committed on its own
        with pytest.raises(ValueError, match=r"unknown column\(s\) \['vaule'\] for ab_outcomes"):
            await writer.write(("outcome", {"request_id": "r3", "event": "click", "vaule": 1.0, "ts": time.time()}))
        await writer.write(("outcome", {"request_id": "r3", "event": "click", "value": 1.0, "ts": time.time()}))

    asyncio.run(main())
    writer.close()
    # a request's two events never straddle commits here (batches of 64 items, pairs enqueued
    # together), so every commit completes at least one coroutine: exactly one wake-up each
    assert len(wakeups) == len(commits) < 202, (len(wakeups), commits)  # 204 awaited writes, grouped
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(writer.write(("outcome", {"request_id": "r4", "event": "click", "value": 1.0, "ts": time.time()})))
    reader = EventReader(url)
    assert reader.counts() == {"exposure": 201, "shadow": 200, "outcome": 1}
    reader.close()


def test_a_cancelled_submit_does_not_stop_the_writer(url):
    """A caller may cancel its Future (asyncio.wrap_future does when its awaiting request is
    cancelled); settling it would raise InvalidStateError in the writer thread, which then
    never committed again."""
    writer = EventWriter(url, flush_ms=20)
    cancelled = writer.submit("exposure", exposure(0))
    assert cancelled.cancel()
    writer.submit("exposure", exposure(1)).result(timeout=30)
    writer.submit("exposure", exposure(2)).result(timeout=30)  # a later commit: the thread is alive
    writer.close()
    reader = EventReader(url)
    assert reader.counts()["exposure"] == 3  # the cancelled caller's event was still written
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
from rayload.serve.event_writer import EventWriter
w = EventWriter(sys.argv[1], flush_ms=2, max_batch=32)
i = 0
while True:
    rows = [{"request_id": f"k{i + j}", "experiment": "e", "unit_id": "u", "arm": "a", "model_version": "v",
             "score": 0.1, "status": "ok", "latency_ms": 1.0, "layout": "{}", "ts": time.time()} for j in range(4)]
    if sys.argv[2] == "thread":  # the writer thread's group commit, one event at a time
        for row in rows:
            w.submit("exposure", row).result()
    else:  # a batch's exposures committed in this thread, as the combined-mode router does,
        events = [("exposure", row) for row in rows]  # and through the writer thread when the database is locked
        if not w.write_now(events):
            for f in [w.submit(*e) for e in events]:
                f.result()
    print(*(row["request_id"] for row in rows), sep="\\n", flush=True)  # acknowledged: only now may a client be told 2xx
    i += 4
"""


@pytest.mark.parametrize("path", ["thread", "inline"])
def test_sigkill_loses_no_acknowledged_event(url, tmp_path, path):
    EventReader(url).close()  # schema first, so the writer starts at once
    proc = subprocess.Popen([sys.executable, "-c", WRITER, url, path], stdout=subprocess.PIPE, text=True)
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


def test_write_now_commits_at_once_and_the_wal_reaches_the_database_file_within_fsync_s(tmp_path):
    """sync=normal: a commit is in the WAL when write_now returns (a reader sees it; a killed
    process keeps it, above), and the writer thread checkpoints it into the database file, which
    fsyncs the WAL first, within fsync_s. sync=full fsyncs each commit instead."""
    import shutil
    import sqlite3

    db = tmp_path / "events.db"
    writer = EventWriter(f"sqlite:///{db}", fsync_s=3.0)  # long enough that the first look comes before it
    with writer.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL

    def rows_in_database_file() -> int:  # the main file alone, as if the WAL were lost
        copy = tmp_path / "copy.db"
        shutil.copyfile(db, copy)
        conn = sqlite3.connect(copy)
        try:
            return conn.execute("SELECT count(*) FROM ab_exposures").fetchone()[0]
        except sqlite3.OperationalError:  # no such table: the schema, too, is still only in the WAL
            return 0
        finally:
            conn.close()

    written = time.monotonic()
    writer.write_now([("exposure", exposure(i)) for i in range(20)])
    reader = EventReader(f"sqlite:///{db}")
    assert reader.counts()["exposure"] == 20
    in_file = rows_in_database_file()
    # committed into the WAL, not yet checkpointed: unless this process stalled past fsync_s (a
    # loaded machine), when the checkpoint may rightly have run already
    assert in_file == 0 or time.monotonic() - written >= writer.fsync_s, in_file
    deadline = time.monotonic() + 20
    while rows_in_database_file() < 20 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rows_in_database_file() == 20
    with writer.engine.connect() as conn:  # the sync commit ran (synchronous=FULL: it fsyncs the WAL)...
        synced_at = float(conn.exec_driver_sql("SELECT value FROM ab_meta WHERE key = 'synced_at'").scalar())
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # ...and the pooled connection is NORMAL again
    assert time.time() - 30 < synced_at <= time.time()
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.write_now([("exposure", exposure(99))])
    full = EventWriter(f"sqlite:///{tmp_path / 'full.db'}", sync="full")
    with full.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
    assert full.fsync_s is None  # nothing left to fsync later
    full.close()
    reader.close()


def test_the_wal_sync_runs_under_steady_traffic_and_a_failed_sync_is_retried(tmp_path, caplog):
    """The writer thread's sync comes due even while events keep it busy (its wake-up flag is
    set again before every wait), and a sync that fails leaves no pooled connection at
    synchronous=FULL and is retried, not forgotten."""
    import threading

    url = f"sqlite:///{tmp_path / 'events.db'}"
    writer = EventWriter(url, flush_ms=1, fsync_s=0.3)

    def synced_at():
        with writer.engine.connect() as conn:
            value = conn.exec_driver_sql("SELECT value FROM ab_meta WHERE key = 'synced_at'").scalar()
        return None if value is None else float(value)

    stop = threading.Event()

    def steady():  # outcomes arriving faster than the 1 ms flush window, for as long as the test runs
        i, pending = 0, []
        while not stop.is_set():
            pending.append(writer.submit("outcome", {"request_id": f"r{i}", "event": "click", "value": 1.0, "ts": time.time()}))
            i += 1
            time.sleep(0.0002)
        for f in pending:
            f.result(timeout=30)

    feeder = threading.Thread(target=steady)
    feeder.start()
    try:
        deadline = time.monotonic() + 15
        while synced_at() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert synced_at() is not None
    finally:
        stop.set()
        feeder.join()

    with writer.engine.begin() as conn:  # the next sync's INSERT fails
        conn.exec_driver_sql("ALTER TABLE ab_meta RENAME TO ab_meta_away")
    caplog.clear()
    writer.write_now([("exposure", exposure(1))])

    def failed_and_rearmed() -> bool:  # a sync was attempted, failed, and its window was armed again
        return "event store sync failed" in caplog.text and writer._unsynced_since is not None

    deadline = time.monotonic() + 10
    while not (done := failed_and_rearmed()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert done, caplog.text
    conns = [writer.engine.raw_connection() for _ in range(3)]  # every pooled connection is back at NORMAL
    try:
        assert [c.cursor().execute("PRAGMA synchronous").fetchone()[0] for c in conns] == [1, 1, 1]
    finally:
        for c in conns:
            c.close()
    with writer.engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE ab_meta_away RENAME TO ab_meta")
    deadline = time.monotonic() + 10
    while writer._unsynced_since is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert writer._unsynced_since is None and synced_at() is not None
    writer.close()


OPENER = """
import os, sys, time
from rayload.serve.event_writer import EventWriter
open(sys.argv[2] + "." + str(os.getpid()), "w").close()  # imported: ready
while not os.path.exists(sys.argv[2]):  # every opener waits for the others, then all open at once
    time.sleep(0.001)
EventWriter(sys.argv[1]).close()
print("opened")
"""


def test_replicas_opening_a_new_store_at_once_all_start(url, tmp_path):
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
        go = tmp_path / f"go-{round_}"
        procs = [subprocess.Popen([sys.executable, "-c", OPENER, target, str(go)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(4)]
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob(f"go-{round_}.*"))) < 4 and time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.01)
        go.touch()  # all four have imported rayload: they open the store together
        outs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0] * 4, [err[-1500:] for _, err in outs]
        reader = EventReader(target)
        assert reader.counts() == {"exposure": 0, "shadow": 0, "outcome": 0}
        reader.close()


def test_a_bad_row_fails_only_its_own_waiter_in_a_group_commit(url):
    """A row the database refuses (NaN as NULL in a NOT NULL column, a string the driver
    cannot encode, one over a PostgreSQL column's length) fails its own write and nobody
    else's in the same commit; a request's events (exposure and shadow) stay all or nothing."""
    writer = EventWriter(url, flush_ms=100)  # everything below shares one group commit
    good = [writer.submit("exposure", exposure(i)) for i in range(3)]
    good.append(writer.submit("outcome", {"request_id": "r0", "event": "click", "value": 1.0, "ts": time.time()}))
    null = float("nan") if url.startswith("sqlite") else None  # SQLite binds NaN as NULL; PostgreSQL keeps NaN
    bad = [writer.submit("outcome", {"request_id": "r1", "event": "click", "value": null, "ts": time.time()}),
           writer.submit("exposure", {**exposure(10), "unit_id": "\ud800"})]
    if url.startswith("postgresql"):
        bad.append(writer.submit("exposure", {**exposure(11), "unit_id": "u" * 257}))

    async def together():  # a request's exposure with a bad shadow row: neither is kept
        return await asyncio.gather(writer.write(("exposure", exposure(20)), ("shadow", {"request_id": "r20", "arm": "b",
                                                                                          "model_version": None, "score": 0.5, "ts": 0.0})),
                                    writer.write(("exposure", exposure(21))), return_exceptions=True)

    pair, alone = asyncio.run(together())
    for f in good:
        f.result(timeout=30)
    dbapi = writer.engine.dialect.loaded_dbapi  # the driver's own errors: the writer runs its cursor
    expected = [dbapi.IntegrityError, UnicodeEncodeError, dbapi.DataError]  # NULL value, lone surrogate, too long
    for f, error in zip(bad, expected):
        with pytest.raises(error):  # answered with the row's own error, not left waiting (a TimeoutError)
            f.result(timeout=30)
    assert isinstance(pair, dbapi.IntegrityError) and alone is None
    writer.close()
    reader = EventReader(url)
    assert reader.counts() == {"exposure": 4, "shadow": 0, "outcome": 1}
    assert not reader.exposure_exists("r20") and reader.exposure_exists("r21")
    reader.close()


# ---------------------------------------------------------------- schema version 4, outcome inserts


def _older_store(conn, version: int, last_columns: str) -> None:
    """ab_meta at `version` and ab_exposures as that version made it (its last columns given)."""
    conn.execute(sa.text("CREATE TABLE ab_meta (key VARCHAR(64) PRIMARY KEY, value TEXT)"))
    conn.execute(sa.text(f"INSERT INTO ab_meta VALUES ('schema_version', '{version}')"))
    conn.execute(sa.text("CREATE TABLE ab_exposures (request_id VARCHAR(64) PRIMARY KEY, experiment VARCHAR(128) NOT NULL, "
                         "unit_id VARCHAR(256) NOT NULL, arm VARCHAR(64) NOT NULL, model_version VARCHAR(128) NOT NULL, score FLOAT, "
                         "status VARCHAR(16) NOT NULL, latency_ms FLOAT NOT NULL, layout VARCHAR(256) NOT NULL, ts FLOAT NOT NULL, "
                         f"{last_columns})"))


def test_a_version_3_store_is_migrated_to_4_and_keeps_its_rows(url):
    engine = sa.create_engine(url)
    with engine.begin() as conn:  # the version-3 layout of the tables version 4 changed
        _older_store(conn, 3, "features TEXT")
        conn.execute(sa.text("CREATE TABLE ab_shadow (request_id VARCHAR(64), arm VARCHAR(64), model_version VARCHAR(128) NOT NULL, "
                             "score FLOAT, ts FLOAT NOT NULL, PRIMARY KEY (request_id, arm))"))
        conn.execute(sa.text("INSERT INTO ab_exposures VALUES ('old', 'e', 'u', 'a', 'v', 0.5, 'ok', 1.0, '{}', 1.0, NULL)"))
        conn.execute(sa.text("INSERT INTO ab_shadow VALUES ('old', 'b', 'v2', 0.4, 1.0)"))
    reader = EventReader(url)  # opening it migrates it
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT value FROM ab_meta WHERE key = 'schema_version'")).scalar_one() == str(SCHEMA_VERSION)
        assert conn.execute(sa.text("SELECT request_id, generation FROM ab_exposures")).all() == [("old", None)]
        assert conn.execute(sa.text("SELECT arm, status, latency_ms FROM ab_shadow")).all() == [("b", "ok", None)]
    writer = EventWriter(url)
    # a shadow row written without a status gets the column's default, as an INSERT leaving it out would
    writer.submit("shadow", {"request_id": "old", "arm": "c", "model_version": "v3", "score": 0.1, "ts": 2.0}).result(timeout=30)
    writer.submit("exposure", exposure(1, "g")).result(timeout=30)
    writer.close()
    assert list(reader.frame("e")["request_id"].sort_values()) == ["old", "r1"]  # no generation: everything, as before
    assert list(reader.frame("e", generation="g")["request_id"]) == ["r1"]
    assert reader.shadow_summary("e") == {"b": {"requests": 1, "errors": 0, "error_rate": 0.0},
                                          "c": {"requests": 1, "errors": 0, "error_rate": 0.0}}
    assert reader.shadow_summary("e", "g") == {}
    reader.close()
    engine.dispose()


def test_concurrent_repeats_of_an_outcome_are_inserted_once_and_say_so(url):
    writer = EventWriter(url, flush_ms=20)  # the repeats share one group commit as well as arriving apart
    writer.submit("exposure", exposure(1)).result(timeout=30)

    async def main():
        outcome = {"request_id": "r1", "event": "click", "value": 1.0, "ts": time.time()}
        together = await asyncio.gather(*[writer.write(("outcome", dict(outcome))) for _ in range(5)])
        later = await writer.write(("outcome", dict(outcome, value=0.0)))
        other = await writer.write(("outcome", dict(outcome, event="conversion")))
        plain = await writer.write(("exposure", exposure(2)))
        return together, later, other, plain

    together, later, other, plain = asyncio.run(main())
    writer.close()
    assert sorted(together) == [0, 0, 0, 0, 1] and later == 0 and other == 1 and plain is None
    reader = EventReader(url)
    assert reader.counts()["outcome"] == 2
    reader.close()


def test_a_positive_outcome_replaces_a_stored_one_of_zero_or_less_and_nothing_replaces_a_positive_one(url):
    """A value of 0 or less counts as no outcome; stored first, it took the key, so a later click
    of value 1 for the same request answered duplicate and the exposure stayed unclicked forever
    (in the analysis and in retraining's labels)."""
    from rayload.serve.events import outcomes

    writer = EventWriter(url, flush_ms=5)
    writer.submit("exposure", exposure(1)).result(timeout=30)

    async def main():
        base = {"request_id": "r1", "event": "click", "ts": 100.0}
        return [await writer.write(("outcome", dict(base, value=v, ts=100.0 + i))) for i, v in enumerate((0.0, -1.0, 1.0, 2.0, 0.0))]

    inserted = asyncio.run(main())
    writer.close()
    assert inserted == [1, 0, 1, 0, 0]  # stored; not below a non-positive one; replaced it; kept; kept
    reader = EventReader(url)
    with reader.engine.connect() as conn:
        assert conn.execute(sa.select(outcomes.c.value, outcomes.c.ts)).all() == [(1.0, 102.0)]
    assert reader.frame("e")["outcome"].tolist() == [1.0]  # what the analysis counts a click by (> 0)
    reader.close()


def test_a_version_4_store_takes_the_weights_of_many_long_named_arms_after_its_migration(url):
    """layout was VARCHAR(256): four arms with 64-character names (allowed) wrote 292 characters,
    and PostgreSQL refused every exposure. Version 5 makes it text."""
    import json

    engine = sa.create_engine(url)
    with engine.begin() as conn:
        _older_store(conn, 4, "features TEXT, generation VARCHAR(64)")
    layout = json.dumps({f"{c}" * 64: w for c, w in zip("abcd", (0.4, 0.2, 0.2, 0.2))}, sort_keys=True)
    assert len(layout) > 256
    writer = EventWriter(url)
    writer.submit("exposure", {**exposure(1), "layout": layout}).result(timeout=30)
    writer.close()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT layout FROM ab_exposures")).scalar_one() == layout
        assert conn.execute(sa.text("SELECT value FROM ab_meta WHERE key = 'schema_version'")).scalar_one() == str(SCHEMA_VERSION) == "5"
    engine.dispose()


def test_close_commits_what_was_submitted_before_it_within_a_long_flush_window(tmp_path):
    """close() joined the writer thread for 10 s while it slept out a flush window of up to 60 s,
    then refused the queued event ("event writer is closed"): an acknowledged submit lost."""
    from rayload.serve.event_writer import EventWriter

    url = f"sqlite:///{tmp_path / 'e.db'}"
    writer = EventWriter(url, flush_ms=30_000)
    row = {"request_id": "r1", "experiment": "e", "unit_id": "u", "arm": "a", "model_version": "v", "score": 0.5, "status": "ok",
           "latency_ms": 1.0, "layout": "{}", "ts": time.time()}
    future = writer.submit("exposure", row)
    time.sleep(0.1)  # the thread is inside its flush window
    writer.close()  # ends the window and commits, instead of refusing the event after a 10 s join
    assert future.result(timeout=1) is None
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        assert conn.execute(sa.text("select request_id from ab_exposures")).scalars().all() == ["r1"]
    engine.dispose()


def test_status_of_a_moved_run_folder_names_the_missing_store_and_creates_none(tmp_path):
    """serve.json keeps the store's absolute path: after the run folder moved, `ab status` was a
    500-line traceback, or, where the old folder existed again, a new empty store and 0 exposures."""
    from rayload.serve import control

    missing = tmp_path / "old" / "events.db"
    (tmp_path / "old").mkdir()
    args = {"events_url": f"sqlite:///{missing}", "experiment": "e"}
    with pytest.raises(RayloadError, match=rf"the event store {missing} does not exist"):
        control._shadow_summary(args)
    assert not missing.exists()


def test_a_relative_sqlite_store_in_an_ab_spec_is_the_spec_folders(tmp_path, monkeypatch):
    """It stayed relative, so `ab status` from another directory opened (or made) another file."""
    from rayload.ab_spec import load_ab_spec

    (tmp_path / "ck").mkdir()
    (tmp_path / "ab.yaml").write_text("name: ab\nevents: {url: 'sqlite:///ev/events.db'}\narms:\n"
                                      "  - {name: a, weight: 0.9, checkpoint: ck}\n  - {name: b, weight: 0.1, checkpoint: ck}\n")
    monkeypatch.chdir("/")
    assert load_ab_spec(str(tmp_path / "ab.yaml")).events.url == f"sqlite:///{tmp_path}/ev/events.db"


def test_exposures_of_one_time_come_back_in_one_order(url):
    """A combined-mode batch logs its exposures with one ts; frame() had no ORDER BY, so rows of
    one time came back in whatever order the database chose, and a sequential-test look cut
    inside such a group could hold other rows the next time it was computed."""
    writer = EventWriter(url, flush_ms=1)
    ts = time.time()
    for rid in ("r9", "r3", "r7", "r1"):
        writer.submit("exposure", {**exposure(0), "request_id": rid, "ts": ts}).result(timeout=30)
    writer.submit("exposure", {**exposure(0), "request_id": "r0", "ts": ts + 1}).result(timeout=30)
    writer.close()
    reader = EventReader(url)
    assert list(reader.frame("e")["request_id"]) == ["r1", "r3", "r7", "r9", "r0"]
    reader.close()


def test_one_callers_events_are_never_split_across_commits(url):
    """The writer cut its queue every max_batch items whoever waited on them: a serve batch's
    exposures handed over at once (the locked-store fallback) could commit in part while the
    rest failed, and every request was told to retry although some exposures were stored."""
    writer = EventWriter(url, flush_ms=50, max_batch=2)

    async def go():
        rows = [exposure(i) for i in range(3)]
        rows[2]["unit_id"] = None  # NOT NULL: the third row fails its commit
        with pytest.raises(Exception, match="unit_id|NOT NULL|null value"):
            await writer.write(*[("exposure", r) for r in rows])
        ok = [exposure(i) for i in range(10, 15)]  # five events of one caller, past max_batch: one commit, all stored
        await writer.write(*[("exposure", r) for r in ok])

    asyncio.run(go())
    writer.close()
    reader = EventReader(url)
    assert sorted(reader.frame("e")["request_id"]) == ["r10", "r11", "r12", "r13", "r14"]
    reader.close()


@pytest.mark.timeout(60)  # without the bound it waited as long as TCP does
def test_a_postgresql_server_that_never_answers_fails_within_the_connect_bound(monkeypatch):
    """No connect timeout: a server that accepted the connection and then said nothing (frozen,
    or behind a partition) held the writer, and every /predict, as long as TCP does."""
    import socket

    from rayload.serve import events

    monkeypatch.setattr(events, "PG_CONNECT_TIMEOUT_S", 1)
    with socket.socket() as silent:  # the kernel completes the handshake from the backlog; nobody answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        engine = events.engine_for(f"postgresql://u@127.0.0.1:{silent.getsockname()[1]}/db")
        start = time.monotonic()
        with pytest.raises(sa.exc.OperationalError):
            engine.connect()
        assert time.monotonic() - start < 10
        engine.dispose()
