"""cluster.yaml: Ray's own schema and the secure defaults, each failure named by its field."""

import copy
import os
import subprocess
import sys

import pytest
import yaml

from rayload.cluster import lint, local_config, read_cluster, schema_issues, security_issues, version_issues

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(ROOT, "cluster.yaml")


@pytest.fixture
def config():
    return read_cluster(CLUSTER)


def _paths(issues):
    return {i.path for i in issues}


def test_cluster_yaml_passes_schema_and_security_lint():
    assert lint(CLUSTER) == []


def test_cluster_yaml_has_head_cpu_and_gpu_worker_types(config):
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"]["CPU"] == 0
    assert any(t.get("resources", {}).get("GPU") and t["max_workers"] >= 1 for t in types.values())
    assert any(not t.get("resources", {}).get("GPU") and t.get("resources", {}).get("CPU") for n, t in types.items() if n != config["head_node_type"])


def test_schema_violation_is_named(config):
    config["max_workerz"] = 3
    config["available_node_types"]["gpu_worker"]["max_workers"] = "four"
    issues = schema_issues(config)
    assert any("max_workerz" in i.message for i in issues)
    assert "available_node_types.gpu_worker.max_workers" in _paths(issues)


def test_dashboard_on_all_interfaces_fails(config):
    config["head_start_ray_commands"][1] = config["head_start_ray_commands"][1].replace("--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0")
    issues = security_issues(config)
    assert "head_start_ray_commands[1]" in _paths(issues)
    assert any("--dashboard-host must be 127.0.0.1" in i.message for i in issues)


@pytest.mark.parametrize("command", [
    "RAY_AUTH_MODE=token bash -lc 'conda activate rl && ray start --head --port=6379 --dashboard-host=0.0.0.0'",
    'export RAY_AUTH_MODE=token; sh -c "ray start --head --dashboard-host 0.0.0.0"',
    "RAY_AUTH_MODE=token ray start --head --dashboard-host=0.0.0.0;",
])
def test_an_open_dashboard_inside_a_shell_wrapped_start_command_fails(config, command):
    issues = _head_start_issues(config, command)
    assert [i.message.split(":")[0] for i in issues] == ["--dashboard-host must be 127.0.0.1"], issues


def _head_start_issues(config, command: str) -> list:
    """The security issues of the head's start command when it is `command`."""
    config["head_start_ray_commands"][1] = command
    return [i for i in security_issues(config) if i.path == "head_start_ray_commands[1]"]


@pytest.mark.parametrize("command", [
    "export RAY_AUTH_MODE=token; ray start --head --port=6379 --dashboard-host=127.0.0.1",
    "export RAY_AUTH_MODE=token && ray start --head --port=6379 --dashboard-host=127.0.0.1",
    "bash -lc 'export RAY_AUTH_MODE=token; ray start --head --port=6379 --dashboard-host=127.0.0.1'",
    # refused by the first version of the per-start check (shlex dropped the newlines; only the
    # words `ray start` counted as a start)
    "export RAY_AUTH_MODE=token\nray start --head --port=6379 --dashboard-host=127.0.0.1",  # a YAML block of lines
    "ray stop\nRAY_AUTH_MODE=token ray start --head --port=6379 --dashboard-host=127.0.0.1",
    "RAY_AUTH_MODE=token /home/ubuntu/venv/bin/ray start --head --port=6379 --dashboard-host=127.0.0.1",
    "sudo RAY_AUTH_MODE=token ray start --head --port=6379 --dashboard-host=127.0.0.1",
    "export RAY_AUTH_MODE=token; nohup ray start --head --port=6379 --dashboard-host=127.0.0.1",
    "export RAY_AUTH_MODE=token; (ray start --head --port=6379 --dashboard-host=127.0.0.1)",
    "sudo RAY_AUTH_MODE=token bash -lc 'ray start --head --port=6379 --dashboard-host=127.0.0.1'",
    "{ export RAY_AUTH_MODE=token; }; ray start --head --port=6379 --dashboard-host=127.0.0.1",
    # a comment line, one after a command, and a backslash continuation: a comment ended the whole command
    "# the head, with token auth\nRAY_AUTH_MODE=token ray start --head --port=6379 --dashboard-host=127.0.0.1",
    "ulimit -n 65536  # more files: not a ray start\nRAY_AUTH_MODE=token ray start --head --port=6379 --dashboard-host=127.0.0.1",
    "RAY_AUTH_MODE=token \\\n  ray start --head --port=6379 --dashboard-host=127.0.0.1",
])
def test_token_auth_exported_before_ray_start_passes(config, command):
    config["head_start_ray_commands"][1] = command
    assert "head_start_ray_commands[1]" not in _paths(security_issues(config))


