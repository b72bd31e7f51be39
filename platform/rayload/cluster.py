"""cluster.yaml: schema validation against the installed Ray, the security lint, and a local
fake multi-node config derived from it (same node types and resources) for tests.

The lint is what a reviewer would check before `ray up`: token auth on every node, the
dashboard bound to loopback, no Ray port (6379 GCS, 8265 dashboard and jobs, 10001 client,
8000 Serve) and no SSH open to the internet, node security groups given explicitly (the group
Ray creates itself opens SSH to 0.0.0.0/0), no training work on the head, and the image's Ray
matching constraints.txt.
"""

from __future__ import annotations

import json
import os
import re
import shlex

import yaml

from .errors import SpecError, SpecIssue

RAY_PORTS = {6379: "GCS", 8265: "dashboard and job API", 10001: "Ray client", 8000: "Serve HTTP"}
_OPEN = ("0.0.0.0/0", "::/0")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def read_cluster(path: str) -> dict:
    if not os.path.exists(path):
        raise SpecError([SpecIssue("", f"cluster file not found: {path}")], file=path)
    if os.path.isdir(path):  # IsADirectoryError was a traceback
        raise SpecError([SpecIssue("", f"{path} is a folder, not a cluster file")], file=path)
    try:
        with open(path, "rb") as f:  # bytes: a byte that is not UTF-8 is a YAML reader error naming its position
            config = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        raise SpecError([SpecIssue("", f"not valid YAML: {exc}")], file=path) from None
    except OSError as exc:
        raise SpecError([SpecIssue("", f"cannot read the cluster file: {exc.strerror or exc}")], file=path) from None
    if not isinstance(config, dict):
        raise SpecError([SpecIssue("", "the top level must be a mapping")], file=path)
    return config


def schema_issues(config: dict) -> list[SpecIssue]:
    """Every violation of the cluster schema shipped inside the installed Ray package."""
    import jsonschema
    import ray.autoscaler

    with open(os.path.join(os.path.dirname(ray.autoscaler.__file__), "ray-schema.json")) as f:
        schema = json.load(f)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(config), key=lambda e: list(e.absolute_path))
    return [SpecIssue(".".join(str(p) for p in e.absolute_path), f"Ray's cluster schema: {e.message}") for e in errors]


def lint(path: str, constraints: str | None = None) -> list[SpecIssue]:
    config = read_cluster(path)
    issues = schema_issues(config)
    try:
        issues += security_issues(config)
        issues += gpu_option_issues(config)
        constraints = constraints or os.path.join(os.path.dirname(os.path.abspath(path)), "constraints.txt")
        if os.path.exists(constraints):
            issues += version_issues(config, constraints)
    except (AttributeError, TypeError, ValueError):
        if not issues:
            raise
        # a section of the wrong shape (a list where the schema wants a mapping): the schema's
        # issues name it, and the checks below it wait until it is fixed
    return issues


def gpu_option_issues(config: dict) -> list[SpecIssue]:
    """`docker run --gpus all` fails on a host without GPUs: the option belongs to the node
    types that have them, never to the global docker options every worker gets."""
    def gpus(options) -> bool:
        return any(str(o).startswith("--gpus") for o in options or [])

    docker = config.get("docker") or {}
    issues = [SpecIssue(f"docker.{key}", "--gpus would reach every worker, and `docker run --gpus` fails on a node without "
                        "GPUs: put it under available_node_types.<gpu type>.docker.worker_run_options", docker[key], True)
              for key in ("run_options", "worker_run_options") if gpus(docker.get(key))]
    for name, node in (config.get("available_node_types") or {}).items():
        options = (node.get("docker") or {}).get("worker_run_options")
        if gpus(options) and not (node.get("resources") or {}).get("GPU"):
            issues.append(SpecIssue(f"available_node_types.{name}.docker.worker_run_options",
                                    "--gpus on a node type without GPU resources", options, True))
    head = (config.get("available_node_types") or {}).get(config.get("head_node_type")) or {}
    if gpus(docker.get("head_run_options")) and not (head.get("resources") or {}).get("GPU"):  # the head container never started
        issues.append(SpecIssue("docker.head_run_options", "--gpus on a head node type without GPU resources, and `docker run "
                                "--gpus` fails on a node without GPUs", docker.get("head_run_options"), True))
    return issues


def check(path: str) -> None:
    """Raise SpecError naming every failing field."""
    issues = lint(path)
    if issues:
        raise SpecError(issues, file=path)


