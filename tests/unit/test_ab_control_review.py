"""A/B control-plane review fixes (2026-11-27), without Ray: set_weights refuses a champion that
is not an arm (it was saved while the router refused it); `rayload ab set-weights` refuses an
arm given twice; ramp steps must be strictly increasing; the power calculator names an input
out of range instead of dividing by zero, overflowing or answering a negative count."""

import math

import pytest
from typer.testing import CliRunner

from _ab_control import control_run, spec_of, user
from rayload import _cli_ab  # noqa: F401  (registers `rayload ab`)
from rayload.ab_spec import ab_from_dict
from rayload.cli import app
from rayload.errors import SpecError
from rayload.serve import control, power


def test_set_weights_refuses_an_unknown_champion_and_keeps_the_weights_in_force(tmp_path, monkeypatch):
    make = control_run(tmp_path, monkeypatch)
    run_dir = make(spec_of(0.95), None)
    before = user(run_dir)
    with pytest.raises(SpecError, match=r"champion: must be one of the arms \['A', 'B'\]"):
        control.set_weights(run_dir, {"A": 0.5, "B": 0.5}, champion="contrl")
    assert user(run_dir) == before and make.box["deployed"] == []
    assert control.load_state(run_dir)[1]["decisions"] == []


def test_set_weights_on_the_command_line_refuses_an_arm_given_twice_or_without_a_name(monkeypatch, tmp_path):
    applied = []
    monkeypatch.setattr(control, "set_weights", lambda run, weights: applied.append(weights) or {"weights": weights})
    monkeypatch.setattr(control, "load_state", lambda run: (str(tmp_path), {}))
    r = CliRunner().invoke(app, ["ab", "set-weights", str(tmp_path), "A=0.5", "B=0.5", "A=0.9", "B=0.1"])
    assert r.exit_code != 0 and "the arm 'A' is given twice (A=0.5 and A=0.9)" in r.output, r.output
    r = CliRunner().invoke(app, ["ab", "set-weights", str(tmp_path), "=0.5", "B=0.5"])
    assert r.exit_code != 0 and "'=0.5' is not arm=share" in r.output, r.output
    assert applied == []
    r = CliRunner().invoke(app, ["ab", "set-weights", str(tmp_path), "A=0.9", "B=0.1"])
    assert r.exit_code == 0 and applied == [{"A": 0.9, "B": 0.1}], r.output


def test_ramp_steps_given_twice_are_refused_and_the_grid_hint_is_a_legal_step():
    with pytest.raises(SpecError, match=r"ramp.steps: steps must be strictly increasing: 0.05 is given twice"):
        ab_from_dict({"name": "t", "arms": [{"name": "A", "weight": 0.95, "checkpoint": "/x"}, {"name": "B", "weight": 0.05, "checkpoint": "/y"}],
                      "drift": {"enabled": False}, "ramp": {"steps": [0.05, 0.05, 0.5]}})
    with pytest.raises(SpecError, match=r"for example 0\.0001"):  # was "for example 0.0", itself refused
        ab_from_dict({"name": "t", "arms": [{"name": "A", "weight": 0.95, "checkpoint": "/x"}, {"name": "B", "weight": 0.05, "checkpoint": "/y"}],
                      "drift": {"enabled": False}, "ramp": {"steps": [0.00005]}})


@pytest.mark.parametrize("call, name", [
    (lambda: power.sample_size(0.1, 0.0), "mde"),
    (lambda: power.sample_size(0.1, 0.01, alpha=0), "alpha"),
    (lambda: power.sample_size(0.1, 0.01, power=1), "power"),
    (lambda: power.sample_size(0.1, 0.01, alpha=1.5), "alpha"),
    (lambda: power.sample_size(1.5, 0.01), "p_base"),
    (lambda: power.sample_size(0.1, math.nan), "mde"),
    (lambda: power.msprt_sample_size(0.1, 0.01, tau=0), "tau"),
    (lambda: power.msprt_sample_size(0.1, 0.01, power=1), "power"),
    (lambda: power.minimum_detectable_effect(-5, 0.1), "n_total"),
    (lambda: power.msprt_mde(100, 0.1, alpha=0), "alpha"),
])
def test_the_power_calculator_names_an_input_out_of_range(call, name):
    with pytest.raises(ValueError, match=rf"^{name} "):
        call()


def test_a_base_rate_of_0_or_1_has_no_detectable_effect_to_report_instead_of_0_or_a_crash():
    for p in (0.0, 1.0):
        assert power.minimum_detectable_effect(1000, p) is None
        assert power.msprt_mde(1000, p) is None
    assert power.sample_size(0.1, 0.01) > 0 and 0 < power.minimum_detectable_effect(10_000, 0.1) < 0.05


