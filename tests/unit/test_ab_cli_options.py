"""`rayload serve` and `rayload ab ...` as commands, without Ray: what they hand to rayload.serve."""

import pytest
from typer.testing import CliRunner

from rayload import _cli_ab
from rayload.ab_spec import load_ab_spec
from rayload.cli import app

SPEC = "name: trial1\narms: [{name: A, weight: 0.95, checkpoint: /x}, {name: B, weight: 0.05, checkpoint: /y}]\ndrift: {enabled: false}\n"


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "ab.yaml"
    path.write_text(SPEC)
    return str(path)


@pytest.mark.parametrize("embedded", [False, True])
def test_ctrl_c_on_serve_ends_serve_and_ray_only_where_this_process_started_them(spec, monkeypatch, embedded):
    """Without --address and RAY_ADDRESS, `rayload serve` may still have joined a `ray start`
    cluster (its address file): Ctrl-C then removes this experiment only."""
    import ray
    from ray import serve

    import rayload._ray
    from rayload.serve import control

    calls = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(rayload._ray, "embedded", lambda: embedded)
    monkeypatch.setattr(control, "start", lambda ab, address=None: control.Deployment("/tmp/run", "http://h:1", {
        "applications": [{"args": {"mode": "combined"}, "deployments": [{"user_config": {}}]}]}))
    monkeypatch.setattr(_cli_ab, "_stop_on_signals", lambda: None)
    monkeypatch.setattr(_cli_ab.time, "sleep", lambda s: (_ for _ in ()).throw(KeyboardInterrupt()))
    monkeypatch.setattr(serve, "delete", lambda name: calls.append(("delete", name)))
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append(("serve.shutdown",)))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append(("ray.shutdown",)))
    r = CliRunner().invoke(app, ["serve", spec])
    assert r.exit_code == 0, r.output
    assert calls == [("delete", "trial1")] + ([("serve.shutdown",), ("ray.shutdown",)] if embedded else [])


class _Stop(Exception):
    pass


@pytest.mark.parametrize("command", [["status"], ["set-weights", "A=0.9", "B=0.1"], ["promote"], ["rollback"], ["report"], ["simulate"]])
def test_ab_commands_given_the_spec_act_on_the_experiment_its_set_overrides_name(spec, monkeypatch, command):
    """`rayload serve ab.yaml --set name=trial2` serves trial2: `rayload ab ... ab.yaml --set
    name=trial2` reaches trial2's run folder, not the file's trial1."""
    from rayload.serve import control

    seen = []

    def record(run, *args, **kwargs):
        seen.append(run)
        raise _Stop

    for name in ("analysis_for", "set_weights", "promote", "rollback", "load_state"):
        monkeypatch.setattr(control, name, record)
    r = CliRunner().invoke(app, ["ab", command[0], spec, *command[1:], "--set", "name=trial2"])
    assert isinstance(r.exception, _Stop), r.output
    assert seen == [control.run_dir_for(load_ab_spec(spec, ["name=trial2"]))] and seen[0].endswith("trial2")


def test_set_on_an_ab_command_given_a_run_name_is_refused_naming_the_option():
    r = CliRunner().invoke(app, ["ab", "promote", "trial1", "--set", "name=trial2"])
    assert r.exit_code == 2 and "--set" in r.output and "trial1" in r.output


def test_simulate_takes_the_users_and_requests_given_and_refuses_fewer_than_one_naming_the_option(spec, monkeypatch):
    import rayload.serve.simulate
    import rayload.serve.world
    from rayload.serve import control

    got = []
    monkeypatch.setattr(control, "load_state", lambda run: (run, {"config": {"applications": [{"args": {}, "deployments": [{"user_config": {}}]}]}}))
    monkeypatch.setattr(rayload.serve.world, "world_for", lambda ab, args: None)
    monkeypatch.setattr(rayload.serve.simulate, "simulate_and_decide",
                        lambda run_dir, url, world, users, requests, *a, **k: got.append((users, requests)) or (_ for _ in ()).throw(_Stop()))
    r = CliRunner().invoke(app, ["ab", "simulate", spec, "--url", "http://h:1", "--users", "1", "--requests", "1"])
    assert isinstance(r.exception, _Stop) and got == [(1, 1)], r.output
    CliRunner().invoke(app, ["ab", "simulate", spec, "--url", "http://h:1"])
    assert got[-1] == (2000, 20000)  # the spec's simulate.users and .requests
    for option, value in (("--users", "0"), ("--requests", "0"), ("--requests", "-5"), ("--users", "-3")):
        r = CliRunner().invoke(app, ["ab", "simulate", spec, "--url", "http://h:1", option, value])
        assert r.exit_code == 2 and option in r.output and ("x>=1" in r.output or "greater than or equal to 1" in r.output), r.output
    assert len(got) == 2


def test_simulate_without_url_reads_the_routers_urls_for_each_slice(spec, monkeypatch):
    import rayload.serve.simulate
    import rayload.serve.world
    from rayload.serve import control

    asked = []
    monkeypatch.setattr(control, "load_state", lambda run: (run, {"config": {"applications": [{"args": {}, "deployments": [{"user_config": {}}]}]}}))
    monkeypatch.setattr(control, "live_urls", lambda run: asked.append(run) or [f"http://h:{30000 + len(asked)}"])
    monkeypatch.setattr(rayload.serve.world, "world_for", lambda ab, args: None)
    monkeypatch.setattr(rayload.serve.simulate, "simulate_and_decide",
                        lambda run_dir, url, *a, **k: (url(), url(), (_ for _ in ()).throw(_Stop())))
    r = CliRunner().invoke(app, ["ab", "simulate", spec])
    assert isinstance(r.exception, _Stop) and len(asked) == 2, r.output