def security_issues(config: dict) -> list[SpecIssue]:
    issues = []
    for section in ("head_start_ray_commands", "worker_start_ray_commands"):
        issues += _start_command_issues(config.get(section) or [], section)
    mounts = config.get("file_mounts") or {}
    if not any(os.path.normpath(k).endswith(".ray/auth_token") for k in mounts):
        issues.append(SpecIssue("file_mounts", "must mount the token file: \"~/.ray/auth_token\": \"~/.ray/auth_token\" "
                                "(token auth needs the same token on every node)"))
    issues += _security_group_issues(config)
    head = (config.get("available_node_types") or {}).get(config.get("head_node_type"), {})
    if (head.get("resources") or {}).get("CPU", None) != 0:
        issues.append(SpecIssue(f"available_node_types.{config.get('head_node_type')}.resources.CPU",
                                "must be 0: the head coordinates (GCS, autoscaler, drivers) and must not run training work",
                                (head.get("resources") or {}).get("CPU"), True))
    return issues


def _start_command_issues(commands: list[str], section: str) -> list[SpecIssue]:
    starts = [(i, c) for i, c in enumerate(commands) if "ray start" in c]
    if not starts:
        return [SpecIssue(section, "no `ray start` command")]
    issues = []
    for i, command in starts:
        where = f"{section}[{i}]"
        if not _starts_with_token_auth(command):  # `VAR=v ray start`, `export VAR=v; ray start`, `&&`
            issues.append(SpecIssue(where, "must start Ray with RAY_AUTH_MODE=token (token authentication)", command, True))
        for host in _options(command, "--dashboard-host"):
            if host in _LOOPBACK:
                continue
            issues.append(SpecIssue(where, "--dashboard-host must be 127.0.0.1: the dashboard and job API would be reachable "
                                    "from the network; use `ray dashboard cluster.yaml` (an SSH tunnel)", host, True))
    return issues


_SEPARATORS = {";", "&&", "||", "|", "&", ")", "}"}
_LAUNCHERS = {"env", "sudo", "nohup", "exec", "time", "command", "(", "{"}
_RESETS_ENV = {"sudo", "su"}  # sudo's env_reset, su's login shell: what was set before them does not reach the command


def _starts_with_token_auth(command: str) -> bool:
    """Whether every `ray start` in the command runs with RAY_AUTH_MODE=token: given before it in
    its own simple command (`RAY_AUTH_MODE=token ray start`, `env VAR=... ray start`), exported
    earlier (`export RAY_AUTH_MODE=token && ray start`), or given to a shell that runs it
    (`RAY_AUTH_MODE=token bash -lc '... ray start'`); the last value given counts. (The word
    anywhere passed `RAY_AUTH_MODE=token ray stop && ray start --head`, whose start has no auth.)"""
    starts = _auth_of_starts(command, None)
    return len(starts) >= _start_words(command) and all(mode == "token" for mode in starts)  # every start read


def _lines(command: str) -> list[str]:
    """The command's lines, backslash continuations joined (a `|` block of a folded command)."""
    return re.sub(r"\\\r?\n", " ", command).splitlines()


def _start_words(command: str) -> int:
    """`ray start` pairs among the command's words, comments left out, quoted commands included."""
    words = [w for line in _lines(command) for w in _words(line)]
    return sum(1 for a, b in zip(words, words[1:]) if (a == "ray" or a.endswith("/ray")) and b == "start")


def _auth_of_starts(command: str, inherited: str | None) -> list[str | None]:
    """RAY_AUTH_MODE as each `ray start` of the command sees it, the shell starting with `inherited`."""
    exported, found = inherited, []
    segment: list[str] = []
    # a newline ends a command as ';' does (shlex drops it); each line lexed alone, so a comment ends with its line
    for word in [w for line in _lines(command) for w in [*_lex(line), ";"]]:
        if word not in _SEPARATORS:
            segment.append(word)
            continue
        words, segment = segment, []
        if words[:1] == ["{"]:  # a group runs in this shell: its export stays
            words = words[1:]
        if words[:1] == ["export"]:
            for w in words[1:]:
                if w.startswith("RAY_AUTH_MODE="):
                    exported = w.split("=", 1)[1]
            continue
        mode, i = exported, 0
        # assignments and the launchers a command may run under (sudo VAR=v, nohup, exec, a subshell)
        while i < len(words) and (words[i] in _LAUNCHERS or "=" in words[i] and words[i].split("=", 1)[0].isidentifier()):
            if words[i] in _RESETS_ENV:  # only assignments after sudo reach its command (sudo VAR=v ray start)
                mode = None
            if words[i].startswith("RAY_AUTH_MODE="):
                mode = words[i].split("=", 1)[1]
            i += 1
        if any(w in _RESETS_ENV for w in words[i:i + 1]):  # su - user -c '...': a login shell's own environment
            mode = None
        if i + 1 < len(words) and (words[i] == "ray" or words[i].endswith("/ray")) and words[i + 1] == "start":
            found.append(mode)
        for word in words[i:]:  # a command a shell runs (bash -lc '...'), in this command's environment
            if any(c.isspace() for c in word):
                found += _auth_of_starts(word, mode)
    return found


