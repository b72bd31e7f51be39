"""A Ray head started with `ray start --head` for end-to-end tests, and stopped by killing only
the processes it started (found by its own temp dir), never `ray stop`, which would take down
every Ray on the machine. Redis holds 6379 here, so the head gets other ports."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil

BIN = os.path.dirname(sys.executable)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_TAKEN: set[int] = set()


def free_port() -> int:
    """A free port below the kernel's ephemeral range (32768+) and above Ray's worker ports
    (10002-19999): a port from bind(0) can be taken by one of Ray's own random binds before
    the component it was meant for starts."""
    import random

    while True:
        port = random.randint(20000, 29999)
        if port in _TAKEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _TAKEN.add(port)
        return port


def ensure_token() -> str:
    """The client token; generated (as `ray get-auth-token --generate` does) when absent."""
    path = os.path.expanduser("~/.ray/auth_token")
    if not os.path.exists(path):
        # The `ray` script beside this interpreter, or Ray's CLI module where Ray was put on the
        # path without its scripts (a lent GPU machine: benchmarks/gpu_session.sh).
        cli = [os.path.join(BIN, "ray")] if os.path.exists(os.path.join(BIN, "ray")) else [sys.executable, "-m", "ray.scripts.scripts"]
        subprocess.run([*cli, "get-auth-token", "--generate"], check=True, capture_output=True, timeout=60)
    with open(path) as f:
        return f.read().strip()


class Head:
    def __init__(self, num_cpus: int = 2, autoscaling_config: dict | None = None, env: dict | None = None):
        # Short paths: Ray's unix sockets live under the temp dir (107-byte limit).
        self.dir = tempfile.mkdtemp(prefix="rl-", dir="/tmp")
        self.port, self.dashboard = free_port(), free_port()
        self.home = os.path.join(self.dir, "home")
        self.ip = _node_ip()
        self.gcs = f"{self.ip}:{self.port}"
        self.url = f"http://127.0.0.1:{self.dashboard}"
        self.env = dict(os.environ, RAY_AUTH_MODE="token", RAYLOAD_HOME=self.home, PATH=f"{BIN}:{os.environ['PATH']}", **(env or {}))
        self.env.pop("RAY_ADDRESS", None)
        cmd = [os.path.join(BIN, "ray"), "start", "--head", f"--port={self.port}", f"--num-cpus={num_cpus}",
               f"--dashboard-port={self.dashboard}", f"--dashboard-agent-listen-port={free_port()}",
               f"--ray-client-server-port={free_port()}", "--object-store-memory=300000000", f"--temp-dir={self.dir}/ray",
               "--disable-usage-stats"]
        if autoscaling_config is not None:
            import json

            path = os.path.join(self.dir, "autoscaling.json")
            with open(path, "w") as f:
                json.dump(autoscaling_config(self.gcs) if callable(autoscaling_config) else autoscaling_config, f)
            cmd.append(f"--autoscaling-config={path}")
            self.env.update(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1",
                            # The fake provider starts worker raylets from the autoscaler's process,
                            # which carries Ray's jemalloc LD_PRELOAD into every worker; torch's MKL
                            # then cannot load there. Real nodes start their own raylets.
                            RAY_JEMALLOC_LIB_PATH="", LD_PRELOAD="")
        out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=120)
        try:
            if out.returncode != 0:
                raise RuntimeError(f"ray start failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")
            _wait_http(f"{self.url}/api/version", 90)
        except Exception:
            self.stop()  # never leave a half-started head running for the rest of the suite
            raise

    def run(self, *args, timeout=600, env: dict | None = None, cwd: str = ROOT):
        return subprocess.run(list(args), cwd=cwd, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout)

    def job_submit(self, *entrypoint, timeout=600, working_dir: bool = True):
        """`ray job submit --working-dir .` from the repository, as the README says (or, with
        working_dir=False, a job that runs the installed package on paths it is given)."""
        upload = ["--working-dir", "."] if working_dir else []
        return self.run(os.path.join(BIN, "ray"), "job", "submit", f"--address={self.url}", *upload, "--",
                        *entrypoint, timeout=timeout)

    def processes(self) -> list[psutil.Process]:
        mine = []
        for p in psutil.process_iter(["cmdline", "environ"]):
            try:
                text = " ".join(p.info["cmdline"] or [])
            except (psutil.Error, TypeError):
                continue
            if self.dir in text:
                mine.append(p)
        return mine

    def stop(self) -> None:
        procs = self.processes()
        for p in procs:
            _signal(p, signal.SIGTERM)
        # Some of Ray's processes never exit on SIGTERM; waiting 10 s for them cost every head 10 s.
        _, alive = psutil.wait_procs(procs, timeout=3)
        for p in alive:
            _signal(p, signal.SIGKILL)
        # Workers and agents whose command line does not name the dir are the raylets' children.
        for p in psutil.process_iter(["ppid", "name"]):
            if p.info["ppid"] == 1 and (p.info["name"] or "").startswith("ray::") and _in_dir(p, self.dir):
                _signal(p, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


def _in_dir(p: psutil.Process, folder: str) -> bool:
    try:
        return any(folder in (f.path or "") for f in p.open_files()) or folder in (p.cwd() or "")
    except psutil.Error:
        return False


def _signal(p: psutil.Process, sig) -> None:
    try:
        p.send_signal(sig)
    except psutil.Error:
        pass


def _node_ip() -> str:
    import ray._private.services as services

    return services.get_node_ip_address()


def _wait_http(url: str, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout}s")
