"""The study searcher against a real SQLite Optuna study (no Ray cluster needed)."""

import optuna
from optuna.trial import TrialState

from rayload._study import StudySearcher, decode, encode, make_sampler, open_study
from rayload.search_spec import Param


def space():
    return {"lr": Param(loguniform=(1e-4, 1e-1)), "hidden": Param(choice=[[8], [16, 8]])}


def searcher(storage, create=True, total=4):
    study = open_study(storage, "s", "max", make_sampler("random", None, space(), 0, 3, False), create=create)
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
    a, b = first.suggest("a"), first.suggest("b")
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

    from rayload._study import read_study
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

    from rayload._study import SearchStopper
    from rayload.tuning import write_state

    high = SearchStopper("val_auc", "max", 0.8, None, 0.0)
    assert not high("t", {"val_auc": 0.79}) and not high.stop_all()
    assert not high("t", {"val_auc": float("nan")}) and not high("t", {"loss": 0.9})
    assert high("t", {"val_auc": 0.8}) and high.stop_all()
    low = SearchStopper("val_logloss", "min", 0.4, None, 0.0)
    assert not low("t", {"val_logloss": 0.41}) and low("t", {"val_logloss": 0.39})

    write_state(str(tmp_path), state="running")
    spent = SearchStopper("val_auc", "max", None, 30.0, 29.0, save=functools.partial(write_state, str(tmp_path)))  # a resumed search with 1 s left
    spent.SAVE_EVERY_S = 0.0
    assert not spent.stop_all() and spent.ended(None, budget=True) is None
    saved = json.load(open(tmp_path / "search.json"))["spent_s"]
    assert 29.0 <= saved < 30.0  # written as it goes, so a killed driver's time still counts
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
