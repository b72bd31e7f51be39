"""The study searcher against a real SQLite Optuna study (no Ray cluster needed)."""

import os
import socket

import optuna
from optuna.trial import TrialState

from rayload._study import StudySearcher, decode, encode, make_sampler
from rayload._study_store import open_study
from rayload.search_spec import Param


def space():
    return {"lr": Param(loguniform=(1e-4, 1e-1)), "hidden": Param(choice=[[8], [16, 8]])}


def searcher(storage, create=True, total=4):
    study = open_study(storage, "s", "max", lambda held: make_sampler("random", None, space(), 0, 3, False, held), create=create)
    return StudySearcher(study, space(), total, "val_auc", "max")


def test_lists_travel_as_json():
    assert decode(encode([16, 8])) == [16, 8] and encode(3) == 3 and decode("plain") == "plain"


def test_tells_best_value_prunes_stopped_and_fails_errors(tmp_path):
    s = searcher(f"sqlite:///{tmp_path}/s.db")
    configs = [s.suggest(f"t{i}") for i in range(3)]
    assert [c["number"] for c in configs] == [0, 1, 2] and configs[0]["params"]["hidden"] in ([8], [16, 8])
    for epoch, auc in enumerate([0.6, 0.7, 0.65], start=1):
        s.on_trial_result("t0", {"val_auc": auc, "epochs_done": epoch})
    s.on_trial_complete("t0", {"val_auc": 0.65, "epochs_done": 3})
    s.on_trial_result("t1", {"val_auc": 0.5, "epochs_done": 1})
    s.stopped_early.add("t1")
    s.on_trial_complete("t1", {"val_auc": 0.5, "epochs_done": 1})
    s.on_trial_complete("t2", None, error=True)
    trials = s.study.get_trials()
    assert trials[0].state == TrialState.COMPLETE and trials[0].value == 0.7  # the best epoch, as its checkpoint
    assert trials[0].intermediate_values == {1: 0.6, 2: 0.7, 3: 0.65}
    assert trials[1].state == TrialState.PRUNED and trials[1].user_attrs["rayload"]["epochs_done"] == 1
    assert trials[2].state == TrialState.FAIL


def test_resume_reattaches_running_trials_then_asks_only_what_is_missing(tmp_path):
    storage = f"sqlite:///{tmp_path}/s.db"
    first = searcher(storage)
    _, b = first.suggest("a"), first.suggest("b")
    first.on_trial_complete("a", {"val_auc": 0.7, "epochs_done": 2})
    # the driver dies here: trial b is still RUNNING in the study
    again = searcher(storage, create=False)
    assert again.remaining() == 3
    resumed = again.suggest("x")
    assert resumed == b  # same number and parameters: it continues in its own folder
    assert again.suggest("y")["number"] == 2 and again.suggest("z")["number"] == 3
    assert again.suggest("w") == again.FINISHED
    assert len(optuna.load_study(study_name="s", storage=storage).trials) == 4


def test_read_study_never_creates_a_database_tables_or_a_study(tmp_path):
    import os

    import pytest

    from rayload._study_store import read_study
    from rayload.errors import RayloadError

    missing = tmp_path / "gone.db"
    with pytest.raises(RayloadError, match=f"the study database {missing} does not exist"):
        read_study(f"sqlite:///{missing}", "s")
    assert not missing.exists()
    empty = tmp_path / "empty.db"
    empty.touch()
    with pytest.raises(RayloadError, match="cannot read the study 's'"):
        read_study(f"sqlite:///{empty}", "s")
    assert os.path.getsize(empty) == 0  # no optuna tables were created
    s = searcher(f"sqlite:///{tmp_path}/s.db")
    s.suggest("t0")
    s.on_trial_complete("t0", {"val_auc": 0.6, "epochs_done": 1})
    with pytest.raises(RayloadError, match="no study named 'other'"):
        read_study(f"sqlite:///{tmp_path}/s.db", "other")
    assert [st.study_name for st in optuna.get_all_study_summaries(f"sqlite:///{tmp_path}/s.db")] == ["s"]
    assert read_study(f"sqlite:///{tmp_path}/s.db", "s").trials[0].value == 0.6


