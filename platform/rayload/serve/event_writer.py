"""The event writer: how exposures, shadow scores and outcomes reach the store (serve/events.py).

Guarantee: a 2xx answer from the router means its event is committed to the database before
the answer leaves. With SQLite (WAL mode) the default `events.sync: normal` commits without an
fsync per commit: a committed transaction is in the WAL file, in the operating system's
buffers, so a replica killed with SIGKILL (or a crashed interpreter) loses no acknowledged
event; within `events.fsync_s` of a commit (default 1 s) the writer thread fsyncs the WAL (a
synchronous=FULL commit of one row, then a checkpoint), so a machine crash or power cut loses
at most that much acknowledged traffic. `events.sync: full` fsyncs every commit instead
(synchronous=FULL). PostgreSQL commits as the server is configured. A request in flight when
its replica dies got no answer and may or may not be recorded.

Two write paths share that guarantee. In combined mode the router commits a batch's exposures
in the replica's own thread right after the batch's model calls (`write_now`, SQLite only: a
local commit of a few dozen rows takes ~0.1 ms with the GIL released inside SQLite), so an
answer never waits for another thread to wake. That commit never waits for SQLite's write lock:
the replica's event loop runs it, and while another connection holds the lock (another replica
on the same file, the writer thread's fsync commit) a waiting commit would stall every request
and health check of the replica. It tries the lock once and, when the database is busy, commits
nothing and hands the events to the writer thread, which waits for the lock off the loop.
Everything else (outcomes, shadow scores, error
exposures, separate mode, PostgreSQL, whose commit is a network round trip) goes through the
writer thread's group commit: it commits everything that arrived within `flush_ms` of the
group's first event (in transactions of at most `max_batch` rows), so the commit cost is
shared; what arrives while a commit runs forms the next group.

A shared commit must not let one request's bad row cost the others theirs. The router refuses
values the store cannot keep (422), and as a second line: when a commit fails on a row
(`is_row_error`), the writer thread commits the group's requests one by one and the router
sends an inline batch that failed so through it, so only the request that brought the row
fails; a request's own events (the ones it awaits together) stay one transaction.

Shadow scores are outside that guarantee: the champion's answer does not wait for a shadow
challenger (serve/app.py), which scores the request afterwards and writes its row through the
writer thread then, so a replica killed in between loses that shadow row (never an answered
exposure).

An outcome's insert reports whether it stored a new row (`write` returns how many): the
router answers a repeated feedback call `duplicate: true` from that, so two concurrent calls
for one request_id cannot both read "absent" before either inserts.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sqlite3
import threading
import time
from concurrent.futures import Future
from typing import Any

import sqlalchemy as sa

from .events import TABLES, insert_or_ignore, create_schema, engine_for

log = logging.getLogger(__name__)


class _DriverInsert:
    """One table's INSERT OR IGNORE compiled once for the engine's dialect and run through the
    DB-API cursor: the writer's hot path skips SQLAlchemy's per-execution work (about 0.1 ms of
    the replica's GIL per commit here, benchmarks/RESULTS.md). A missing column is its server
    default where it has one (ab_shadow.status), else NULL; an unknown column is an error, as it is in SQLAlchemy."""

    def __init__(self, engine: sa.Engine, table: sa.Table):
        columns = [c.name for c in table.columns]
        compiled = insert_or_ignore(engine.dialect.name, table).compile(dialect=engine.dialect, column_keys=columns)
        self.sql, self.positional = str(compiled), compiled.positiontup is not None
        self.columns = list(compiled.positiontup) if self.positional else columns  # positional: the SQL's own order
        self.known = frozenset(columns)
        self.table = table.name
        # A column left out of a row gets its server default, as it would left out of an INSERT
        self.defaults = {c.name: c.server_default.arg for c in table.columns if c.server_default is not None}

    def params(self, rows: list[dict]) -> list:
        for row in rows:
            if not row.keys() <= self.known:
                raise ValueError(f"unknown column(s) {sorted(row.keys() - self.known)} for {self.table}")
        if self.defaults:
            rows = [{**self.defaults, **row} for row in rows]
        if self.positional:
            return [tuple(map(row.get, self.columns)) for row in rows]
        return [{c: row.get(c) for c in self.columns} for row in rows]


class _Waiter:
    """An event loop waiting for a group of events (one request's, written together)."""

    __slots__ = ("loop", "future", "pending", "error", "inserted")

    def __init__(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future, pending: int):
        self.loop, self.future, self.pending, self.error, self.inserted = loop, future, pending, None, None


COUNTED = frozenset({"outcome"})  # kinds whose inserts report whether the row was new (feedback's `duplicate`)


def _by_kind(events) -> dict[str, list]:
    """(kind, row) pairs as rows per table kind, for one transaction."""
    out: dict[str, list] = {}
    for kind, row in events:
        out.setdefault(kind, []).append(row)
    return out


def is_row_error(exc: BaseException) -> bool:
    """Whether a failed insert failed on the rows themselves (a value the driver cannot bind,
    such as a string with a lone surrogate; a NULL in a NOT NULL column; a string over a
    PostgreSQL column's length) rather than on the database (locked, gone, full). DB-API
    modules each define their own IntegrityError and DataError, so they are matched by name."""
    if isinstance(exc, (ValueError, TypeError, sqlite3.ProgrammingError)):  # UnicodeEncodeError; an unbindable type
        return True
    return any(cls.__name__ in ("IntegrityError", "DataError") for cls in type(exc).__mro__)


def _by_waiter(batch: list) -> list[list]:
    """A batch's items grouped by who waits for them (one request's exposure and shadow scores
    together), in order."""
    groups: dict[int, list] = {}
    for item in batch:
        groups.setdefault(id(item[2]), []).append(item)
    return list(groups.values())


def _wake_waiters(waiters: list[_Waiter]) -> None:
    for w in waiters:  # runs on the waiters' event loop
        if not w.future.done():
            w.future.set_exception(w.error) if w.error is not None else w.future.set_result(w.inserted)


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
        # write_now's own connections fail at once on a locked database instead of waiting (see above)
        self._inline_engine = engine_for(url, sync, busy_timeout_s=0) if self.inline else None
        self.fsync_s = fsync_s if self.inline and sync == "normal" else None
        self._unsynced_since: float | None = None  # monotonic time of the first commit not yet checkpointed
        self._inserts = {kind: _DriverInsert(self.engine, table) for kind, table in TABLES.items()}
        self._items: collections.deque = collections.deque()  # (kind, row, Future | _Waiter); append/popleft are atomic
        self._wake = threading.Event()
        self._closing = threading.Event()  # set by close(): ends the flush window early
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="rayload-events", daemon=True)
        self._thread.start()

    def submit(self, kind: str, row: dict[str, Any]) -> Future:
        fut: Future = Future()
        self._enqueue([(kind, row, fut)], fut)
        return fut

    async def write(self, *events: tuple[str, dict[str, Any]]) -> int | None:
        """Returns once every event is committed: how many of its outcomes were new rows (a
        repeated request_id and event is not inserted again), None when it held no outcome.
        Raises what the commit raised."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop, loop.create_future(), len(events))
        self._enqueue([(kind, row, waiter) for kind, row in events], waiter)
        return await waiter.future

    def write_now(self, events: list[tuple[str, dict[str, Any]]]) -> bool:
        """Insert and commit `events` in the calling thread (SQLite only: `inline`) without
        waiting for the write lock. True: they are committed. False: another connection held the
        lock, nothing was written, and the caller writes them through `write` (the writer
        thread, which waits). Raises what a commit raised for any other reason. Safe beside the
        writer thread: each uses its own pooled connection and SQLite serialises the commits."""
        if self._closed:
            raise RuntimeError("event writer is closed")
        if not events:
            return True
        try:
            self._insert(_by_kind(events), self._inline_engine)
        except (sqlite3.OperationalError, sa.exc.OperationalError) as exc:  # the latter: opening a pooled connection
            if "locked" in str(exc) or "busy" in str(exc):  # SQLITE_BUSY / SQLITE_LOCKED: rolled back, nothing written
                return False
            raise
        return True

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
                if not self._closed:  # what arrives within the window shares the commit; close() ends the wait
                    self._closing.wait(self.flush_s)  # (a sleep of flush_ms up to 60 s outlasted close's join, which refused the events)
                while self._items:
                    self._commit(self._next_batch())
            if self._closed:
                self._checkpoint()
                return
            # Checked after every drain too: under steady traffic through this thread the flag is
            # set again before each wait, and a sync run only on a timed-out wait would never come.
            since = self._unsynced_since
            if since is not None and time.monotonic() >= since + self.fsync_s:
                self._checkpoint()

    def _next_batch(self) -> list:
        """Up to max_batch queued items, and then the rest of the last one's waiter: a request's
        events (a serve batch's exposures handed over at once) stay one transaction. Cut at
        max_batch alone, one part of a group committed and the other could fail, and every
        request of it was told to retry although some of its exposures were stored."""
        batch = [self._items.popleft() for _ in range(min(self.max_batch, len(self._items)))]
        while self._items and self._items[0][2] is batch[-1][2]:
            batch.append(self._items.popleft())
        return batch

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
        error, new = None, []
        try:
            self._insert(_by_kind((kind, row) for kind, row, _ in batch), new=new)
        except Exception as exc:  # every waiter learns the write failed: it answers 5xx, not 2xx
            if is_row_error(exc) and len(_by_waiter(batch)) > 1:
                # One bad row rolled back everyone's: each waiter's rows again in their own
                # transaction, so only the request that brought the bad row fails.
                log.warning("a group commit failed on a bad row (%r); committing its requests one by one", exc)
                for part in _by_waiter(batch):
                    self._commit(part)
                return
            log.exception("event commit failed")
            error = exc
        if error is None and new:  # the outcomes' rowcounts, in the batch's order of outcomes
            for (_, _, w), inserted in zip((item for item in batch if item[0] in COUNTED), new):
                if isinstance(w, _Waiter):
                    w.inserted = (w.inserted or 0) + inserted
        self._settle(batch, error)

    def _insert(self, by_kind: dict[str, list], engine: sa.Engine | None = None, new: list | None = None) -> None:
        """Insert and commit; `new` (a list) gets each COUNTED row's rowcount: 1 stored, 0 already there."""
        conn = (engine or self.engine).raw_connection()  # pooled, with the engine's pragmas
        try:
            cursor = conn.cursor()
            for kind, rows in by_kind.items():
                insert = self._inserts[kind]
                if new is not None and kind in COUNTED:  # one by one: executemany sums the rowcounts
                    for params in insert.params(rows):
                        cursor.execute(insert.sql, params)
                        new.append(cursor.rowcount)
                else:
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
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout=10)
        self._checkpoint()  # a write_now that passed its closed check while the thread finished
        # An event added while closing, after the thread's last drain, is refused, never left hanging.
        leftover = [self._items.popleft() for _ in range(len(self._items))]
        if leftover:
            self._settle(leftover, RuntimeError("event writer is closed"))
        self.engine.dispose()
        if self._inline_engine is not None:
            self._inline_engine.dispose()