def _words(command: str) -> list[str]:
    """The shell words of a command, with `;`, `&&`, `|` as words of their own, and the words of
    any quoted command inside it (`bash -lc 'conda activate x && ray start ...'`) after it."""
    words = _lex(command)
    return words + [w for word in words if any(c.isspace() for c in word) for w in _words(word)]


def _lex(command: str) -> list[str]:
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:  # an unbalanced quote: the plain words
        return command.split()


def _options(command: str, name: str) -> list[str]:
    """Every value given to `name` (a repeated flag: Ray takes the last, we check them all)."""
    words = _words(command)
    found = []
    for i, word in enumerate(words):
        if word == name and i + 1 < len(words):
            found.append(words[i + 1])
        elif word.startswith(name + "="):
            found.append(word.split("=", 1)[1])
    return found


def _security_group_issues(config: dict) -> list[SpecIssue]:
    provider = config.get("provider") or {}
    issues = []
    if provider.get("type") == "aws":
        for name, node in (config.get("available_node_types") or {}).items():
            if not (node.get("node_config") or {}).get("SecurityGroupIds"):
                issues.append(SpecIssue(f"available_node_types.{name}.node_config.SecurityGroupIds",
                                        "must name your security group: the group Ray creates by itself opens SSH to 0.0.0.0/0"))
    group = provider.get("security_group") or {}
    rules = (group.get("IpPermissions") if isinstance(group, dict) else None) or []
    for i, rule in enumerate(rules if isinstance(rules, list) else [rules]):
        where = f"provider.security_group.IpPermissions[{i}]"
        # Ray's schema does not look inside the security group: a malformed rule was a traceback here
        ranges = [rule.get(k) if isinstance(rule, dict) else None for k in ("IpRanges", "Ipv6Ranges")]
        if not isinstance(rule, dict) or not all(r is None or isinstance(r, list) and all(isinstance(e, dict) for e in r)
                                                 for r in ranges):
            issues.append(SpecIssue(where, "must be a mapping whose IpRanges and Ipv6Ranges are lists of mappings "
                                    "({CidrIp: ...} / {CidrIpv6: ...})", rule, True))
            continue
        cidrs = [r.get("CidrIp") for r in ranges[0] or []] + [r.get("CidrIpv6") for r in ranges[1] or []]
        if not any(c in _OPEN for c in cidrs):
            continue
        try:
            low, high = _ports(rule)
        except (TypeError, ValueError):
            issues.append(SpecIssue(f"{where}.FromPort", "FromPort and ToPort must be port numbers", rule.get("FromPort"), True))
            continue
        exposed = [f"{p} ({what})" for p, what in RAY_PORTS.items() if low <= p <= high]
        if low <= 22 <= high:
            exposed.append("22 (SSH: open it to an admin CIDR only)")
        if exposed:
            issues.append(SpecIssue(where, f"opens {', '.join(exposed)} to the internet", cidrs, True))
    return issues


def _ports(rule: dict) -> tuple[int, int]:
    if str(rule.get("IpProtocol")) == "-1" or rule.get("FromPort", -1) == -1:
        return 0, 65535
    return int(rule.get("FromPort", 0)), int(rule.get("ToPort", rule.get("FromPort", 0)))


def pins(constraints: str) -> dict[str, str]:
    out = {}
    with open(constraints) as f:
        for line in f:
            name, sep, version = line.split("#")[0].strip().partition("==")
            if sep:
                out[name.strip().lower()] = version.strip()
    return out