def test_study_errors_mask_the_database_password_and_say_why_it_cannot_be_read():
    """Study URLs went into errors as given (terminals, CI logs) and an unreachable PostgreSQL
    read "invalid data in the commit, e.g. exceeding max length" (optuna's wrapper), not the cause."""
    import pytest

    from rayload._study_store import StudyExistsError, read_study
    from rayload.errors import RayloadError

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"postgresql://alice:s3cretPW@127.0.0.1:{port}/studies"
    assert "s3cretPW" not in str(StudyExistsError("x", url)) and "alice:***@" in str(StudyExistsError("x", url))
    with pytest.raises(RayloadError) as info:
        read_study(url, "x")
    message = str(info.value)
    assert "s3cretPW" not in message and "alice:***@127.0.0.1" in message
    assert "OperationalError" in message and "refused" in message and "invalid data" not in message
    # libpq also reads a password from the query; psycopg passes it on, and it was shown as given
    with pytest.raises(RayloadError) as info:
        read_study(f"postgresql://127.0.0.1:{port}/studies?user=alice&password=s3cretPW", "x")
    assert "s3cretPW" not in str(info.value) and "password=***" in str(info.value)


def test_cut_off_records_running_trials_pruned_with_their_best_so_far_and_why(tmp_path):
    s = searcher(f"sqlite:///{tmp_path}/s.db")
    for tid in ("t0", "t1", "t2"):
        s.suggest(tid)
    for epoch, auc in enumerate([0.6, 0.7, 0.65], start=1):
        s.on_trial_result("t0", {"val_auc": auc, "epochs_done": epoch, "checkpoint": f"/c/{epoch}"})
    s.on_trial_complete("t1", {"val_auc": 0.55, "epochs_done": 1})
    # t0 has results, t2 none: the search ends (its budget spent) while both run
    assert s.cut_off("time budget of 10 s spent") == 2
    t0, t1, t2 = s.study.get_trials()
    assert t0.state == TrialState.PRUNED
    assert t0.user_attrs["rayload"] == {"epochs_done": 3, "best_value": 0.7, "checkpoint": "/c/2", "stopped": "time budget of 10 s spent"}
    assert t1.state == TrialState.COMPLETE and t1.value == 0.55  # finished before: untouched
    assert t2.state == TrialState.PRUNED and t2.user_attrs["rayload"]["best_value"] is None
    assert s.cut_off("again") == 0 and not s.live


def test_cut_off_after_a_killed_driver_uses_the_studys_intermediate_values(tmp_path):
    storage = f"sqlite:///{tmp_path}/s.db"
    first = searcher(storage)
    first.suggest("a")
    first.on_trial_result("a", {"val_auc": 0.62, "epochs_done": 1})
    first.on_trial_result("a", {"val_auc": 0.58, "epochs_done": 2})
    again = searcher(storage, create=False)  # resumed with nothing left to do: never re-attached
    assert again.cut_off("target val_auc >= 0.6 reached") == 1
    (t,) = again.study.get_trials()
    assert t.state == TrialState.PRUNED and t.user_attrs["rayload"]["best_value"] == 0.62
    assert t.user_attrs["rayload"]["epochs_done"] == 2


def test_search_stopper_target_both_modes_and_the_budget_across_attempts(tmp_path):
    import functools
    import json

    import pytest

    from rayload._study import SearchStopper
    from rayload.tuning import write_state

    high = SearchStopper("val_auc", "max", 0.8, None, 0.0)
    assert not high("t", {"val_auc": 0.79}) and not high.stop_all()
    assert not high("t", {"val_auc": float("nan")}) and not high("t", {"loss": 0.9})
    assert high("t", {"val_auc": 0.8}) and high.stop_all()
    low = SearchStopper("val_logloss", "min", 0.4, None, 0.0)
    assert not low("t", {"val_logloss": 0.41}) and low("t", {"val_logloss": 0.39})

    write_state(str(tmp_path), state="running")
    now = [1000.0]  # the stopper's clock, advanced by hand: no real time passes
    spent = SearchStopper("val_auc", "max", None, 30.0, 29.0, save=functools.partial(write_state, str(tmp_path)),
                          clock=lambda: now[0])  # a resumed search with 1 s left
    spent.SAVE_EVERY_S = 0.0
    now[0] += 0.5
    assert not spent.stop_all() and spent.ended(None, budget=True) is None
    saved = json.load(open(tmp_path / "search.json"))["spent_s"]
    assert saved == pytest.approx(29.5)  # written as it goes, so a killed driver's time still counts
    now[0] += 1.0
    assert spent.stop_all() and spent.budget_hit and spent.ended(None, budget=True) == "time budget of 30 s spent"
    assert json.load(open(tmp_path / "search.json"))["spent_s"] == pytest.approx(30.5)
    gone = SearchStopper("val_auc", "max", None, 30.0, 30.5)
    assert gone.stop_all() and gone.budget_hit
    assert gone.ended(None, budget=True) == "time budget of 30 s spent"
    assert gone.ended(None, budget=False) is None  # after a run whose trials ran out first


