"""The A/B event store (SQLAlchemy Core): exposures, shadow scores, outcomes.

How events are written, and what a 2xx answer guarantees, is in serve/event_writer.py.

`request_id` is the primary key of an exposure; an outcome is keyed by (request_id, event),
so a repeated feedback call is a no-op. An exposure keeps the raw features of the row it
showed (JSON), which `rayload retrain` turns back into training rows. `ab_drift` holds each
replica's feature-drift counts (serve/drift.py) by period (serve/monitor.py; the period is part
of the `replica` key, `host:pid:id/period`), rewritten in place while the period lasts.

An exposure carries the `generation` of the experiment that served it: `rayload serve` starts
a new one when the experiment's name comes back with other models, salt, arms or shadow mode
(serve/control.py), and the analysis reads only the current generation's exposures, so a new
challenger is not judged on its predecessor's traffic. A shadow score carries its status (ok, or
error when the challenger failed) and the latency of its own call.

The schema carries its version in `ab_meta`; an older store is migrated forward in place
(version 1 -> 2: exposures.features and ab_drift were added; 2 -> 3: ab_drift.rows is a 64-bit
integer on PostgreSQL, where INTEGER stopped a replica's counts at 2**31 - 1; 3 -> 4:
exposures.generation, and ab_shadow.status and latency_ms; rows written before have no
generation, which the analysis of a run started before it reads as its own, and ok shadows;
4 -> 5: exposures.layout is text of any length on PostgreSQL, where VARCHAR(256) refused the
weights of many or long-named arms).
"""

from __future__ import annotations

import logging
import os
import time

import sqlalchemy as sa

log = logging.getLogger(__name__)
SCHEMA_VERSION = 5

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
    # the weights in force (JSON), for the SRM check; text since version 5: four arms with names of
    # the allowed 64 characters took 292 and PostgreSQL refused every exposure (a 503 per request)
    sa.Column("layout", sa.Text, nullable=False),
    sa.Column("ts", sa.Float, nullable=False),
    sa.Column("features", sa.Text),  # the shown row's raw features (JSON); null when logging them is off
    sa.Column("generation", sa.String(64)),  # the experiment's start that served it (serve/control.py); null before version 4
)
shadow_scores = sa.Table(
    "ab_shadow", metadata,
    sa.Column("request_id", sa.String(64), primary_key=True),
    sa.Column("arm", sa.String(64), primary_key=True),
    sa.Column("model_version", sa.String(128), nullable=False),
    sa.Column("score", sa.Float),
    sa.Column("ts", sa.Float, nullable=False),
    sa.Column("status", sa.String(16), nullable=False, server_default="ok"),  # ok | error (the challenger failed: score null)
    sa.Column("latency_ms", sa.Float),  # the challenger's own call; null before version 4
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
    sa.Column("rows", sa.BigInteger, nullable=False),  # requests a replica counted (serve/drift.py), past 2**31 in time
    sa.Column("counts", sa.Text, nullable=False),  # JSON: feature -> bin counts
    sa.Column("ts", sa.Float, nullable=False),
)
TABLES = {"exposure": exposures, "shadow": shadow_scores, "outcome": outcomes}


def default_url(run_dir: str) -> str:
    return f"sqlite:///{os.path.join(os.path.abspath(run_dir), 'events.db')}"


SYNC_MODES = ("normal", "full")


def engine_for(url: str, sync: str = "normal", busy_timeout_s: float = 30.0) -> sa.Engine:
    """An engine for the store; SQLite connections in WAL mode with `sync` (serve/event_writer.py:
    normal = committed in the WAL and fsynced by the next checkpoint, full = fsynced per commit),
    waiting up to `busy_timeout_s` for another connection's write lock (0: fail at once)."""
    if sync not in SYNC_MODES:
        raise ValueError(f"events.sync must be one of {SYNC_MODES}, got {sync!r}")
    if url.startswith("sqlite"):
        engine = sa.create_engine(url, connect_args={"timeout": busy_timeout_s})

        @sa.event.listens_for(engine, "connect")
        def _pragmas(connection, _record):
            cursor = connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA synchronous={sync.upper()}")
            cursor.close()

        return engine
    return sa.create_engine(url, pool_pre_ping=True, connect_args=pg_connect_args(url))


PG_CONNECT_TIMEOUT_S = 10


