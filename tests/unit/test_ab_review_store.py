"""The event store on real SQLite and PostgreSQL: a version-3 store is migrated to version 4
(exposures.generation, ab_shadow.status and latency_ms) with its rows kept; the analysis reads
one generation; an outcome's insert says whether it was new, also for concurrent repeats."""

import asyncio
import time

import pytest
import sqlalchemy as sa
from helpers import pg_database

from rayload.serve.event_writer import EventWriter
from rayload.serve.events import EventReader


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'events.db'}"
        return
    with pg_database("rayload_abrev") as url:
        yield url


def exposure(i: int, generation=None) -> dict:
    return {"request_id": f"r{i}", "experiment": "e", "unit_id": f"u{i}", "arm": "a", "model_version": "v", "score": 0.5,
            "status": "ok", "latency_ms": 1.0, "layout": "{}", "ts": time.time(), "generation": generation}


def test_a_version_3_store_is_migrated_to_4_and_keeps_its_rows(url):
    engine = sa.create_engine(url)
    with engine.begin() as conn:  # the version-3 layout of the tables version 4 changed
        conn.execute(sa.text("CREATE TABLE ab_meta (key VARCHAR(64) PRIMARY KEY, value TEXT)"))
        conn.execute(sa.text("INSERT INTO ab_meta VALUES ('schema_version', '3')"))
        conn.execute(sa.text("CREATE TABLE ab_exposures (request_id VARCHAR(64) PRIMARY KEY, experiment VARCHAR(128) NOT NULL, "
                             "unit_id VARCHAR(256) NOT NULL, arm VARCHAR(64) NOT NULL, model_version VARCHAR(128) NOT NULL, score FLOAT, "
                             "status VARCHAR(16) NOT NULL, latency_ms FLOAT NOT NULL, layout VARCHAR(256) NOT NULL, ts FLOAT NOT NULL, "
                             "features TEXT)"))
        conn.execute(sa.text("CREATE TABLE ab_shadow (request_id VARCHAR(64), arm VARCHAR(64), model_version VARCHAR(128) NOT NULL, "
                             "score FLOAT, ts FLOAT NOT NULL, PRIMARY KEY (request_id, arm))"))
        conn.execute(sa.text("INSERT INTO ab_exposures VALUES ('old', 'e', 'u', 'a', 'v', 0.5, 'ok', 1.0, '{}', 1.0, NULL)"))
        conn.execute(sa.text("INSERT INTO ab_shadow VALUES ('old', 'b', 'v2', 0.4, 1.0)"))
    reader = EventReader(url)  # opening it migrates it
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT value FROM ab_meta WHERE key = 'schema_version'")).scalar_one() == "4"
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
