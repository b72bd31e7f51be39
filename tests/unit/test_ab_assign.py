"""Sticky assignment and A/B spec checks, without Ray."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from rayload.ab_spec import ab_from_dict, load_ab_spec, weight_issues
from rayload.errors import SpecError
from rayload.serve.assign import Layout

ARMS = ["control", "challenger"]
UNITS = [f"user-{i}" for i in range(10_000)]


def layout(w: float) -> Layout:
    return Layout.build({"control": 1 - w, "challenger": w}, "control", ARMS)


def test_assignment_is_identical_in_another_process_with_another_hash_seed():
    here = [layout(0.3).assign("salt", u) for u in UNITS]
    code = ("import json, sys; from rayload.serve.assign import Layout; "
            "l = Layout.build({'control': 0.7, 'challenger': 0.3}, 'control', ['control', 'challenger']); "
            "print(json.dumps([l.assign('salt', f'user-{i}') for i in range(10000)]))")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONHASHSEED="123"), capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == here


def test_raising_the_challengers_weight_only_moves_units_from_control_to_challenger():
    before = {u: layout(0.05).assign("s", u) for u in UNITS}
    for w in (0.25, 0.5, 1.0):
        after = {u: layout(w).assign("s", u) for u in UNITS}
        moved = [(before[u], after[u]) for u in UNITS if before[u] != after[u]]
        assert moved and set(moved) == {("control", "challenger")}
        before = after


def test_split_accuracy_within_one_point_at_10000_units_and_salt_reshuffles():
    for w in (0.05, 0.25, 0.5):
        share = sum(layout(w).assign("exp-1", u) == "challenger" for u in UNITS) / len(UNITS)
        assert abs(share - w) <= 0.01, (w, share)
    a = [layout(0.5).assign("exp-1", u) for u in UNITS]
    b = [layout(0.5).assign("exp-2", u) for u in UNITS]
    assert 0.4 < sum(x != y for x, y in zip(a, b)) / len(UNITS) < 0.6


def test_three_arms_each_challenger_grows_only_into_control():
    base = Layout.build({"c": 0.8, "x": 0.1, "y": 0.1}, "c", ["c", "x", "y"])
    grown = Layout.build({"c": 0.6, "x": 0.3, "y": 0.1}, "c", ["c", "x", "y"])
    moves = {(base.assign("s", u), grown.assign("s", u)) for u in UNITS} - {("c", "c"), ("x", "x"), ("y", "y")}
    assert moves == {("c", "x")}


def test_weights_must_sum_to_one_be_non_negative_and_name_every_arm():
    assert "sum to 1.0" in weight_issues({"control": 0.5, "challenger": 0.6}, ARMS, "control")[0].render()
    assert "number >= 0" in weight_issues({"control": 1.2, "challenger": -0.2}, ARMS, "control")[0].render()
    assert "exactly the arms" in weight_issues({"control": 1.0}, ARMS, "control")[0].render()
    assert weight_issues({"control": 0.9, "challenger": 0.1}, ARMS, "control") == []


def test_spec_errors_name_the_field(tmp_path):
    raw = {"name": "ab", "arms": [{"name": "a", "weight": 0.5, "checkpoint": "x"}, {"name": "b", "weight": 0.6, "job": "j.yaml"}],
           "serving": {"max_batch_size": 0, "colour": 1, "ingress": "haproxy"}}
    path = tmp_path / "ab.yaml"
    path.write_text("# rayload serve ab.yaml\n" + yaml.safe_dump(raw))
    with pytest.raises(SpecError) as info:
        load_ab_spec(str(path))
    text = str(info.value)
    assert "serving.max_batch_size" in text and "serving.colour" in text and "ab.yaml" in text
    assert "serving.ingress" in text and "'proxy' or 'direct'" in text
    with pytest.raises(SpecError, match="sum to 1.0"):
        ab_from_dict({**raw, "serving": {}})
    with pytest.raises(SpecError, match="exactly one of checkpoint or job"):
        ab_from_dict({"name": "ab", "arms": [{"name": "a", "weight": 1.0}, {"name": "b", "weight": 0.0, "checkpoint": "x"}]})
    with pytest.raises(SpecError, match="ramp.steps: ramp steps must be increasing"):
        ab_from_dict({"name": "ab", "arms": [{"name": "a", "weight": 0.5, "checkpoint": "x"}, {"name": "b", "weight": 0.5, "checkpoint": "x"}],
                      "ramp": {"steps": [0.5, 0.25]}})


def test_relative_paths_resolve_against_the_spec_file(tmp_path):
    import shutil

    (tmp_path / "ck").mkdir()
    shutil.copy(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "jobs", "movielens_deepfm.yaml"),
                tmp_path / "job.yaml")  # a job arm's spec must load (arm_job_issues)
    path = tmp_path / "ab.yaml"
    path.write_text(yaml.safe_dump({"name": "ab", "arms": [{"name": "a", "weight": 0.9, "checkpoint": "ck"},
                                                             {"name": "b", "weight": 0.1, "job": "job.yaml"}]}))
    spec = load_ab_spec(str(path))
    assert spec.arms[0].checkpoint == str(tmp_path / "ck") and spec.champion_arm == "a" and spec.challengers == ["b"]
    assert spec.arms[1].job == str(tmp_path / "job.yaml")


def test_direct_ingress_urls_come_from_serve_target_groups():
    """Shaped as Serve's get_serve_details()["target_groups"]: each node hands out ports from the
    same range, so two replicas on two nodes can both hold port 30000."""
    from rayload.errors import RayloadError
    from rayload.serve.ingress import urls_from_target_groups

    def group(app, *targets):
        return {"app_name": app, "protocol": "HTTP", "route_prefix": "/ab",
                "targets": [{"ip": ip, "port": port, "name": name} for ip, port, name in targets]}

    serving = {"host": "0.0.0.0", "port": 8000, "route_prefix": "/ab", "replicas": 2, "ingress": "direct"}
    two_nodes = [group("other", ("10.0.0.1", 30000, "SERVE_REPLICA::other#X#a")),
                 group("ab", ("10.0.0.1", 30001, "SERVE_REPLICA::ab#ABRouter#b"), ("10.0.0.2", 30000, "SERVE_REPLICA::ab#ABRouter#c"))]
    assert urls_from_target_groups(two_nodes, serving, "ab", "10.0.0.1", 2) == ["http://10.0.0.1:30001/ab", "http://10.0.0.2:30000/ab"]
    # one of two replicas has its port: not yet for a new deployment, enough for a client that wants whoever answers now
    starting = [group("ab", ("10.0.0.1", 30001, "SERVE_REPLICA::ab#ABRouter#b"))]
    assert urls_from_target_groups(starting, serving, "ab", "10.0.0.1", 2) is None
    assert urls_from_target_groups(starting, serving, "ab", "10.0.0.1", 1) == ["http://10.0.0.1:30001/ab"]
    # no replica running: Serve lists the fallback proxy in the app's group, which is no replica
    fallback = [group("ab", ("10.0.0.1", 8500, "SERVE_CONTROLLER_ACTOR:SERVE_PROXY_ACTOR-fallback"))]
    assert urls_from_target_groups(fallback, serving, "ab", "10.0.0.1", 1) is None
    loopback = {**serving, "host": "127.0.0.1"}
    with pytest.raises(RayloadError, match=r"router replicas run on other nodes \(10\.0\.0\.2\).*start Serve with host 0.0.0.0"):
        urls_from_target_groups(two_nodes, loopback, "ab", "10.0.0.1", 2)
    one_node = [group("ab", ("10.0.0.1", 30001, "SERVE_REPLICA::ab#ABRouter#b"), ("10.0.0.1", 30002, "SERVE_REPLICA::ab#ABRouter#c"))]
    assert urls_from_target_groups(one_node, loopback, "ab", "10.0.0.1", 2) == ["http://127.0.0.1:30001/ab", "http://127.0.0.1:30002/ab"]
    proxy_only = [{"app_name": "", "protocol": "HTTP", "route_prefix": "/", "targets": [{"ip": "10.0.0.1", "port": 8000, "name": "p"}]}]
    with pytest.raises(RayloadError, match="without direct ingress.*proxy at http://0.0.0.0:8000/ab.*RAY_SERVE_ENABLE_DIRECT_INGRESS=1"):
        urls_from_target_groups(proxy_only, serving, "ab", "10.0.0.1", 1)


def test_ramp_steps_off_the_bucket_grid_are_refused_at_load_naming_the_step():
    arms = [{"name": "a", "weight": 0.95, "checkpoint": "x"}, {"name": "b", "weight": 0.05, "checkpoint": "x"}]
    with pytest.raises(SpecError, match=r"ramp.steps: ramp step 1 \(0.33333\) must be a whole number of 1/10000 buckets"):
        ab_from_dict({"name": "ab", "arms": arms, "ramp": {"steps": [0.05, 0.33333, 0.5]}})
    assert ab_from_dict({"name": "ab", "arms": arms, "ramp": {"steps": [0.05, 0.3333, 0.5]}}).ramp.steps[1] == 0.3333


def test_shadow_mode_refuses_a_challenger_with_live_traffic():
    arms = [{"name": "a", "weight": 0.9, "checkpoint": "x"}, {"name": "b", "weight": 0.1, "checkpoint": "x"}]
    with pytest.raises(SpecError, match=r"arms.b: in shadow mode the champion answers every request"):
        ab_from_dict({"name": "ab", "shadow": True, "arms": arms})
    assert weight_issues({"a": 0.9, "b": 0.1}, ["a", "b"], "a", "weights", shadow=True)[0].path == "weights.b"
    assert weight_issues({"a": 0.0, "b": 1.0}, ["a", "b"], "b", "weights", shadow=True) == []  # a promotion in shadow mode