def test_missing_token_auth_fails_on_head_and_workers(config):
    config["head_start_ray_commands"][1] = config["head_start_ray_commands"][1].replace("RAY_AUTH_MODE=token", "")
    config["worker_start_ray_commands"][1] = config["worker_start_ray_commands"][1].replace("RAY_AUTH_MODE=token ", "")
    assert {"head_start_ray_commands[1]", "worker_start_ray_commands[1]"} <= _paths(security_issues(config))


@pytest.mark.parametrize("port", [6379, 8265, 10001, 8000, 22])
def test_any_ray_port_or_ssh_open_to_the_internet_fails(config, port):
    config["provider"]["security_group"]["IpPermissions"].append(
        {"IpProtocol": "tcp", "FromPort": port, "ToPort": port, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]})
    issues = security_issues(config)
    assert "provider.security_group.IpPermissions[1]" in _paths(issues)
    assert str(port) in next(i.message for i in issues if i.path == "provider.security_group.IpPermissions[1]")


def test_all_traffic_from_anywhere_fails_and_a_wide_range_is_caught(config):
    rules = config["provider"]["security_group"]["IpPermissions"]
    rules.append({"IpProtocol": "-1", "Ipv6Ranges": [{"CidrIpv6": "::/0"}]})
    rules.append({"IpProtocol": "tcp", "FromPort": 8000, "ToPort": 9000, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]})
    paths = _paths(security_issues(config))
    assert {"provider.security_group.IpPermissions[1]", "provider.security_group.IpPermissions[2]"} <= paths


def test_nodes_without_their_own_security_group_and_token_mount_fail(config):
    del config["available_node_types"]["cpu_worker"]["node_config"]["SecurityGroupIds"]
    del config["file_mounts"]["~/.ray/auth_token"]
    config["available_node_types"]["head"]["resources"]["CPU"] = 8
    paths = _paths(security_issues(config))
    assert {"available_node_types.cpu_worker.node_config.SecurityGroupIds", "file_mounts", "available_node_types.head.resources.CPU"} <= paths


def test_image_ray_version_must_match_constraints(config, tmp_path):
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("ray==2.99.0\n")
    issues = version_issues(config, str(constraints))
    assert issues and issues[0].path == "docker.image" and "2.99.0" in issues[0].message
    assert version_issues(config, os.path.join(ROOT, "constraints.txt")) == []


def test_every_image_a_node_runs_is_checked_and_the_head_takes_no_gpu_option(config):
    """Only docker.image was checked: a head_image or worker_image (global or a node type's own),
    the images the nodes actually start, could run another Ray; --gpus in head_run_options on a
    head without GPUs (its container never starts) passed too."""
    from rayload.cluster import gpu_option_issues

    pins = os.path.join(ROOT, "constraints.txt")
    config["docker"]["head_image"] = "rayproject/ray:2.50.0-py311"
    config["docker"]["worker_image"] = "rayproject/ray:2.60.0-py312"
    config["available_node_types"]["gpu_worker"]["docker"]["worker_image"] = "rayproject/ray@sha256:abcdef0123"
    issues = {i.path: i.message for i in version_issues(config, pins)}
    assert set(issues) == {"docker.head_image", "docker.worker_image", "available_node_types.gpu_worker.docker.worker_image"}
    assert "runs Ray 2.50.0" in issues["docker.head_image"] and "Python must be 3.11" in issues["docker.worker_image"]
    assert "has no version tag" in issues["available_node_types.gpu_worker.docker.worker_image"]
    config["docker"]["head_run_options"] = ["--gpus all"]
    assert _paths(gpu_option_issues(config)) == {"docker.head_run_options"}
    config["docker"]["head_image"] = config["docker"]["worker_image"] = "rayproject/ray:2.60.0-py311-gpu@sha256:" + "a" * 64
    config["docker"]["image"] = "rayproject/ray:2.9.0-py310"  # replaced by both: no node runs it
    assert _paths(version_issues(config, pins)) == {"available_node_types.gpu_worker.docker.worker_image"}


def test_lint_cli_names_the_failing_field(tmp_path, config):
    bad = copy.deepcopy(config)
    bad["head_start_ray_commands"][1] += " --dashboard-host=0.0.0.0"
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(bad))
    rayload = os.path.join(os.path.dirname(sys.executable), "rayload")
    r = subprocess.run([rayload, "cluster", "lint", str(path)], capture_output=True, text=True, timeout=120, env=dict(os.environ, COLUMNS="200"))
    assert r.returncode == 2 and "head_start_ray_commands[1]" in r.stderr and "0.0.0.0" in r.stderr


def test_local_config_is_a_fake_multinode_config_with_the_same_types(config):
    local = local_config(config, "10.0.0.1:6390")
    assert local["provider"] == {"type": "fake_multinode", "gcs_address": "10.0.0.1:6390", "use_node_id_as_ip": True,
                                 "disable_node_updaters": True, "disable_launch_config_check": True}
    assert set(local["available_node_types"]) == {"ray.head.default", "cpu_worker", "gpu_worker"}
    assert local["available_node_types"]["gpu_worker"]["resources"]["GPU"] == 1
    assert schema_issues(local) == []


def test_gpu_docker_options_only_on_gpu_node_types(config):
    from rayload.cluster import gpu_option_issues

    assert gpu_option_issues(config) == []
    assert config["available_node_types"]["gpu_worker"]["docker"]["worker_run_options"] == ["--gpus all"]
    config["docker"]["worker_run_options"] = ["--gpus all"]  # global: the CPU workers would never start
    config["available_node_types"]["cpu_worker"]["docker"] = {"worker_run_options": ["--gpus all"]}
    assert _paths(gpu_option_issues(config)) == {"docker.worker_run_options", "available_node_types.cpu_worker.docker.worker_run_options"}


def test_the_head_gives_jobs_a_fixed_rayload_home(config):
    """Without RAYLOAD_HOME a job's run folders (./runs) went into Ray's temporary copy of the
    upload: the head's `ray start` (whose environment jobs inherit) and its login shells
    (`ray attach`, where rayload runs by hand) name the same absolute folder."""
    from rayload.cluster import _words

    def homes(command):
        return [w.split("=", 1)[1] for w in _words(command) if w.startswith("RAYLOAD_HOME=")]

    start = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    assert start and all(homes(c) for c in start), start
    login = [h for c in config["head_setup_commands"] for h in homes(c.replace("'", " "))]
    folders = {h for c in start for h in homes(c)} | set(login)
    assert len(folders) == 1 and login, folders
    assert next(iter(folders)).startswith(("/", "$HOME/", "~/")), folders


@pytest.mark.parametrize("command", [
    "RAY_AUTH_MODE=token ray stop && ray start --head --port=6379 --dashboard-host=127.0.0.1",  # the variable is ray stop's
    "echo RAY_AUTH_MODE=token; ray start --head --port=6379 --dashboard-host=127.0.0.1",
    "RAY_AUTH_MODE=token RAY_AUTH_MODE=disabled ray start --head --port=6379 --dashboard-host=127.0.0.1",
    "export RAY_AUTH_MODE=token; export RAY_AUTH_MODE=disabled; ray start --head --port=6379 --dashboard-host=127.0.0.1",
    "bash -lc 'ray start --head --port=6379 --dashboard-host=127.0.0.1'",
    "RAY_AUTH_MODE=token\nray start --head --port=6379 --dashboard-host=127.0.0.1",  # a line of its own, not exported
    # sudo resets the environment (env_reset) and su - starts a login shell: what was set before them is gone
    "RAY_AUTH_MODE=token sudo ray start --head --port=6379 --dashboard-host=127.0.0.1",
    "export RAY_AUTH_MODE=token && sudo -u ubuntu bash -lc 'ray start --head --port=6379 --dashboard-host=127.0.0.1'",
    "export RAY_AUTH_MODE=token && su - ubuntu -c 'ray start --head --port=6379 --dashboard-host=127.0.0.1'",
])
def test_a_start_that_does_not_itself_run_with_token_auth_fails(config, command):
    """The word RAY_AUTH_MODE=token anywhere in the command passed, whatever it applied to."""
    issues = _head_start_issues(config, command)
    assert [i.message for i in issues] == ["must start Ray with RAY_AUTH_MODE=token (token authentication)"]


@pytest.mark.parametrize("rule, field", [
    ({"IpProtocol": "tcp", "FromPort": "ssh", "ToPort": 22, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}, "IpPermissions[1].FromPort"),
    ({"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "IpRanges": "0.0.0.0/0"}, "IpPermissions[1]"),
    ("tcp 22 0.0.0.0/0", "IpPermissions[1]"),
])
def test_a_malformed_security_group_rule_is_named_not_a_traceback(config, rule, field):
    """Ray's schema does not look inside the security group; these raised ValueError and AttributeError."""
    config["provider"]["security_group"]["IpPermissions"].append(rule)
    assert f"provider.security_group.{field}" in _paths(security_issues(config))
