"""A/B controller lifecycle review fixes (2026-11-27), without Ray: a serve.json from before
`final` and `ramp_step` keeps its promote and its ramp step over a restart; a restart holds the
state lock (a decision taken meanwhile was overwritten); a config Serve took whose app did not
come up is recorded; a promote by hand after one in swapped roles promotes; a damaged serve.json
is named; the report of an empty experiment says n/a."""

import threading
import types

import pytest

from _ab_control import control_run, events, spec_of, user
from rayload.errors import RayloadError
from rayload.serve import control
from rayload.serve.serve_config import NotRunningError


@pytest.fixture
def run(tmp_path, monkeypatch):
    return control_run(tmp_path, monkeypatch)


@pytest.fixture
def restartable(run, monkeypatch):
    """control.start without Ray: the first start's app args again, a deploy that records."""
    import ray

    import rayload._ray

    def make(spec, frame):
        run_dir = run(spec, frame)
        args = control.parts(control.load_state(run_dir)[1]["config"])[0]
        monkeypatch.setattr(rayload._ray, "ensure_ray", lambda *a, **k: None)
        monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(gcs_address="127.0.0.1:1"))
        monkeypatch.setattr(control, "resolve_checkpoints", lambda spec, address=None: {})
        monkeypatch.setattr(control, "app_args", lambda spec, checkpoints, run_dir: dict(args, spec=spec.model_dump(mode="json"),
                                                                                          salt=spec.experiment_salt))
        monkeypatch.setattr(control, "ingress_urls", lambda serving, app, **k: ["http://127.0.0.1:8000"])
        monkeypatch.setattr(control, "check_direct_ingress", lambda serving: None)
        return run_dir

    return make


def _as_older_version(run_dir, weights, decisions):
    """serve.json as a version before `final` and `ramp_step` wrote it."""
    _, state = control.load_state(run_dir)
    control.parts(state["config"])[1].update(weights=weights, champion=decisions[-1]["champion"] if decisions else "A")
    state["decisions"] = decisions
    for key in ("final", "ramp_step"):
        state.pop(key, None)
    control.save_state(run_dir, state)


def test_an_older_serve_json_keeps_its_promote_and_its_ramp_step_over_a_restart(restartable, monkeypatch):
    deployed = []
    monkeypatch.setattr(control, "deploy", lambda config: deployed.append(control.parts(config)[1]))
    run_dir = restartable(spec_of(0.5), events(3_000, {"A": 0.1, "B": 0.13}, {"A": 0.0, "B": 1.0}))
    control.start(spec_of(0.5), run_dir=run_dir)  # the first start
    _as_older_version(run_dir, {"A": 0.0, "B": 1.0}, [{"time": 1.0, "decision": "promote", "weights": {"A": 0.0, "B": 1.0},
                                                      "champion": "B", "reason": "by hand"}])
    control.start(spec_of(0.5), run_dir=run_dir)
    assert control.load_state(run_dir)[1]["final"]["decision"] == "promote"
    control.step(run_dir)
    assert user(run_dir)["weights"] == {"A": 0.0, "B": 1.0}  # was ramped back to 5% for the demoted arm
    # a ramp at 25% (no ramp_step): the next step waits for the units of this step, counted from now
    run_dir = restartable(spec_of(0.95), events(20_000, {"A": 0.1, "B": 0.1}, {"A": 0.75, "B": 0.25}))
    control.start(spec_of(0.95), run_dir=run_dir)
    _as_older_version(run_dir, {"A": 0.75, "B": 0.25}, [])
    control.start(spec_of(0.95), run_dir=run_dir)
    assert control.load_state(run_dir)[1]["ramp_step"] == {"weights": {"A": 0.75, "B": 0.25}, "units": None}


def test_a_restart_holds_the_state_lock_so_a_decision_taken_meanwhile_stays(restartable, monkeypatch):
    run_dir = restartable(spec_of(0.5), events(20_000, {"A": 0.10, "B": 0.13}, {"A": 0.5, "B": 0.5}))
    in_deploy, release = threading.Event(), threading.Event()

    def slow_deploy(config):
        in_deploy.set()
        release.wait(10)

    monkeypatch.setattr(control, "deploy", slow_deploy)
    restart = threading.Thread(target=lambda: control.start(spec_of(0.5), run_dir=run_dir))
    restart.start()
    assert in_deploy.wait(10)
    looked = []
    controller = threading.Thread(target=lambda: looked.append(control.step(run_dir)[0]))
    controller.start()
    controller.join(1.0)
    assert controller.is_alive()  # it waits for the restart to finish with serve.json
    release.set()
    restart.join(10)
    controller.join(10)
    _, state = control.load_state(run_dir)
    assert looked == ["promote"] and state["final"]["decision"] == "promote" and user(run_dir)["weights"] == {"A": 0.0, "B": 1.0}