def test_search_stopper_sees_a_target_reached_in_an_earlier_attempt(tmp_path):
    from rayload._study import SearchStopper

    s = searcher(f"sqlite:///{tmp_path}/s.db")
    s.suggest("a")
    s.on_trial_result("a", {"val_auc": 0.83, "epochs_done": 1})
    stopper = SearchStopper("val_auc", "max", 0.82, None, 0.0)
    assert stopper.ended(s.study, budget=True) == "target val_auc >= 0.82 reached"
    assert SearchStopper("val_auc", "max", 0.9, None, 0.0).ended(s.study, budget=True) is None


def test_a_resumed_search_does_not_propose_its_finished_trials_again(tmp_path):
    """Random search, and TPE in its start-up trials, draw from the sampler's seeded sequence:
    a resumed sampler seeded as the first run would hand out the same parameters again."""
    storage = f"sqlite:///{tmp_path}/s.db"
    for strategy in ("random", "bayes"):
        name = f"s-{strategy}"

        def open_(create):
            study = open_study(storage, name, "max", lambda held: make_sampler(strategy, "tpe" if strategy == "bayes" else None,
                                                                               space(), 0, 5, False, held), create=create)
            return StudySearcher(study, space(), 6, "val_auc", "max")

        first = open_(True)
        for i in range(3):
            first.suggest(f"a{i}")
            first.on_trial_complete(f"a{i}", {"val_auc": 0.5 + i / 10, "epochs_done": 1})
        again = open_(False)
        proposed = [again.suggest(f"b{i}")["params"]["lr"] for i in range(3)]
        done = [t.params["lr"] for t in again.study.get_trials()[:3]]
        assert not set(proposed) & set(done), strategy


def test_a_reattached_trial_keeps_the_best_epoch_it_reported_before_the_stop(tmp_path):
    storage = f"sqlite:///{tmp_path}/s.db"
    first = searcher(storage, total=1)
    first.suggest("a")
    first.on_trial_result("a", {"val_auc": 0.90, "epochs_done": 1, "checkpoint": "trial_0000/epoch_0000"})
    first.on_trial_result("a", {"val_auc": 0.80, "epochs_done": 2, "checkpoint": "trial_0000/epoch_0001"})
    # the driver is killed; the resumed trial restores epoch 2 and trains epoch 3
    again = searcher(storage, create=False, total=1)
    again.suggest("b")
    again.on_trial_result("b", {"val_auc": 0.80, "epochs_done": 2, "checkpoint": "trial_0000/epoch_0001"})  # re-reported
    again.on_trial_complete("b", {"val_auc": 0.85, "epochs_done": 3, "checkpoint": "trial_0000/epoch_0002"})
    (t,) = again.study.get_trials()
    assert t.state == TrialState.COMPLETE and t.value == 0.90
    assert t.intermediate_values == {1: 0.90, 2: 0.80, 3: 0.85}
    assert t.user_attrs["rayload"]["checkpoint"] == "trial_0000/epoch_0000" and t.user_attrs["rayload"]["best_value"] == 0.90
    # a trial killed after its last epoch re-reports only that epoch: still its best is kept
    first = searcher(f"sqlite:///{tmp_path}/t.db", total=1)
    first.suggest("a")
    first.on_trial_result("a", {"val_auc": 0.7, "epochs_done": 1, "checkpoint": "c0"})
    first.on_trial_result("a", {"val_auc": 0.6, "epochs_done": 2, "checkpoint": "c1"})
    again = searcher(f"sqlite:///{tmp_path}/t.db", create=False, total=1)
    again.suggest("b")
    again.on_trial_complete("b", {"val_auc": 0.6, "epochs_done": 2, "checkpoint": "c1"})
    (t,) = again.study.get_trials()
    assert t.value == 0.7 and t.user_attrs["rayload"]["checkpoint"] == "c0"