def version_issues(config: dict, constraints: str) -> list[SpecIssue]:
    """Every image a node runs must have the Ray and Python constraints.txt was tested with:
    docker.image, the head and worker images that replace it, and a node type's own worker
    image (only docker.image was checked, not the images the nodes actually start)."""
    want = pins(constraints).get("ray")
    docker = config.get("docker") or {}
    # docker.image only where a node runs it: both head_image and worker_image replace it
    keys = ("head_image", "worker_image") if docker.get("head_image") and docker.get("worker_image") else ("image", "head_image", "worker_image")
    images = [(f"docker.{key}", docker.get(key)) for key in keys]
    images += [(f"available_node_types.{name}.docker.worker_image", ((node or {}).get("docker") or {}).get("worker_image"))
               for name, node in (config.get("available_node_types") or {}).items() if isinstance(node, dict)]
    return [issue for field, image in images if image for issue in _image_issues(field, str(image), want)]


def _image_issues(field: str, image: str, want: str | None) -> list[SpecIssue]:
    name = image.rsplit("/", 1)[-1].split("@", 1)[0]  # tag@digest: the tag still says which Ray
    if ":" not in name:  # a digest alone or no tag: nothing says which Ray it holds
        return [SpecIssue(field, f"has no version tag, so its Ray cannot be checked against constraints.txt (ray=={want}); "
                          f"use a tag such as rayproject/ray:{want}-py311", image, True)] if want else []
    tag = name.rsplit(":", 1)[-1]
    if want and not tag.startswith(want):
        return [SpecIssue(field, f"runs Ray {tag.split('-')[0]}, but constraints.txt pins ray=={want}", image, True)]
    py = re.search(r"-py(\d)(\d+)", tag)
    if py and f"{py.group(1)}.{py.group(2)}" != "3.11":
        return [SpecIssue(field, "Python must be 3.11, the version constraints.txt was resolved for", image, True)]
    return []


def gcs_port(gcs_address: str) -> int:
    """The port of a host:port GCS address; SpecError naming the option when it has none."""
    host, sep, port = gcs_address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SpecError([SpecIssue("--gcs-address", "must be host:port, e.g. 127.0.0.1:6380", gcs_address, True)])
    return int(port)


def node_type_issues(config: dict) -> list[SpecIssue]:
    """What local_config needs: the node types as a mapping, the head type one of them."""
    types = config.get("available_node_types")
    if not isinstance(types, dict) or not types:
        return [SpecIssue("available_node_types", "a mapping of node types (head, workers) is needed", types, "available_node_types" in config)]
    issues = [SpecIssue(f"available_node_types.{name}", "a node type must be a mapping (resources, node_config, ...)", node, True)
              for name, node in types.items() if not isinstance(node, dict)]
    head = config.get("head_node_type")
    if head not in types:
        issues.append(SpecIssue("head_node_type", f"must name one of available_node_types ({', '.join(map(str, types))})",
                                head, "head_node_type" in config))
    return issues


def local_config(config: dict, gcs_address: str, object_store_bytes: int = 150 * 1024 * 1024) -> dict:
    """A fake multi-node config (`RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=...`)
    with cluster.yaml's worker node types, resources and min/max workers. The head type is
    renamed to the fake provider's `ray.head.default`; GPUs are logical. SpecError naming the
    field when the file has no usable node types."""
    gcs_port(gcs_address)
    if issues := node_type_issues(config):
        raise SpecError(issues)
    types = {}
    for name, node in config["available_node_types"].items():
        if name == config["head_node_type"]:
            continue
        resources = dict(node.get("resources") or {})
        resources.setdefault("object_store_memory", object_store_bytes)
        types[name] = {"resources": resources, "node_config": {}, "min_workers": node.get("min_workers", 0),
                       "max_workers": node.get("max_workers", 1)}
    head = dict(config["available_node_types"][config["head_node_type"]].get("resources") or {})
    types["ray.head.default"] = {"resources": head, "node_config": {}, "max_workers": 0}
    return {
        "cluster_name": f"{config.get('cluster_name', 'rayload')}-local", "max_workers": config.get("max_workers", 4),
        "upscaling_speed": config.get("upscaling_speed", 1.0), "idle_timeout_minutes": config.get("idle_timeout_minutes", 5),
        "provider": {"type": "fake_multinode", "gcs_address": gcs_address, "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True},
        "available_node_types": types, "head_node_type": "ray.head.default",
        "docker": {}, "auth": {"ssh_user": "ubuntu"}, "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [],
        "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }
