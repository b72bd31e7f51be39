"""Where a search's Optuna study lives: created, loaded for a resume, or only read (`rayload tune
status`), on SQLite in WAL mode or on PostgreSQL (optuna's tables made under a lock).
The searcher that drives the study through Ray Tune is in _study.py."""

from __future__ import annotations

import os
from typing import Any, Callable

import optuna

from .errors import RayloadError
from .paths import shown_url


OWNER = "rayload_run"  # the study's user attribute naming the search run (search.json's run_uid) that made it


def open_study(storage: str | None, name: str, mode: str, sampler: Callable[[int], Any], create: bool,
               owner: str | None = None) -> optuna.Study:
    """Create the study, or (`create=False`) load it. `sampler(n)` makes the sampler, given the
    number of trials the study already holds (0 for a new one). `owner`: the search run's id,
    recorded on a new study and checked on a loaded one: a run whose driver lost the race for
    its study's name must not drive the other run's study on a resume."""
    direction = "maximize" if mode == "max" else "minimize"
    url = storage
    if create:
        storage = _storage(url)
        try:
            study = optuna.create_study(storage=storage, study_name=name, direction=direction, sampler=sampler(0), load_if_exists=False)
        except optuna.exceptions.DuplicatedStudyError:
            raise StudyExistsError(name, url) from None
        if owner:
            study.set_user_attr(OWNER, owner)
        return study
    study = read_study(url, name)  # a missing database or study is a RayloadError naming it, and creates nothing
    made_by = study.user_attrs.get(OWNER)
    if owner and made_by and made_by != owner:
        raise RayloadError(f"the study {name!r} in {shown_url(url)} was made by another search run; this run cannot continue it "
                           "(its own driver lost the race for the name): start a new search")
    study = optuna.load_study(storage=_storage(url), study_name=name, sampler=optuna.samplers.RandomSampler())
    study.sampler = sampler(len(study.get_trials(deepcopy=False)))
    return study


class StudyExistsError(RayloadError):
    def __init__(self, name: str, url: str | None):
        super().__init__(f"a study named {name!r} already exists in {shown_url(url)}: `rayload tune --resume RUN` continues the search "
                         "that made it; a new search needs another `name` or `storage`")


def study_exists(url: str, name: str) -> bool:
    """Whether `url` holds a study called `name`, without creating the database file."""
    if url.startswith("sqlite:///") and not os.path.exists(url[len("sqlite:///"):].split("?")[0]):
        return False
    try:
        storage = optuna.storages.RDBStorage(url, skip_table_creation=True)
        return any(s.study_name == name for s in storage.get_all_studies())
    except Exception:  # no optuna tables yet (or unreachable: create_study says so with its own error)
        return False


def read_study(url: str, name: str) -> optuna.Study:
    """Open a study only to look at it (`rayload tune status`): never creates a database file,
    optuna's tables or the study, so a status call on a moved run cannot leave an empty study
    behind; each missing piece is a RayloadError naming it."""
    import sqlalchemy.exc

    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///"):].split("?")[0]
        if not os.path.exists(path):
            raise RayloadError(f"the study database {path} does not exist (was the run folder moved or deleted?)")
    try:
        storage = optuna.storages.RDBStorage(url, skip_table_creation=True)
        return optuna.load_study(storage=storage, study_name=name)
    except KeyError:
        raise RayloadError(f"no study named {name!r} in {shown_url(url)}") from None
    except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as e:
        # optuna wraps an unreachable database in "invalid data in the commit": its cause says what happened
        cause = e.__cause__ if isinstance(e, optuna.exceptions.StorageInternalError) and e.__cause__ is not None else e
        detail = (str(cause).splitlines() or [""])[0].replace(url, shown_url(url))
        raise RayloadError(f"cannot read the study {name!r} from {shown_url(url)}: {type(cause).__name__}: {detail}") from None


def _storage(url: str | None):
    """SQLite in WAL mode with synchronous=NORMAL: every commit survives a killed driver
    (only an OS crash could lose the last commits), at a fraction of the fsync cost of the
    default journal; the searcher commits several times per trial. PostgreSQL: see _postgres."""
    if url is not None and url.startswith("postgresql"):
        return _postgres(url)
    if url is None or not url.startswith("sqlite:"):
        return url
    import sqlalchemy

    storage = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 30}})

    @sqlalchemy.event.listens_for(storage.engine, "connect")
    def _pragmas(connection, _record):
        cursor = connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    storage.engine.dispose()  # connections opened before the listener get the pragmas too
    return storage


_TABLES_LOCK = 0x7261796C6F6174  # PostgreSQL advisory lock key for creating optuna's tables


def _postgres(url: str):
    """optuna's RDBStorage creates its tables on first use, and PostgreSQL's CREATE TABLE races:
    of four searches started at once on a fresh database three failed with `duplicate key value
    violates unique constraint "pg_type_typname_nsp_index"`. The storage is made holding an
    advisory lock, so one process creates the tables and the others find them."""
    import sqlalchemy

    from .serve.events import pg_connect_args  # a server that stops answering is given up on, as the event store's

    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool, connect_args=pg_connect_args(url))
    try:
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), {"key": _TABLES_LOCK})
            try:
                return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": pg_connect_args(url)})
            finally:
                conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:key)"), {"key": _TABLES_LOCK})
    finally:
        engine.dispose()