def test_a_new_search_on_a_storage_holding_its_study_is_refused_before_anything_runs(tmp_path, monkeypatch):
    import json

    import pytest

    from rayload._study_store import StudyExistsError
    from rayload.search_spec import SearchSpec
    from rayload.tuning import _check_new_study, status

    storage = f"sqlite:///{tmp_path}/shared.db"
    searcher(storage)  # a study called "s"
    spec = SearchSpec.model_validate({"name": "s", "base": "x.yaml", "space": {"train.lr": {"uniform": [0.001, 0.01]}}, "storage": storage})
    with pytest.raises(StudyExistsError, match="a study named 's' already exists .* --resume RUN"):
        _check_new_study(spec)
    _check_new_study(spec.model_copy(update={"name": "other"}))  # another name: fine
    _check_new_study(spec.model_copy(update={"storage": f"sqlite:///{tmp_path}/new.db"}))
    assert not (tmp_path / "new.db").exists()  # looking never creates the database
    with pytest.raises(StudyExistsError):  # and the race: created in between
        open_study(storage, "s", "max", lambda held: make_sampler("random", None, space(), 0, 3, False, held), create=True)
    # a search still preparing its data (no study yet) has a status
    run = tmp_path / "run"
    run.mkdir()
    (run / "search.json").write_text(json.dumps({"state": "preparing", "pid": os.getpid(), "host": socket.gethostname(),
                                                 "storage": f"sqlite:///{run}/study.db", "study": "s", "total": 4,
                                                 "metric": "val_auc", "mode": "max"}))
    got = status(str(run))
    assert got["state"] == "preparing" and got["trials"] == []


def test_numpy_and_other_real_metrics_count_and_a_bad_objective_result_is_named(tmp_path):
    """A metric reported as numpy float32 (or any real but bool) is a result: it used to be
    skipped, so every trial ended with no value and was told FAIL."""
    import numpy as np
    import pytest

    from rayload._study import SearchStopper
    from rayload.errors import RayloadError
    from rayload.tuning import function_result

    s = searcher(f"sqlite:///{tmp_path}/s.db")
    s.suggest("t0")
    s.on_trial_result("t0", {"val_auc": np.float32(0.75), "epochs_done": np.int64(1)})
    s.on_trial_complete("t0", {"val_auc": np.float64(0.5), "epochs_done": 2})
    trial = s.study.get_trials()[0]
    assert trial.state == TrialState.COMPLETE and trial.value == 0.75 and type(s.study.best_value) is float
    s.suggest("t1")
    s.on_trial_complete("t1", {"val_auc": True, "epochs_done": 1})  # a bool is no metric
    assert s.study.get_trials()[1].state == TrialState.FAIL
    assert SearchStopper("val_auc", "max", 0.7, None, 0.0).meets(np.float32(0.75))
    assert not SearchStopper("val_auc", "max", 0.7, None, 0.0).meets(True)

    out = function_result({"value": np.float32(0.5), "other": 1}, "value")
    assert out == {"value": 0.5, "other": 1} and type(out["value"]) is float
    assert function_result(np.float32(2.5), "value") == {"value": 2.5}
    with pytest.raises(RayloadError, match="without the metric 'value' \\(keys: other\\)"):
        function_result({"other": 1.0}, "value")
    with pytest.raises(RayloadError, match="'value' is 'high' \\(str\\), not a real number"):
        function_result({"value": "high"}, "value")


OPENER = """
import os, sys, time
import optuna
from rayload._study_store import open_study
open(sys.argv[2] + "." + str(os.getpid()), "w").close()  # imported: ready
while not os.path.exists(sys.argv[2]):  # every driver waits for the others, then all create at once
    time.sleep(0.001)
open_study(sys.argv[1], sys.argv[3], "max", lambda held: optuna.samplers.RandomSampler(), create=True)
print("created")
"""


def test_searches_starting_together_on_a_fresh_postgresql_database_all_create_their_study(tmp_path):
    """optuna creates its tables on first use, and PostgreSQL's CREATE TABLE races: of four
    searches started at once on a new database, three failed ("duplicate key value violates
    unique constraint pg_type_typname_nsp_index") before the tables were made under a lock."""
    import subprocess
    import sys
    import time

    from helpers import pg_database

    with pg_database("rl_study_race") as url:
        go = tmp_path / "go"
        procs = [subprocess.Popen([sys.executable, "-c", OPENER, url, str(go), f"search-{i}"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for i in range(4)]
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("go.*"))) < 4 and time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.01)
        go.touch()
        outs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0] * 4, [err[-1500:] for _, err in outs]
        storage = optuna.storages.RDBStorage(url, skip_table_creation=True)
        assert sorted(s.study_name for s in storage.get_all_studies()) == [f"search-{i}" for i in range(4)]
        storage.engine.dispose()