def test_a_config_serve_took_whose_app_did_not_come_up_is_recorded(run, monkeypatch):
    run_dir = run(spec_of(0.75), events(2_000, {"A": 0.1, "B": 0.1}, {"A": 0.75, "B": 0.25}))

    def not_running(config, address):
        raise NotRunningError("the A/B app t was not running after 300 s (B: UNHEALTHY)")

    monkeypatch.setattr(control, "_redeploy", not_running)
    with pytest.raises(NotRunningError):
        control.rollback(run_dir)
    _, state = control.load_state(run_dir)
    assert state["final"]["decision"] == "rollback" and user(run_dir)["weights"] == {"A": 1.0, "B": 0.0}


def test_a_promote_by_hand_after_one_in_swapped_roles_promotes_the_challenger(run):
    run_dir = run(spec_of(0.5), events(100, {"A": 0.1, "B": 0.1}, {"A": 0.5, "B": 0.5}))
    control.promote(run_dir)  # B takes all
    control.set_weights(run_dir, {"A": 0.5, "B": 0.5}, champion="B")  # a new ramp, B champion
    control.set_weights(run_dir, {"A": 1.0, "B": 0.0}, champion="A", decision="promote", reason="controller")  # A wins back
    control.promote(run_dir)  # in the experiment's own roles: B
    assert user(run_dir)["weights"] == {"A": 0.0, "B": 1.0} and user(run_dir)["champion"] == "B"
    before = control.load_state(run_dir)[1]["decisions"]
    control.promote(run_dir)  # the same again: nothing changes
    assert control.load_state(run_dir)[1]["decisions"] == before


def test_a_damaged_serve_json_is_named_and_an_empty_experiments_report_says_n_a(tmp_path):
    (tmp_path / "serve.json").write_text('{"config": {"applications": [')
    with pytest.raises(RayloadError, match=r"serve.json is damaged"):
        control.load_state(str(tmp_path))
    import pandas as pd

    from rayload.serve.analysis import analyze
    from rayload.serve.report import render

    frame = pd.DataFrame(columns=["request_id", "unit_id", "arm", "model_version", "score", "status", "latency_ms", "layout", "ts", "outcome"])
    page = render(analyze(frame, spec_of(0.5), {"A": 0.5, "B": 0.5}, "A"))
    assert "nan" not in page and "n/a" in page