def pg_connect_args(url: str) -> dict:
    """libpq settings for a PostgreSQL store (events, search studies). A server that stops
    answering (frozen, or a network partition without a reset) held every request as long as TCP
    does, minutes: libpq gives up on connecting, on unacknowledged sends and on a silent idle
    connection within these; the URL's own query settings win."""
    given = sa.engine.make_url(url).query
    defaults = {"connect_timeout": PG_CONNECT_TIMEOUT_S, "keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10,
                "keepalives_count": 3, "tcp_user_timeout": PG_CONNECT_TIMEOUT_S * 3000}
    return {k: v for k, v in defaults.items() if k not in given}


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
    inspector = sa.inspect(conn)
    columns = {c["name"] for c in inspector.get_columns("ab_exposures")}
    if version < 2 and "features" not in columns:
        conn.execute(sa.text("ALTER TABLE ab_exposures ADD COLUMN features TEXT"))
    if version < 3 and conn.dialect.name == "postgresql":  # SQLite's INTEGER holds 64 bits already
        rows = next(c for c in sa.inspect(conn).get_columns("ab_drift") if c["name"] == "rows")
        if not isinstance(rows["type"], sa.BigInteger):
            conn.execute(sa.text('ALTER TABLE ab_drift ALTER COLUMN "rows" TYPE BIGINT'))
    if version < 4:  # create_all made these where the table itself is new
        if "generation" not in columns:
            conn.execute(sa.text("ALTER TABLE ab_exposures ADD COLUMN generation VARCHAR(64)"))
        shadow = {c["name"] for c in inspector.get_columns("ab_shadow")}
        if "status" not in shadow:
            conn.execute(sa.text("ALTER TABLE ab_shadow ADD COLUMN status VARCHAR(16) DEFAULT 'ok' NOT NULL"))
        if "latency_ms" not in shadow:
            conn.execute(sa.text("ALTER TABLE ab_shadow ADD COLUMN latency_ms FLOAT"))
    if version < 5 and conn.dialect.name == "postgresql":  # SQLite keeps text of any length in a VARCHAR(256)
        layout = next(c for c in sa.inspect(conn).get_columns("ab_exposures") if c["name"] == "layout")
        if not isinstance(layout["type"], sa.Text):
            conn.execute(sa.text("ALTER TABLE ab_exposures ALTER COLUMN layout TYPE TEXT"))
    conn.execute(meta.update().where(meta.c.key == "schema_version").values(value=str(SCHEMA_VERSION)))
    log.info("event store migrated from schema version %d to %d", version, SCHEMA_VERSION)


def insert_or_ignore(dialect: str, table: sa.Table):
    """INSERT that skips rows whose primary key exists (idempotent feedback, retried writes).

    One exception, for outcomes: a stored value of 0 or less counts as no outcome (analysis and
    retraining), so a later positive one for the same request and event replaces it (value and
    time) instead of being dropped as a repeat; the statement's rowcount is then 1, as for a new
    row. A stored positive outcome is never replaced."""
    if dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    elif dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:  # pragma: no cover - the store supports SQLite and PostgreSQL
        raise ValueError(f"unsupported event store dialect {dialect}")
    stmt = insert(table)
    if table is outcomes:  # literal zeros: the writer runs the compiled SQL with the columns' parameters only
        zero = sa.literal_column("0")
        return stmt.on_conflict_do_update(index_elements=[outcomes.c.request_id, outcomes.c.event],
                                          set_={"value": stmt.excluded.value, "ts": stmt.excluded.ts},
                                          where=sa.and_(outcomes.c.value <= zero, stmt.excluded.value > zero))
    return stmt.on_conflict_do_nothing()


def _insert_ignore(conn, table: sa.Table, rows: list[dict]) -> None:
    if rows:
        conn.execute(insert_or_ignore(conn.dialect.name, table), rows)


def _in_window(q, experiment: str | None, since: float | None, until: float | None, generation: str | None):
    """`q` narrowed to one experiment's exposures (None: all), of one generation (None: all), with
    since <= ts < until (None: open)."""
    if experiment is not None:
        q = q.where(exposures.c.experiment == experiment)
    if generation is not None:
        q = q.where(exposures.c.generation == generation)
    if since is not None:
        q = q.where(exposures.c.ts >= since)
    if until is not None:
        q = q.where(exposures.c.ts < until)
    return q