def test_a_resumed_grid_search_runs_every_grid_point_exactly_once(tmp_path):
    """The resumed sampler was reseeded like a random one: GridSampler shuffles its points by the
    seed and the study knows finished ones only by index, so a resume after 4 of 8 points ran
    finished points again and never ran three others."""
    space = {"a": Param(grid=[1, 2, 3, 4]), "b": Param(grid=["x", "y"])}
    storage = f"sqlite:///{tmp_path}/g.db"

    def searcher(create: bool) -> StudySearcher:
        study = open_study(storage, "g", "min", lambda held: make_sampler("grid", None, space, 0, 3, False, held), create=create)
        return StudySearcher(study, space, 8, "loss", "min")

    first = searcher(True)
    for i in range(4):  # the driver dies after 4 of the 8 points
        first.suggest(f"t{i}")
        first.on_trial_complete(f"t{i}", {"loss": 1.0, "epochs_done": 1})
    resumed, i = searcher(False), 0
    while resumed.suggest(f"u{i}") != resumed.FINISHED:
        resumed.on_trial_complete(f"u{i}", {"loss": 1.0, "epochs_done": 1})
        i += 1
    points = [(t.params["a"], t.params["b"]) for t in resumed.study.get_trials()]
    assert sorted(points) == [(a, b) for a in (1, 2, 3, 4) for b in "xy"]


def test_a_trial_that_ends_itself_on_an_asha_rung_is_complete_not_pruned():
    """train.early_stopping ended a trial at epoch 3, a rung of ASHA (max_t 9, grace 1, factor 3):
    its last result passed through ASHA, which said STOP below the cutoff, and the trial was told
    PRUNED, so the trial with the best value lost to a worse complete one."""
    from types import SimpleNamespace

    from rayload._study import stopping_asha
    from rayload._tune_report import best_row, trial_rows

    space = {"x": Param(uniform=(0.0, 1.0))}
    study = open_study(None, "s", "max", lambda held: make_sampler("random", None, space, 0, 5, False, held), create=True)
    searcher = StudySearcher(study, space, 10, "val_auc", "max")
    asha = stopping_asha(searcher, "epochs_done", 9, metric="val_auc", mode="max", grace_period=1, reduction_factor=3)
    trials = {t: SimpleNamespace(trial_id=t) for t in "AC"}
    for t in trials.values():
        searcher.suggest(t.trial_id)
        asha.on_trial_add(None, t)

    def result(tid, epoch, auc, early=False):
        r = {"val_auc": auc, "epochs_done": epoch, "early_stopped": early}
        decision = asha.on_trial_result(None, trials[tid], r)
        if decision == "STOP" or early:  # Tune completes the trial with its last result
            searcher.on_trial_complete(tid, r)
        else:
            searcher.on_trial_result(tid, r)
        return decision

    for epoch in range(1, 10):
        result("A", epoch, 0.70 + epoch / 300)
    result("C", 1, 0.75)
    result("C", 2, 0.72)
    assert result("C", 3, 0.60, early=True) == "STOP"  # ASHA's verdict on the rung; the trial had ended itself
    states = {t.number: t.state for t in study.get_trials()}
    assert states == {0: TrialState.COMPLETE, 1: TrialState.COMPLETE}
    assert best_row(trial_rows(study))["number"] == 1 and best_row(trial_rows(study))["value"] == 0.75
    # a trial ASHA stops below max_t that did not end itself is still pruned
    searcher.suggest("D")
    asha.on_trial_add(None, SimpleNamespace(trial_id="D"))
    trials["D"] = SimpleNamespace(trial_id="D")
    assert result("D", 1, 0.50) == "STOP"
    assert study.get_trials()[-1].state == TrialState.PRUNED


def test_a_trial_killed_before_its_values_were_stored_gets_them_when_re_attached(tmp_path):
    """A driver SIGKILLed inside study.ask left a RUNNING trial with no values (seen in the e2e
    kill-and-resume test): re-attached, it trained the base job's values and counted among the
    N searched trials."""
    storage = f"sqlite:///{tmp_path}/s.db"
    first = searcher(storage)
    first.study.ask()  # created, killed before any value was stored
    resumed = searcher(storage, create=False)
    config = resumed.suggest("t0")
    assert config["number"] == 0 and set(config["params"]) == {"lr", "hidden"}
    assert set(resumed.study.trials[0].params) == {"lr", "hidden"}  # stored in the study too
