"""The automatic controller without Ray: decisions are final, ramp steps are gated on the units
each step saw, shadow mode holds the ramp, and two controllers never act on the same state."""

import threading

import pandas as pd
import pytest

from _ab_control import control_run, events, spec_of, user
from rayload.errors import SpecError
from rayload.serve import control


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A run folder as `control.start` leaves it; deploying records the configs instead."""
    return control_run(tmp_path, monkeypatch)


def test_after_a_rollback_by_hand_or_by_the_controller_later_looks_change_nothing(run):
    run_dir = run(spec_of(), events(20_000, {"A": 0.1, "B": 0.1}, {"A": 0.95, "B": 0.05}))
    assert control.step(run_dir)[0] == "continue" and user(run_dir)["weights"]["B"] == 0.25  # enough units at 5%: ramp
    control.rollback(run_dir)
    for _ in range(3):
        decision, reasons = control.step(run_dir)
        assert decision == "rollback" and "automatic steps have stopped" in reasons[0]
    assert user(run_dir)["weights"] == {"A": 1.0, "B": 0.0}
    assert control.analysis_for(run_dir).decision == "rollback"
    # The router learns of it through its user_config (GET /experiment reports the final decision)
    final = run.box["deployed"][-1]["final"]
    assert user(run_dir)["final"] == final and (final["decision"], final["reason"]) == ("rollback", "by hand")
    assert control.analysis_for(run_dir).reasons == control.step(run_dir)[1]
    control.set_weights(run_dir, {"A": 0.95, "B": 0.05})  # a new ramp by hand starts the controller again
    assert run.box["deployed"][-1]["final"] is None and user(run_dir)["final"] is None
    assert control.step(run_dir)[0] == "continue"


def test_an_automatic_promotion_is_final_and_not_undone_by_the_swapped_roles(run):
    run_dir = run(spec_of(0.5), events(20_000, {"A": 0.10, "B": 0.13}, {"A": 0.5, "B": 0.5}))
    assert control.step(run_dir)[0] == "promote"
    assert user(run_dir)["champion"] == "B" and user(run_dir)["weights"] == {"A": 0.0, "B": 1.0}
    assert user(run_dir)["final"]["decision"] == "promote"  # for the router's GET /experiment
    assert [control.step(run_dir)[0] for _ in range(3)] == ["promote"] * 3
    _, state = control.load_state(run_dir)
    assert [d["decision"] for d in state["decisions"]] == ["promote"] and user(run_dir)["champion"] == "B"


def test_a_promote_made_again_changes_nothing_and_a_rollback_after_it_restores_the_original_champion(run):
    run_dir = run(spec_of(0.5), events(20_000, {"A": 0.10, "B": 0.13}, {"A": 0.5, "B": 0.5}))
    assert control.step(run_dir)[0] == "promote"  # the controller promotes B ...
    deployed = len(run.box["deployed"])
    for _ in range(2):  # ... and the operator confirms it by hand, then retries
        out = control.promote(run_dir)
        assert out["champion"] == "B" and out["weights"] == {"A": 0.0, "B": 1.0}
    _, state = control.load_state(run_dir)
    assert [d["decision"] for d in state["decisions"]] == ["promote"] and len(run.box["deployed"]) == deployed
    out = control.rollback(run_dir)  # undoes the promote: the experiment's champion A gets it all back
    assert out["champion"] == "A" and out["weights"] == {"A": 1.0, "B": 0.0} and user(run_dir) == out
    assert control.rollback(run_dir) == out
    out = control.promote(run_dir)  # and a promote after that rollback is B's again
    assert out["champion"] == "B" and out["weights"] == {"A": 0.0, "B": 1.0}
    _, state = control.load_state(run_dir)
    assert [(d["decision"], d["champion"]) for d in state["decisions"]] == [("promote", "B"), ("rollback", "A"), ("promote", "B")]


def test_two_controllers_looking_at_once_decide_once(run, monkeypatch):
    """The first controller to decide holds its deploy until the other one provably overlaps
    it: waiting at the lock, or (were there no lock) having read the state the first is about
    to change. With the lock the second then reads the first's decision and deploys nothing."""
    import fcntl

    run_dir = run(spec_of(0.5), events(20_000, {"A": 0.10, "B": 0.13}, {"A": 0.5, "B": 0.5}))
    deployed = run.box["deployed"]
    seen = threading.Condition()
    at_lock, reads, overlapped = set(), {"c1": 0, "c2": 0}, []
    real_flock, real_load = fcntl.flock, control.load_state

    def me() -> str:
        return threading.current_thread().name

    def flock(f, op):  # who is waiting for the lock right now
        if op == fcntl.LOCK_EX:
            with seen:
                at_lock.add(me())
                seen.notify_all()
        real_flock(f, op)
        if op == fcntl.LOCK_EX:
            with seen:
                at_lock.discard(me())

    def load_state(run):  # step reads twice: the second read is the one it decides on
        out = real_load(run)
        if me() in reads:
            with seen:
                reads[me()] += 1
                seen.notify_all()
        return out

    def redeploy(config, address):
        other = "c2" if me() == "c1" else "c1"
        with seen:
            overlapped.append(seen.wait_for(lambda: other in at_lock or reads[other] >= 2, timeout=30))
        deployed.append(me())

    monkeypatch.setattr(fcntl, "flock", flock)
    monkeypatch.setattr(control, "load_state", load_state)
    monkeypatch.setattr(control, "_redeploy", redeploy)
    out = []
    threads = [threading.Thread(target=lambda: out.append(control.step(run_dir)[0]), name=n) for n in ("c1", "c2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlapped == [True]  # the one deploy ran while the other controller was at the lock
    _, state = real_load(run_dir)
    assert out == ["promote", "promote"] and len(deployed) == 1
    assert [d["decision"] for d in state["decisions"]] == ["promote"] and user(run_dir)["champion"] == "B"


def test_each_ramp_step_waits_for_its_own_units(run):
    # The spec starts at 2%, not a ramp step: the first look goes to 5%, and the next only
    # after min_units_per_step new challenger units came in at 5%.
    frame = events(30_000, {"A": 0.1, "B": 0.1}, {"A": 0.98, "B": 0.02})
    run_dir = run(spec_of(0.98), frame)
    assert (frame["arm"] == "B").sum() >= 500
    control.step(run_dir)
    assert user(run_dir)["weights"]["B"] == 0.05
    for _ in range(2):  # no new traffic between looks
        control.step(run_dir)
        assert user(run_dir)["weights"]["B"] == 0.05
    more = events(12_000, {"A": 0.1, "B": 0.1}, {"A": 0.95, "B": 0.05}, seed=1, start=30_000)
    run.box["frame"] = pd.concat([frame, more], ignore_index=True)
    assert (more["arm"] == "B").sum() >= 500
    control.step(run_dir)
    assert user(run_dir)["weights"]["B"] == 0.25


def test_shadow_mode_holds_the_ramp_and_refuses_live_challenger_traffic(run):
    run_dir = run(spec_of(1.0, shadow=True), events(5_000, {"A": 0.1, "B": 0.1}, {"A": 1.0, "B": 0.0}))
    decision, reasons = control.step(run_dir)
    assert decision == "continue" and any("shadow mode" in r for r in reasons)
    with pytest.raises(SpecError, match="weights.B: in shadow mode"):
        control.set_weights(run_dir, {"A": 0.9, "B": 0.1})
    assert user(run_dir)["weights"] == {"A": 1.0, "B": 0.0} and run.box["deployed"] == []


def test_a_challenger_that_starts_at_0_percent_goes_to_the_first_ramp_step_at_once(run):
    run_dir = run(spec_of(1.0), events(3_000, {"A": 0.1, "B": 0.1}, {"A": 1.0, "B": 0.0}))
    decision, reasons = control.step(run_dir)
    assert decision == "continue" and user(run_dir)["weights"] == {"A": 0.95, "B": 0.05}, reasons
    assert any("first step, 5%" in r for r in reasons)
    _, state = control.load_state(run_dir)
    assert [d["decision"] for d in state["decisions"]] == ["ramp"]
    # 0% set by hand later is a pause: the controller leaves it there
    control.set_weights(run_dir, {"A": 1.0, "B": 0.0})
    for _ in range(2):
        decision, reasons = control.step(run_dir)
        assert user(run_dir)["weights"] == {"A": 1.0, "B": 0.0}
    assert any("set by hand" in r for r in reasons), reasons


def test_a_ramp_step_waits_until_the_challengers_guardrails_can_be_judged(run):
    # min_units_per_step 50 < guardrails.min_requests 200: 60 challenger units are enough units
    # for the step but too few requests to judge its errors and latency.
    spec = spec_of(0.95, ramp={"min_units_per_step": 50}, guardrails={"min_requests": 200})
    frame = events(1_200, {"A": 0.1, "B": 0.1}, {"A": 0.95, "B": 0.05})
    run_dir = run(spec, frame)
    assert 50 <= (frame["arm"] == "B").sum() < 200
    decision, reasons = control.step(run_dir)
    assert user(run_dir)["weights"]["B"] == 0.05 and any("guardrails can be judged" in r for r in reasons), reasons
    run.box["frame"] = pd.concat([frame, events(4_000, {"A": 0.1, "B": 0.1}, {"A": 0.95, "B": 0.05}, seed=1, start=1_200)], ignore_index=True)
    control.step(run_dir)
    assert user(run_dir)["weights"]["B"] == 0.25


def test_restarting_the_same_experiment_keeps_its_promote_and_decision_log(run, monkeypatch):
    import types

    import ray

    import rayload._ray

    run_dir = run(spec_of(0.5), events(20_000, {"A": 0.10, "B": 0.13}, {"A": 0.5, "B": 0.5}))
    args = control.parts(control.load_state(run_dir)[1]["config"])[0]
    deployed = []
    monkeypatch.setattr(rayload._ray, "ensure_ray", lambda *a, **k: None)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(gcs_address="127.0.0.1:1"))
    monkeypatch.setattr(control, "resolve_checkpoints", lambda spec, address=None: {})
    monkeypatch.setattr(control, "app_args", lambda spec, checkpoints, run_dir: dict(args, spec=spec.model_dump(mode="json"),
                                                                                      salt=spec.experiment_salt))
    monkeypatch.setattr(control, "deploy", lambda config: deployed.append(control.parts(config)[1]))
    monkeypatch.setattr(control, "ingress_urls", lambda serving, app, **k: ["http://127.0.0.1:8000"])
    monkeypatch.setattr(control, "check_direct_ingress", lambda serving: None)
    control.start(spec_of(0.5), run_dir=run_dir)  # the first start: the spec's weights
    assert deployed[-1]["weights"] == {"A": 0.5, "B": 0.5}
    control.promote(run_dir)
    _, before = control.load_state(run_dir)
    control.start(spec_of(0.5), run_dir=run_dir)  # `rayload serve SPEC` again
    _, after = control.load_state(run_dir)
    assert deployed[-1]["weights"] == {"A": 0.0, "B": 1.0} and deployed[-1]["champion"] == "B"
    assert deployed[-1]["final"]["decision"] == "promote" and user(run_dir) == deployed[-1]
    assert after["decisions"] == before["decisions"] and after["final"] == before["final"]
    assert control.step(run_dir)[0] == "promote" and len(control.load_state(run_dir)[1]["decisions"]) == 1
    monkeypatch.setattr(control, "app_args", lambda spec, checkpoints, run_dir: dict(args, checkpoints={"A": "/x", "B": "/new"},
                                                                                      spec=spec.model_dump(mode="json")))
    control.start(spec_of(0.5), run_dir=run_dir)  # other models under the same name: a new experiment
    assert deployed[-1]["weights"] == {"A": 0.5, "B": 0.5} and control.load_state(run_dir)[1]["decisions"] == []