class EventReader:
    """Reads for feedback checks and analysis."""

    def __init__(self, url: str, must_exist: bool = False):
        """`must_exist`: a store that is not there is an error naming it (a retrain read a missing
        SQLite file as a new, empty store, created it, and asked for a wider --window)."""
        if must_exist and url.startswith("sqlite:///"):
            path = url[len("sqlite:///"):].split("?")[0]
            if path and path != ":memory:" and not os.path.exists(path):
                from ..errors import RayloadError

                raise RayloadError(f"the event store {path} does not exist (was the A/B run folder moved or deleted?)")
        self.engine = engine_for(url)
        create_schema(self.engine)

    def exposure_exists(self, request_id: str) -> bool:
        with self.engine.connect() as conn:
            return conn.execute(sa.select(exposures.c.request_id).where(exposures.c.request_id == request_id)).first() is not None

    def frame(self, experiment: str, event: str = "click", generation: str | None = None):
        """Exposures of one experiment joined with the chosen outcome (pandas); with
        `generation`, only those its current start served (None: all, as before generations)."""
        import pandas as pd

        o = outcomes.alias("o")
        query = (sa.select(exposures.c.request_id, exposures.c.unit_id, exposures.c.arm, exposures.c.model_version, exposures.c.score,
                           exposures.c.status, exposures.c.latency_ms, exposures.c.layout, exposures.c.ts,
                           sa.func.coalesce(o.c.value, 0.0).label("outcome"))
                 .select_from(exposures.outerjoin(o, sa.and_(o.c.request_id == exposures.c.request_id, o.c.event == event)))
                 .where(exposures.c.experiment == experiment))
        if generation is not None:
            query = query.where(exposures.c.generation == generation)
        # one order for rows of one time (a batch's exposures share its ts): the sequential test's
        # looks cut the rows in time order, and without it a look could hold other rows next time
        query = query.order_by(exposures.c.ts, exposures.c.request_id)
        with self.engine.connect() as conn:
            return pd.DataFrame(conn.execute(query).mappings().all(), columns=[c.name for c in query.selected_columns])

    def shadow_summary(self, experiment: str, generation: str | None = None) -> dict[str, dict]:
        """Per shadow arm: the requests it scored beside the champion's exposures, how many of
        them failed (status error), and that share. Empty when nothing ran in shadow."""
        s = shadow_scores
        q = (sa.select(s.c.arm, s.c.status, sa.func.count().label("n"))
             .select_from(s.join(exposures, exposures.c.request_id == s.c.request_id))
             .where(exposures.c.experiment == experiment).group_by(s.c.arm, s.c.status))
        if generation is not None:
            q = q.where(exposures.c.generation == generation)
        out: dict[str, dict] = {}
        with self.engine.connect() as conn:
            for arm, status, n in conn.execute(q):
                arm_out = out.setdefault(arm, {"requests": 0, "errors": 0})
                arm_out["requests"] += n
                arm_out["errors"] += n if status != "ok" else 0
        for arm_out in out.values():
            arm_out["error_rate"] = arm_out["errors"] / arm_out["requests"]
        return out

    def training_frame(self, experiment: str | None, since: float | None, until: float | None = None, event: str = "click",
                       generation: str | None = None):
        """Exposures with their logged features and the time of their first `event` outcome, for retraining.

        Only an outcome with a value > 0 counts (outcome_ts stays null otherwise): the A/B
        analysis counts a click as outcome > 0, so a feedback call with value 0 (or less) is
        no click to the retrained model either. `generation`: only the exposures of that start of
        the experiment, as its analysis reads them (None: all, as before generations); an earlier
        generation served other models, and its rows reached the retrain and its gate."""
        import pandas as pd

        clicked = sa.and_(outcomes.c.request_id == exposures.c.request_id, outcomes.c.event == event, outcomes.c.value > 0)
        q = (sa.select(exposures.c.request_id, exposures.c.experiment, exposures.c.arm, exposures.c.ts, exposures.c.features,
                       sa.func.min(outcomes.c.ts).label("outcome_ts"))
             .select_from(exposures.outerjoin(outcomes, clicked))
             .where(exposures.c.status == "ok", exposures.c.features.is_not(None))
             .group_by(exposures.c.request_id, exposures.c.experiment, exposures.c.arm, exposures.c.ts, exposures.c.features))
        q = _in_window(q, experiment, since, until, generation)
        with self.engine.connect() as conn:
            return pd.DataFrame(conn.execute(q).mappings().all(), columns=[c.name for c in q.selected_columns])

    def unlogged_count(self, experiment: str, since: float | None, until: float | None, generation: str | None = None) -> int:
        """Ok exposures in the window whose features were not logged (events.log_features off):
        training_frame leaves them out, and a retrain says how many."""
        q = sa.select(sa.func.count()).select_from(exposures).where(exposures.c.status == "ok", exposures.c.features.is_(None))
        q = _in_window(q, experiment, since, until, generation)
        with self.engine.connect() as conn:
            return int(conn.execute(q).scalar_one())

    def drift(self, experiment: str) -> dict[str, list[dict]]:
        """arm -> every replica's drift snapshot ({model_version, rows, counts})."""
        import json

        q = sa.select(drift_counts).where(drift_counts.c.experiment == experiment)
        out: dict[str, list[dict]] = {}
        with self.engine.connect() as conn:
            for row in conn.execute(q).mappings():
                out.setdefault(row["arm"], []).append({"model_version": row["model_version"], "rows": row["rows"],
                                                       "counts": json.loads(row["counts"]), "replica": row["replica"],
                                                       "ts": row["ts"]})
        return out

    def counts(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            return {name: conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one() for name, t in TABLES.items()}

    def close(self) -> None:
        self.engine.dispose()


def prune_drift(engine: sa.Engine, experiment: str, before: float) -> int:
    """Delete an experiment's drift rows last written before `before` (periods past any window)."""
    with engine.begin() as conn:
        return conn.execute(drift_counts.delete().where(drift_counts.c.experiment == experiment,
                                                        drift_counts.c.ts < before)).rowcount


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