def test_a_ctrl_c_while_serve_rolls_out_a_rollback_still_records_it(run, monkeypatch):
    """Serve had the rollback's config, the operator's Ctrl-C in the wait skipped serve.json, and
    the controller's next look ramped the rolled-back challenger up again."""
    from rayload.serve import serve_config

    run_dir = run(spec_of(0.95), events(20_000, {"A": 0.1, "B": 0.1}, {"A": 0.95, "B": 0.05}))
    control.step(run_dir)  # the controller ramps B to 25%

    def deploy_then_interrupted(config, address):
        error = KeyboardInterrupt()
        error.rayload_config_submitted = True  # as serve_config.deploy marks a wait interrupted after the submit
        raise error

    monkeypatch.setattr(control, "_redeploy", deploy_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        control.rollback(run_dir)
    assert user(run_dir)["weights"] == {"A": 1.0, "B": 0.0} and user(run_dir)["final"]["decision"] == "rollback"
    monkeypatch.setattr(control, "_redeploy", lambda config, address: (_ for _ in ()).throw(ConnectionError("no cluster")))
    with pytest.raises(ConnectionError):  # failed before Serve had anything: nothing recorded
        control.set_weights(run_dir, {"A": 0.5, "B": 0.5})
    assert user(run_dir)["weights"] == {"A": 1.0, "B": 0.0}

    class Client:  # serve_config.deploy marks what it raises once the config is submitted
        def get_serve_details(self):
            return {}

        def deploy_apps(self, schema, _blocking):
            pass

    import ray.serve._private.api as serve_api

    monkeypatch.setattr(serve_api, "serve_start", lambda **kw: Client())
    monkeypatch.setattr(serve_config, "wait_running", lambda name, wait_s: (_ for _ in ()).throw(KeyboardInterrupt()))
    config = control.load_state(run_dir)[1]["config"]
    with pytest.raises(KeyboardInterrupt) as info:
        serve_config.deploy(config)
    assert info.value.rayload_config_submitted


def _roles_from_the_spec(monkeypatch):
    """restartable's app args with the champion and weights a spec gives (as app_args builds them),
    and a deploy that takes any config."""
    real_args = control.app_args
    monkeypatch.setattr(control, "app_args", lambda spec, checkpoints, run_dir: dict(
        real_args(spec, checkpoints, run_dir), champion=spec.champion_arm, weights=spec.weights))
    monkeypatch.setattr(control, "deploy", lambda config: None)


def _swapped():
    """spec_of(0.95) with B named champion at 0.95: the same arms, models and salt."""
    from rayload.ab_spec import ab_from_dict

    return ab_from_dict({**spec_of(0.95).model_dump(mode="json"), "champion": "B",
                         "arms": [{"name": "A", "weight": 0.05, "checkpoint": "/x"}, {"name": "B", "weight": 0.95, "checkpoint": "/y"}]})


def test_a_restart_whose_spec_names_another_champion_is_a_new_experiment(restartable, monkeypatch):
    """The champion was not part of what makes a restart the same experiment: the running roles
    (A champion, B at 25%) were kept while the args said B, and a rollback gave B all traffic."""
    run_dir = restartable(spec_of(0.95), events(20_000, {"A": 0.1, "B": 0.1}, {"A": 0.95, "B": 0.05}))
    _roles_from_the_spec(monkeypatch)
    control.start(spec_of(0.95), run_dir=run_dir)
    control.step(run_dir)  # B ramped to 25%
    control.start(_swapped(), run_dir=run_dir)
    assert user(run_dir)["champion"] == "B" and user(run_dir)["weights"] == {"A": 0.05, "B": 0.95}  # the new spec's
    assert control.rollback(run_dir)["weights"] == {"A": 0.0, "B": 1.0}  # the arm under test now, A, gets none


def test_a_start_interrupted_after_serve_took_its_config_records_that_config(restartable, monkeypatch):
    """Serve ran the new experiment while serve.json still held the old one: the next decision
    redeployed the old experiment and read the old generation's events."""
    run_dir = restartable(spec_of(0.95), events(2_000, {"A": 0.1, "B": 0.1}, {"A": 0.95, "B": 0.05}))
    _roles_from_the_spec(monkeypatch)
    control.start(spec_of(0.95), run_dir=run_dir)
    old_generation = control.parts(control.load_state(run_dir)[1]["config"])[0]["generation"]
    served = {}

    def interrupted(config):
        served.update(control.parts(config)[0])
        error = KeyboardInterrupt()
        error.rayload_config_submitted = True
        raise error

    monkeypatch.setattr(control, "deploy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        control.start(_swapped(), run_dir=run_dir)
    args = control.parts(control.load_state(run_dir)[1]["config"])[0]
    assert args["generation"] == served["generation"] != old_generation and args["champion"] == "B"


def test_serve_build_of_an_experiment_that_ran_writes_the_state_in_force(restartable, monkeypatch):
    """`rayload serve build` wrote the spec's starting weights and no generation: deploying it undid a
    promote, and the routers stamped every later exposure with a generation its analysis never reads."""
    monkeypatch.setattr(control, "deploy", lambda config: None)
    run_dir = restartable(spec_of(0.95), events(3_000, {"A": 0.1, "B": 0.13}, {"A": 0.95, "B": 0.05}))
    monkeypatch.setattr(control, "run_dir_for", lambda spec: run_dir)
    control.start(spec_of(0.95), run_dir=run_dir)
    control.promote(run_dir)
    args, user_config = control.parts(control.load_state(run_dir)[1]["config"])
    built = control.build(spec_of(0.95))
    assert control.parts(built)[0]["generation"] == args["generation"] is not None
    assert control.parts(built)[1] == user_config and user_config["weights"] == {"A": 0.0, "B": 1.0}
    # another experiment in the folder (other salt): the spec's own start, as before
    fresh = control.build(spec_of(0.95, salt="other"))
    assert control.parts(fresh)[0]["generation"] is None and control.parts(fresh)[1]["weights"] == {"A": 0.95, "B": 0.05}


def test_a_failed_controller_look_is_retried_and_the_serve_loop_goes_on(monkeypatch, tmp_path):
    """One failed look (the event store unreachable for a moment) ended `rayload serve` with a
    traceback, leaving the experiment without its guardrails and ramp."""
    import yaml
    from typer.testing import CliRunner

    import rayload._cli_ab as cli_ab
    from rayload.cli import app

    spec = tmp_path / "ab.yaml"
    spec.write_text(yaml.safe_dump({"name": "t", "arms": [{"name": "A", "weight": 0.95, "checkpoint": "/x"},
                                                          {"name": "B", "weight": 0.05, "checkpoint": "/y"}],
                                    "drift": {"enabled": False}, "ramp": {"interval_s": 0.01}}))
    looks = []

    def step(run):
        looks.append(run)
        if len(looks) == 2:
            raise RuntimeError("could not connect to server")
        if len(looks) == 4:
            raise KeyboardInterrupt  # Ctrl-C: the loop's own end
        return "continue", []

    stopped = []
    monkeypatch.setattr(control, "start", lambda ab, address=None: control.Deployment(
        str(tmp_path), "http://127.0.0.1:8000", {"applications": [{"args": {"mode": "combined"}, "deployments": [{"user_config": {}}]}]}))
    monkeypatch.setattr(control, "step", step)
    monkeypatch.setattr(cli_ab, "_stop_serving", stopped.append)
    monkeypatch.setattr(cli_ab, "_stop_on_signals", lambda: None)
    res = CliRunner().invoke(app, ["serve", str(spec)])
    assert res.exit_code == 0, res.output
    assert len(looks) == 4 and stopped == ["t"]
    assert "the controller's look failed (RuntimeError: could not connect to server)" in " ".join(res.output.split())


def _decide(run_dir, act: bool, serving: bool, tmp_path):
    from rayload import _stage_runners as runners

    stage = types.SimpleNamespace(experiment="ab", act=act)
    folder = tmp_path / f"decide-{act}-{serving}"
    folder.mkdir(exist_ok=True)
    return runners.decide(None, stage, str(folder), {"ab": {"run_dir": run_dir, "serving": serving}}, None, lambda f: None)


def test_decide_reads_the_decision_in_force_and_says_why_it_did_not_act(run, tmp_path):
    """A rollback by the controller, then weights set by hand (which undo it: the controller decides
    again): decide took the log's last rollback for applied and left the hand-set weights. And
    act: false on a deployed experiment said 'no longer deployed'."""
    frame = events(4_000, {"A": 0.30, "B": 0.15}, {"A": 0.5, "B": 0.5})
    run_dir = run(spec_of(0.5), frame)
    assert _decide(run_dir, act=False, serving=True, tmp_path=tmp_path)["action"] == "recorded (act: false, not applied)"
    assert _decide(run_dir, act=True, serving=False, tmp_path=tmp_path)["action"] == "recorded (the experiment is no longer deployed)"
    assert control.step(run_dir)[0] == "rollback" and user(run_dir)["weights"] == {"A": 1.0, "B": 0.0}
    assert _decide(run_dir, act=True, serving=True, tmp_path=tmp_path)["action"] == "applied during the experiment (rollback)"
    control.set_weights(run_dir, {"A": 0.9, "B": 0.1})
    out = _decide(run_dir, act=True, serving=True, tmp_path=tmp_path)
    assert (out["decision"], out["action"]) == ("rollback", "applied now (rollback)") and user(run_dir)["weights"] == {"A": 1.0, "B": 0.0}


def test_the_simulator_posts_the_outcome_the_analysis_counts(run, monkeypatch):
    """It always posted event 'click': an experiment with analysis.event: conversion read no outcome at all."""
    from rayload.serve import simulate as sim

    run_dir = run(spec_of(0.5, analysis={"min_units": 200, "event": "conversion"}), events(10, {"A": 0.1, "B": 0.1}, {"A": 0.5, "B": 0.5}))
    asked = []

    def fake(url, world, users, requests, concurrency, seed, api_key, on_progress=None, event="click"):
        asked.append(event)
        return sim.SimResult(requests, requests, 0, status={200: requests})

    monkeypatch.setattr(sim, "simulate", fake)
    sim.simulate_and_decide(run_dir, "http://x", None, users=10, requests=20, auto=False, chunks=2)
    assert asked == ["conversion", "conversion"]
    posted = []

    class Client:
        async def post(self, url, json, headers):
            posted.append(json)
            return types.SimpleNamespace(status_code=200)

    import asyncio

    assert asyncio.run(sim._feedback(Client(), "http://x", "r1", {}, "conversion")) == 200
    assert posted == [{"request_id": "r1", "event": "conversion"}]
