"""The A/B event store (SQLAlchemy Core): exposures, shadow scores, outcomes.

Guarantee: a 2xx answer from the router means its event is committed to the database before
the answer leaves. With SQLite (WAL mode) the default `events.sync: normal` commits without an
fsync per commit: a committed transaction is in the WAL file, in the operating system's
buffers, so a replica killed with SIGKILL (or a crashed interpreter) loses no acknowledged
event; within `events.fsync_s` of a commit (default 1 s) the writer thread fsyncs the WAL (a
synchronous=FULL commit of one row, then a checkpoint), so a machine crash or power cut loses
at most that much acknowledged traffic. `events.sync: full` fsyncs every commit instead
(synchronous=FULL). PostgreSQL commits as the server is configured. A request in flight when its replica dies got no answer and may
or may not be recorded.

Two write paths share that guarantee. In combined mode the router commits a batch's exposures
in the replica's own thread right after the batch's model calls (`write_now`, SQLite only: a
local commit of a few dozen rows takes ~0.1 ms with the GIL released inside SQLite), so an
answer never waits for another thread to wake. Everything else (outcomes, shadow scores, error
exposures, separate mode, PostgreSQL, whose commit is a network round trip) goes through the
writer thread's group commit: it commits everything that arrived within `flush_ms` of the
group's first event (in transactions of at most `max_batch` rows), so the commit cost is
shared; what arrives while a commit runs forms the next group.

`request_id` is the primary key of an exposure; an outcome is keyed by (request_id, event),
so a repeated feedback call is a no-op. An exposure keeps the raw features of the row it
showed (JSON), which `rayload retrain` turns back into training rows. `ab_drift` holds each
replica's feature-drift counts (serve/drift.py), rewritten in place as they grow.

The schema carries its version in `ab_meta`; an older store is migrated forward in place
(version 1 -> 2: exposures.features and ab_drift were added).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Any

import sqlalchemy as sa

log = logging.getLogger(__name__)
SCHEMA_VERSION = 2

metadata = sa.MetaData()
meta = sa.Table("ab_meta", metadata, sa.Column("key", sa.String(64), primary_key=True), sa.Column("value", sa.Text))
exposures = sa.Table(
    "ab_exposures", metadata,
    sa.Column("request_id", sa.String(64), primary_key=True),
    sa.Column("experiment", sa.String(128), nullable=False, index=True),
    sa.Column("unit_id", sa.String(256), nullable=False),
    sa.Column("arm", sa.String(64), nullable=False),
    sa.Column("model_version", sa.String(128), nullable=False),
    sa.Column("score", sa.Float),
    sa.Column("status", sa.String(16), nullable=False),  # ok | error
    sa.Column("latency_ms", sa.Float, nullable=False),
    sa.Column("layout", sa.String(256), nullable=False),  # the weights in force (JSON), for the SRM check
    sa.Column("ts", sa.Float, nullable=False),
    sa.Column("features", sa.Text),  # the shown row's raw features (JSON); null when logging them is off
)
shadow_scores = sa.Table(
    "ab_shadow", metadata,
    sa.Column("request_id", sa.String(64), primary_key=True),
    sa.Column("arm", sa.String(64), primary_key=True),
    sa.Column("model_version", sa.String(128), nullable=False),
    sa.Column("score", sa.Float),
    sa.Column("ts", sa.Float, nullable=False),
)
outcomes = sa.Table(
    "ab_outcomes", metadata,
    sa.Column("request_id", sa.String(64), primary_key=True),
    sa.Column("event", sa.String(16), primary_key=True),
    sa.Column("value", sa.Float, nullable=False),
    sa.Column("ts", sa.Float, nullable=False),
)
drift_counts = sa.Table(
    "ab_drift", metadata,
    sa.Column("experiment", sa.String(128), primary_key=True),
    sa.Column("arm", sa.String(64), primary_key=True),
    sa.Column("replica", sa.String(128), primary_key=True),
    sa.Column("model_version", sa.String(128), nullable=False),
    sa.Column("rows", sa.Integer, nullable=False),
    sa.Column("counts", sa.Text, nullable=False),  # JSON: feature -> bin counts
    sa.Column("ts", sa.Float, nullable=False),
)
TABLES = {"exposure": exposures, "shadow": shadow_scores, "outcome": outcomes}


def default_url(run_dir: str) -> str:
    return f"sqlite:///{os.path.join(os.path.abspath(run_dir), 'events.db')}"


SYNC_MODES = ("normal", "full")


def engine_for(url: str, sync: str = "normal") -> sa.Engine:
    """An engine for the store; SQLite connections in WAL mode with `sync` (module docstring:
    normal = committed in the WAL and fsynced by the next checkpoint, full = fsynced per commit)."""
    if sync not in SYNC_MODES:
        raise ValueError(f"events.sync must be one of {SYNC_MODES}, got {sync!r}")
    if url.startswith("sqlite"):
        engine = sa.create_engine(url, connect_args={"timeout": 30})

        @sa.event.listens_for(engine, "connect")
        def _pragmas(connection, _record):
            cursor = connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA synchronous={sync.upper()}")
            cursor.close()

        return engine
    return sa.create_engine(url, pool_pre_ping=True)


_SCHEMA_LOCK = 0x7261796C6F6164  # PostgreSQL advisory lock key ("rayload")


def create_schema(engine: sa.Engine, attempts: int = 8) -> None:
    """Create the tables (idempotent) and check the stored schema version.

    Replicas of one experiment start together and open the same store. PostgreSQL serialises
    them on an advisory lock held for the transaction (its DDL is transactional). SQLite's
    "check, then CREATE" can still race between processes ("table ... already exists"): such
    an error is retried, and the retry finds the tables the other process created."""
    import random

    for attempt in range(attempts):
        try:
            _create_schema(engine)
            return
        except sa.exc.DBAPIError as exc:  # OperationalError, ProgrammingError, IntegrityError
            text = str(exc.orig).lower()
            if attempt == attempts - 1 or not ("already exists" in text or "duplicate" in text or "locked" in text):
                raise
            log.info("event store schema: another process is creating it (%s); retrying", str(exc.orig).strip())
            time.sleep(0.05 * (attempt + 1) + random.random() * 0.05)


def _create_schema(engine: sa.Engine) -> None:
    from ..errors import RayloadError

    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SCHEMA_LOCK})
        metadata.create_all(conn, checkfirst=True)
        row = conn.execute(sa.select(meta.c.value).where(meta.c.key == "schema_version")).first()
        if row is None:
            _insert_ignore(conn, meta, [{"key": "schema_version", "value": str(SCHEMA_VERSION)}])
        elif int(row[0]) > SCHEMA_VERSION:
            raise RayloadError(f"event store schema version {row[0]} is newer than this rayload's {SCHEMA_VERSION}: "
                               "upgrade rayload or use a new events.url")
        elif int(row[0]) < SCHEMA_VERSION:
            _migrate(conn, int(row[0]))


def _migrate(conn, version: int) -> None:
    """Bring an older store forward in the same transaction (create_all already added new tables)."""
    columns = {c["name"] for c in sa.inspect(conn).get_columns("ab_exposures")}
    if version < 2 and "features" not in columns:
        conn.execute(sa.text("ALTER TABLE ab_exposures ADD COLUMN features TEXT"))
    conn.execute(meta.update().where(meta.c.key == "schema_version").values(value=str(SCHEMA_VERSION)))
    log.info("event store migrated from schema version %d to %d", version, SCHEMA_VERSION)


def _insert_or_ignore(dialect: str, table: sa.Table):
    """INSERT that skips rows whose primary key exists (idempotent feedback, retried writes)."""
    if dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    elif dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:  # pragma: no cover - the store supports SQLite and PostgreSQL
        raise ValueError(f"unsupported event store dialect {dialect}")
    return insert(table).on_conflict_do_nothing()


def _insert_ignore(conn, table: sa.Table, rows: list[dict]) -> None:
    if rows:
        conn.execute(_insert_or_ignore(conn.dialect.name, table), rows)


class _DriverInsert:
    """One table's INSERT OR IGNORE compiled once for the engine's dialect and run through the
    DB-API cursor: the writer's hot path skips SQLAlchemy's per-execution work (about 0.1 ms of
    the replica's GIL per commit here, benchmarks/RESULTS.md). Missing columns are NULL; an
    unknown column is an error, as it is in SQLAlchemy."""

    def __init__(self, engine: sa.Engine, table: sa.Table):
        columns = [c.name for c in table.columns]
        compiled = _insert_or_ignore(engine.dialect.name, table).compile(dialect=engine.dialect, column_keys=columns)
        self.sql, self.positional = str(compiled), compiled.positiontup is not None
        self.columns = list(compiled.positiontup) if self.positional else columns  # positional: the SQL's own order
        self.known = frozenset(columns)
        self.table = table.name

    def params(self, rows: list[dict]) -> list:
        for row in rows:
            if not row.keys() <= self.known:
                raise ValueError(f"unknown column(s) {sorted(row.keys() - self.known)} for {self.table}")
        if self.positional:
            return [tuple(row.get(c) for c in self.columns) for row in rows]
        return [{c: row.get(c) for c in self.columns} for row in rows]


class _Waiter:
    """An event loop waiting for a group of events (one request's exposure and shadows)."""

    __slots__ = ("loop", "future", "pending", "error")

    def __init__(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future, pending: int):
        self.loop, self.future, self.pending, self.error = loop, future, pending, None


def _wake_waiters(waiters: list[_Waiter]) -> None:
    for w in waiters:  # runs on the waiters' event loop
        if not w.future.done():
            w.future.set_exception(w.error) if w.error is not None else w.future.set_result(None)


class EventWriter:
    """Group commit: `submit(kind, row)` returns a Future that resolves once the row is committed;
    `await write((kind, row), ...)` is the same for an event loop.

    The writer thread sleeps out the flush window after the first event of a group instead of
    waking for every event, and an event loop is woken once per commit however many of its
    requests the commit held (one `call_soon_threadsafe`, not one per event): with direct ingress
    the replica's event loop is the bottleneck, and per-event wake-ups were a measurable part of
    the A/B router's cost (benchmarks/RESULTS.md)."""

    def __init__(self, url: str, flush_ms: float = 1.0, max_batch: int = 512, sync: str = "normal", fsync_s: float = 1.0):
        self.engine = engine_for(url, sync)
        create_schema(self.engine)
        self.flush_s, self.max_batch = flush_ms / 1000.0, max_batch
        # SQLite: commits can run in the caller's thread (write_now); with sync=normal the writer
        # thread checkpoints the WAL (fsyncing it) within fsync_s of the first commit since the last one.
        self.inline = self.engine.dialect.name == "sqlite"
        self.fsync_s = fsync_s if self.inline and sync == "normal" else None
        self._unsynced_since: float | None = None  # monotonic time of the first commit not yet checkpointed
        self._inserts = {kind: _DriverInsert(self.engine, table) for kind, table in TABLES.items()}
        self._items: collections.deque = collections.deque()  # (kind, row, Future | _Waiter); append/popleft are atomic
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="rayload-events", daemon=True)
        self._thread.start()

    def submit(self, kind: str, row: dict[str, Any]) -> Future:
        fut: Future = Future()
        self._enqueue([(kind, row, fut)], fut)
        return fut

    async def write(self, *events: tuple[str, dict[str, Any]]) -> None:
        """Returns once every event is committed; raises what the commit raised."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop, loop.create_future(), len(events))
        self._enqueue([(kind, row, waiter) for kind, row in events], waiter)
        await waiter.future

    def write_now(self, events: list[tuple[str, dict[str, Any]]]) -> None:
        """Insert and commit `events` in the calling thread (SQLite only: `inline`); returns once
        they are committed, raises what the commit raised. Safe beside the writer thread: each
        uses its own pooled connection and SQLite serialises the two commits."""
        if self._closed:
            raise RuntimeError("event writer is closed")
        by_kind: dict[str, list] = {}
        for kind, row in events:
            by_kind.setdefault(kind, []).append(row)
        if by_kind:
            self._insert(by_kind)

    def _enqueue(self, items: list, waiter) -> None:
        if self._closed:
            error = RuntimeError("event writer is closed")
            waiter.set_exception(error) if isinstance(waiter, Future) else waiter.future.set_exception(error)
            return
        self._items.extend(items)
        if not self._wake.is_set():
            self._wake.set()

    def _loop(self) -> None:
        while True:
            timeout = None
            if self._unsynced_since is not None:
                timeout = max(0.0, self._unsynced_since + self.fsync_s - time.monotonic())
            if self._wake.wait(timeout):
                self._wake.clear()  # an event added after this sets it again; one added before is drained below
                if not self._closed:
                    time.sleep(self.flush_s)  # what arrives within the window shares the commit
                while self._items:
                    self._commit([self._items.popleft() for _ in range(min(self.max_batch, len(self._items)))])
            if self._closed:
                self._checkpoint()
                return
            # Checked after every drain too: under steady traffic through this thread the flag is
            # set again before each wait, and a sync run only on a timed-out wait would never come.
            since = self._unsynced_since
            if since is not None and time.monotonic() >= since + self.fsync_s:
                self._checkpoint()

    def _checkpoint(self) -> None:
        """Make every commit so far durable on disk, through SQLite alone: on one connection
        switched to synchronous=FULL, a one-row commit (`ab_meta.synced_at`) fsyncs the WAL, and
        with it every frame committed before it; a PASSIVE checkpoint (readers and writers are
        not waited for) then copies what it can into the database file and fsyncs that. (Opening
        and closing the files with os.open to fsync them would drop the POSIX locks SQLite holds
        in this process: that lost acknowledged events in the replica-kill test.)"""
        if self._unsynced_since is None:
            return
        self._unsynced_since = None  # a commit from here on starts the next window
        try:
            conn = self.engine.raw_connection()
            try:
                cursor = conn.cursor()
                cursor.execute("PRAGMA synchronous=FULL")
                try:
                    cursor.execute("INSERT OR REPLACE INTO ab_meta (key, value) VALUES ('synced_at', ?)", (repr(time.time()),))
                    conn.commit()
                    cursor.execute("PRAGMA wal_checkpoint(PASSIVE)")
                except BaseException:
                    conn.rollback()  # out of the transaction, or the PRAGMA below could not be changed
                    raise
                finally:
                    try:
                        cursor.execute("PRAGMA synchronous=NORMAL")
                    except Exception:  # never hand a connection that fsyncs every commit back to the pool
                        conn.invalidate()
            finally:
                conn.close()
        except Exception:
            log.exception("event store sync failed; retrying in %.1f s", self.fsync_s)
            if self._unsynced_since is None:
                self._unsynced_since = time.monotonic()  # the failed window is retried, not forgotten

    def _commit(self, batch: list) -> None:
        by_kind: dict[str, list] = {}
        for kind, row, _ in batch:
            by_kind.setdefault(kind, []).append(row)
        error = None
        try:
            self._insert(by_kind)
        except Exception as exc:  # every waiter learns the write failed: it answers 5xx, not 2xx
            log.exception("event commit failed")
            error = exc
        self._settle(batch, error)

    def _insert(self, by_kind: dict[str, list]) -> None:
        conn = self.engine.raw_connection()  # pooled, with the engine's pragmas
        try:
            cursor = conn.cursor()
            for kind, rows in by_kind.items():
                insert = self._inserts[kind]
                cursor.executemany(insert.sql, insert.params(rows))
            cursor.close()
            conn.commit()  # committed: in the WAL (sync=normal; checkpointed within fsync_s), on disk (full / PostgreSQL)
        except BaseException:
            conn.rollback()
            raise
        finally:
            conn.close()
        if self.fsync_s is not None and self._unsynced_since is None:
            self._unsynced_since = time.monotonic()
            self._wake.set()  # the writer thread starts the checkpoint window

    @staticmethod
    def _settle(batch: list, error: BaseException | None) -> None:
        by_loop: dict[Any, list[_Waiter]] = {}
        for _, _, w in batch:
            if isinstance(w, Future):
                if w.set_running_or_notify_cancel():  # False: its caller cancelled it; setting it would raise here
                    w.set_exception(error) if error is not None else w.set_result(None)
                continue
            w.error = w.error or error
            w.pending -= 1
            if w.pending == 0:
                by_loop.setdefault(w.loop, []).append(w)
        for loop, waiters in by_loop.items():
            try:
                loop.call_soon_threadsafe(_wake_waiters, waiters)
            except RuntimeError:  # that loop is closed: nobody waits for these any more
                pass

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=10)
        self._checkpoint()  # a write_now that passed its closed check while the thread finished
        # An event added while closing, after the thread's last drain, is refused, never left hanging.
        leftover = [self._items.popleft() for _ in range(len(self._items))]
        if leftover:
            self._settle(leftover, RuntimeError("event writer is closed"))
        self.engine.dispose()


class EventReader:
    """Reads for feedback checks and analysis."""

    def __init__(self, url: str):
        self.engine = engine_for(url)
        create_schema(self.engine)

    def exposure_exists(self, request_id: str) -> bool:
        with self.engine.connect() as conn:
            return conn.execute(sa.select(exposures.c.request_id).where(exposures.c.request_id == request_id)).first() is not None

    def outcome_exists(self, request_id: str, event: str) -> bool:
        with self.engine.connect() as conn:
            q = sa.select(outcomes.c.request_id).where(outcomes.c.request_id == request_id, outcomes.c.event == event)
            return conn.execute(q).first() is not None

    def frame(self, experiment: str, event: str = "click"):
        """Exposures of one experiment joined with the chosen outcome (pandas)."""
        import pandas as pd

        o = outcomes.alias("o")
        query = (sa.select(exposures.c.request_id, exposures.c.unit_id, exposures.c.arm, exposures.c.model_version, exposures.c.score,
                           exposures.c.status, exposures.c.latency_ms, exposures.c.layout, exposures.c.ts,
                           sa.func.coalesce(o.c.value, 0.0).label("outcome"))
                 .select_from(exposures.outerjoin(o, sa.and_(o.c.request_id == exposures.c.request_id, o.c.event == event)))
                 .where(exposures.c.experiment == experiment))
        with self.engine.connect() as conn:
            return pd.DataFrame(conn.execute(query).mappings().all(), columns=[c.name for c in query.selected_columns])

    def training_frame(self, experiment: str | None, since: float | None, until: float | None = None, event: str = "click"):
        """Exposures with their logged features and the time of their first `event` outcome, for retraining."""
        import pandas as pd

        q = (sa.select(exposures.c.request_id, exposures.c.experiment, exposures.c.arm, exposures.c.ts, exposures.c.features,
                       sa.func.min(outcomes.c.ts).label("outcome_ts"))
             .select_from(exposures.outerjoin(outcomes, sa.and_(outcomes.c.request_id == exposures.c.request_id, outcomes.c.event == event)))
             .where(exposures.c.status == "ok", exposures.c.features.is_not(None))
             .group_by(exposures.c.request_id, exposures.c.experiment, exposures.c.arm, exposures.c.ts, exposures.c.features))
        if experiment is not None:
            q = q.where(exposures.c.experiment == experiment)
        if since is not None:
            q = q.where(exposures.c.ts >= since)
        if until is not None:
            q = q.where(exposures.c.ts < until)
        with self.engine.connect() as conn:
            return pd.DataFrame(conn.execute(q).mappings().all(), columns=[c.name for c in q.selected_columns])

    def drift(self, experiment: str) -> dict[str, list[dict]]:
        """arm -> every replica's drift snapshot ({model_version, rows, counts})."""
        import json

        q = sa.select(drift_counts).where(drift_counts.c.experiment == experiment)
        out: dict[str, list[dict]] = {}
        with self.engine.connect() as conn:
            for row in conn.execute(q).mappings():
                out.setdefault(row["arm"], []).append({"model_version": row["model_version"], "rows": row["rows"],
                                                       "counts": json.loads(row["counts"]), "replica": row["replica"]})
        return out

    def counts(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            return {name: conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one() for name, t in TABLES.items()}

    def close(self) -> None:
        self.engine.dispose()


def upsert_drift(engine: sa.Engine, rows: list[dict]) -> None:
    """Replace these replicas' drift snapshots (one row per experiment, arm and replica)."""
    if not rows:
        return
    dialect = engine.dialect.name
    if dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:
        from sqlalchemy.dialects.postgresql import insert
    stmt = insert(drift_counts)
    stmt = stmt.on_conflict_do_update(index_elements=["experiment", "arm", "replica"],
                                      set_={c: stmt.excluded[c] for c in ("model_version", "rows", "counts", "ts")})
    with engine.begin() as conn:
        conn.execute(stmt, rows)