def test_a_router_config_of_true_false_weights_or_a_final_decision_beside_split_traffic_is_refused(tmp_path, monkeypatch):
    """A hand-edited user_config's `true`/`false` weights were read as 1.0 / 0.0 (bool is an int
    to Python); a `final: promote` beside 50/50 weights was accepted and GET /experiment said
    "decided: promote" while traffic stayed split; weight keys 1 and "2" raised a TypeError
    (sorting) instead of naming the problem; set_weights(decision=...) took any weights."""
    from rayload.ab_spec import weight_issues
    from rayload.serve.router_config import config_issues

    issues = config_issues({"weights": {"1": True, "2": False}, "champion": "1"}, ["1", "2"])
    assert issues and "every weight must be a number >= 0" in issues[0]
    final = {"decision": "promote", "reason": "x", "time": 1.0}
    issues = config_issues({"weights": {"1": 0.5, "2": 0.5}, "champion": "1", "final": final}, ["1", "2"])
    assert issues == ["user_config.final: a promote gives the champion all traffic: weights {'1': 0.5, '2': 0.5} with champion '1'"]
    assert config_issues({"weights": {"1": 0.0, "2": 1.0}, "champion": "2", "final": final}, ["1", "2"]) == []
    assert [i.path for i in weight_issues({1: 0.9, "2": 0.1}, ["1", "2"], "1")] == ["arms"]
    make = control_run(tmp_path, monkeypatch)
    run_dir = make(spec_of(0.95), None)
    before = user(run_dir)
    with pytest.raises(SpecError, match="weights: a promote gives the champion all traffic"):
        control.set_weights(run_dir, {"A": 0.5, "B": 0.5}, champion="B", decision="promote")
    assert user(run_dir) == before and make.box["deployed"] == []


def test_serve_json_is_renamed_into_place_and_its_folder_synced(tmp_path, monkeypatch):
    """The temporary file was fsynced, the folder holding the rename was not: a power cut could
    bring back the previous serve.json (a recorded promote undone)."""
    import os
    import stat

    from rayload.serve.run_state import save_state

    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    save_state(str(tmp_path), {"config": {}})
    assert synced == [False, True] and (tmp_path / "serve.json").read_text().startswith("{")


def test_after_a_promote_the_analysis_keeps_the_roles_it_was_decided_in(tmp_path, monkeypatch):
    """A promote makes the winner the champion; analysed in those roles the lift was the
    loser's, so the report, the demo summary and decision.json showed "promote" beside a
    negative lift with champion and challenger swapped."""
    from _ab_control import events

    make = control_run(tmp_path, monkeypatch)
    run_dir = make(spec_of(0.5), events(20_000, {"A": 0.10, "B": 0.13}, {"A": 0.5, "B": 0.5}))
    before = control.analysis_for(run_dir)
    assert (before.champion, before.challenger) == ("A", "B") and before.lift > 0.15
    control.promote(run_dir, "by hand")
    assert user(run_dir)["champion"] == "B"
    after = control.analysis_for(run_dir)
    assert (after.decision, after.champion, after.challenger) == ("promote", "A", "B")
    assert after.lift == pytest.approx(before.lift) and after.diff == pytest.approx(before.diff)
    assert after.live_champion == "B" and after.to_dict()["live_champion"] == "B"  # who serves now, beside the decided roles
    from rayload._cli_ab import print_analysis
    from rayload.cli import console

    with console.capture() as out:
        print_analysis(after)
    assert "champion B, promoted over A" in " ".join(out.get().split())
    control.rollback(run_dir, "by hand")  # back to A: the roles are the champion's own again
    rolled = control.analysis_for(run_dir)
    assert (rolled.decision, rolled.champion, rolled.challenger, rolled.live_champion) == ("rollback", "A", "B", None)
    from rayload.serve.analysis import decided_champion  # what the router's GET /experiment uses with its user_config

    assert decided_champion(["A", "B"], "B", {"decision": "promote"}) == "A" and decided_champion(["A", "B"], "B", None) == "B"


def test_status_keeps_bracketed_figures_and_small_differences_show(tmp_path, monkeypatch):
    """Rich read "[nan, nan]" and "[n/a]" as style tags and dropped them (an arm with no
    exposures had a blank 95% CI; "lift +200% [n/a]" printed as "lift +200% "); a real
    difference of 0.004 points printed as +0.0000, in the promote reason too."""
    from _ab_control import events
    from rayload._cli_ab import print_analysis
    from rayload.cli import console
    from rayload.serve.analysis import points

    make = control_run(tmp_path, monkeypatch)
    run_dir = make(spec_of(0.95), events(400, {"A": 0.1, "B": 0.1}, {"A": 1.0, "B": 0.0}))
    with console.capture() as out:
        print_analysis(control.analysis_for(run_dir))
    text = out.get()
    assert "[n/a," in text and "n/a]" in text, text  # B's interval, wrapped in its narrow cell
    assert points(0.00004) == "+0.004 points" and points(0.0301, (0.02, 0.04)) == "+3.01 points [+2, +4]"
    assert points(float("nan")) == "n/a points"
