"""Operations: `rayload submit` (a job through Ray's job API with the right runtime env and
token) and `rayload doctor` (a pass/fail list of what a cluster needs)."""

from __future__ import annotations

import glob
import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass

from ._upload import UPLOAD_EXCLUDES, check_spec  # noqa: F401  (never uploaded with a job; the pre-upload check)
from .errors import RayloadError
from .paths import shown_url


def token() -> str | None:
    """The client's token: $RAY_AUTH_TOKEN, else the token file ($RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token)."""
    from ._ray import token_path

    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = token_path()
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip() or None
    return None


def entrypoint(spec: str, extra: list[str]) -> list[str]:
    """`rayload run SPEC` (any spec kind) with the uploaded code (`python -m rayload`)."""
    return ["python", "-m", "rayload", "run", spec, *extra]


def check_job_api(address: str, auth: str | None, timeout: float = 10.0) -> None:
    """Reachable, and our token (or none) accepted; otherwise say which of the two failed."""
    import httpx

    headers = {"Authorization": f"Bearer {auth}"} if auth else {}
    try:
        r = httpx.get(f"{address.rstrip('/')}/api/jobs/", headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise RayloadError(f"cannot reach the Ray job API at {address} ({type(exc).__name__}: {exc}); is the cluster up, and "
                           "for a `ray up` cluster is `ray dashboard cluster.yaml` (the SSH tunnel) running?") from None
    from ._ray import token_path

    if r.status_code == 401:
        raise RayloadError(f"the cluster at {address} requires a token and none was found: set RAY_AUTH_TOKEN or write it "
                           f"to {token_path()} (or name a file in RAY_AUTH_TOKEN_PATH; the cluster's token is `ray get-auth-token` "
                           "on the head)")
    if r.status_code == 403:
        where = "RAY_AUTH_TOKEN" if os.environ.get("RAY_AUTH_TOKEN") else token_path()  # the file really read
        raise RayloadError(f"the cluster at {address} refused the token in {where} (403): it is not this cluster's token")
    if r.status_code >= 400:
        raise RayloadError(f"the Ray job API at {address} answered {r.status_code}: {r.text[:200]}")


def submit(spec: str, address: str, sets=(), working_dir: str = ".", env: dict | None = None,
           wait: bool = True, on_log=None, home: str | None = None) -> tuple[str, str]:
    """Submit `rayload run SPEC --set ...` as a Ray job; returns (job id, final status or PENDING).
    `home`: the job's RAYLOAD_HOME on the cluster (an absolute path there); without it the
    cluster's own applies (cluster.yaml sets one), else ~/rayload-runs on the node the job runs on."""
    from ray.job_submission import JobSubmissionClient

    if not os.path.exists(spec):
        raise RayloadError(f"spec file not found: {spec}")
    relative = os.path.relpath(os.path.abspath(spec), os.path.abspath(working_dir))
    if relative.startswith(".."):
        raise RayloadError(f"the spec {spec} is outside the working directory {working_dir}: it would not be uploaded")
    if home is not None and not (os.path.isabs(home) or home.startswith("~") or "://" in home):
        raise RayloadError(f"--home must be an absolute path on the cluster (got {home!r}): a relative one would be "
                           "inside the job's temporary upload folder")
    if "://" not in address:  # `ray job submit` takes host:port; the HTTP client needs the scheme
        address = f"http://{address}"
    check_spec(spec, sets, working_dir)
    auth = token()
    headers = {"Authorization": f"Bearer {auth}"} if auth else None
    with _address_env_cleared():
        url = address.rstrip("/")
        check_job_api(url, auth)
        client = JobSubmissionClient(url, headers=headers)
    if client.get_address() != url:  # the job and the token go where the client points: the cluster just checked
        raise RayloadError(f"the Ray job client resolved {address} to {client.get_address()}, not the checked {url}")
    homes = {"RAYLOAD_HOME": home} if home else {}
    runtime_env = {"working_dir": working_dir, "excludes": UPLOAD_EXCLUDES,
                   # the uploaded platform/ first: the job runs the code that was submitted
                   "env_vars": {"PYTHONPATH": "platform", **_commit_env(working_dir), **homes, **(env or {})}}
    extra = [a for item in sets for a in ("--set", item)]
    job_id = client.submit_job(entrypoint=" ".join(_quote(a) for a in entrypoint(relative, extra)), runtime_env=runtime_env)
    if not wait:
        return job_id, "PENDING"
    import asyncio

    async def tail():
        async for lines in client.tail_job_logs(job_id):
            (on_log or print)(lines, end="")

    asyncio.run(tail())
    return job_id, str(client.get_job_status(job_id).value)


@contextmanager
def _address_env_cleared():
    """Ray's job client takes $RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS, over the address it is
    given: with them left in the shell for another cluster, the job and this cluster's token would
    go there. The address given is the one used; they are cleared while the client is built."""
    saved = {k: os.environ.pop(k) for k in _ADDRESS_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


_ADDRESS_ENV = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")


def _commit_env(working_dir: str) -> dict:
    """The upload has no .git: send the commit so the run's manifest still names it."""
    import subprocess

    try:
        out = subprocess.run(["git", "-C", working_dir, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        commit = out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"RAYLOAD_GIT_COMMIT": commit} if commit else {}


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


# ---------------------------------------------------------------- doctor


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def doctor(address: str | None = None, specs: str = "jobs", serve_port: int = 8000) -> list[Check]:
    checks = [_ray_check(address)]
    if not checks[0].ok:
        return checks
    checks += [_versions(), _auth(), _storage(), _port(serve_port)]
    if not os.path.isdir(specs) or not glob.glob(os.path.join(specs, "*.yaml")):  # nothing to check had read as two passes
        return checks + [Check("specs", True, f"skipped: no *.yaml specs in {specs!r}, so no GPU or database check; give --specs "
                                              "the folder of the specs you will run")]
    return checks + [_gpus(specs), *_databases(specs)]


def _ray_check(address: str | None) -> Check:
    from ._ray import ensure_ray

    try:
        ensure_ray(address)  # an unreachable host:port fails within seconds, naming it
    except RayloadError as exc:  # nothing answers there: named by ensure_ray
        return Check("Ray reachable", False, str(exc))
    except Exception as exc:  # noqa: BLE001 - any failure to connect is the finding
        return Check("Ray reachable", False, f"{type(exc).__name__}: {exc}")
    import ray

    from .train.resources import alive_nodes

    nodes = alive_nodes()
    return Check("Ray reachable", True, f"{ray.get_runtime_context().gcs_address}, {len(nodes)} node(s) alive")


def _versions() -> Check:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def versions():
        import ray as r

        import rayload

        return r.__version__, rayload.__version__

    from .train.resources import alive_nodes

    nodes = [n["NodeID"] for n in alive_nodes()]
    refs = [versions.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote() for n in nodes]
    try:
        found = dict(zip(nodes, ray.get(refs, timeout=60)))
    except Exception as exc:  # noqa: BLE001
        return Check("same versions on every node", False, f"could not ask every node: {type(exc).__name__}: {exc}")
    from . import __version__

    mine = (ray.__version__, __version__)
    odd = {n[-6:]: v for n, v in found.items() if v != mine}
    detail = f"ray {mine[0]}, rayload {mine[1]} on {len(found)} node(s)"
    return Check("same versions on every node", not odd, detail if not odd else f"{detail}; differ: {odd}")


_AUTH_OFF = "OFF: anyone who reaches the cluster's ports can run code; start it with RAY_AUTH_MODE=token"


def _auth(dashboard: str | None = None) -> Check:
    """Whether the cluster (not this client, which turns token mode on by itself when it finds a
    token file) requires a token: its job API asked without one answers 401 when it does. Without
    a reachable dashboard, a Ray worker on the cluster says which mode its node started in."""
    name = "token authentication"
    url = dashboard if dashboard is not None else _dashboard_url()
    if url:
        required = auth_required(url)
        if required is not None:
            return Check(name, required, f"on: {url} refuses a request without the token" if required
                         else f"{_AUTH_OFF} ({url} answered a request without a token)")
    try:
        on = _cluster_auth_mode()
    except Exception as exc:  # noqa: BLE001 - the cluster could not be asked
        return Check(name, False, f"could not ask the cluster (no job API at {url or 'an address Ray knows'}; "
                     f"a task: {type(exc).__name__}: {exc})")
    return Check(name, on, "on (the mode a node of the cluster started in)" if on else _AUTH_OFF)


def auth_required(url: str, timeout: float = 5.0) -> bool | None:
    """Ask the job API at `url` without a token: True when it refuses (401/403, token auth on),
    False when it answers (off), None when it cannot be asked."""
    import httpx

    url = url if "://" in url else f"http://{url}"
    try:
        r = httpx.get(f"{url.rstrip('/')}/api/version", timeout=timeout)
    except httpx.HTTPError:
        return None
    if r.status_code in (401, 403):
        return True
    return False if r.status_code < 400 else None


def _dashboard_url() -> str | None:
    """The connected cluster's dashboard (job API) address, as its head recorded it."""
    try:
        import ray._private.worker as worker

        return worker.get_dashboard_url() or None
    except Exception:  # noqa: BLE001 - no dashboard (the embedded Ray starts none), or another Ray
        return None


def _cluster_auth_mode() -> bool:
    """The auth mode of a Ray worker process on the cluster: it inherits its node's `ray start`
    environment, not this client's."""
    import ray

    @ray.remote(num_cpus=0)
    def mode():
        try:
            from ray._raylet import AuthenticationMode, get_authentication_mode

            return get_authentication_mode() == AuthenticationMode.TOKEN
        except ImportError:
            return os.environ.get("RAY_AUTH_MODE") == "token"

    return ray.get(mode.remote(), timeout=60)


def _specs(folder: str):
    from ._spec_load import read_yaml

    for path in sorted(glob.glob(os.path.join(folder, "*.yaml"))):
        try:
            yield path, read_yaml(path)
        except Exception:  # noqa: BLE001 - a broken spec is `rayload validate`'s finding, not the doctor's
            continue


def _gpus(folder: str) -> Check:
    import ray
    from ray._private.state import state

    wanted = {}
    for path, raw in _specs(folder):
        res = raw.get("resources") or {}
        workers = res.get("workers", 1)
        workers = workers.get("min", 1) if isinstance(workers, dict) else workers
        if res.get("gpus_per_worker"):
            wanted[os.path.basename(path)] = workers * res["gpus_per_worker"]
    ceiling = (state.get_max_resources_from_cluster_config() or {}).get("GPU")
    present = ray.cluster_resources().get("GPU", 0)
    have = max(present, ceiling or 0)
    short = {k: v for k, v in wanted.items() if v > have}
    detail = f"specs ask for {wanted or 'no GPUs'}; cluster has {present:g}" + (f" (can grow to {ceiling:g})" if ceiling else "")
    return Check("GPUs for the specs", not short, detail if not short else f"{detail}; too few for {sorted(short)}")


def _storage() -> Check:
    from .paths import is_remote, local_path, runs_root
    from .train.resources import alive_nodes, is_shared

    nodes = alive_nodes()
    path = os.environ.get("RAYLOAD_STORAGE_PATH") or runs_root()
    if len(nodes) == 1:
        return Check("shared storage", True, f"one node: {path} is enough")
    ok = is_remote(path) or is_shared(local_path(path))  # file:// is a folder on this node like any other
    return Check("shared storage", ok, f"{path} {'is shared' if ok else 'is local to this node: set RAYLOAD_STORAGE_PATH (s3://...) or use a shared mount'}"
                 f" across {len(nodes)} nodes")


def _port(port: int) -> Check:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))  # every address: one held on another (127.0.0.2, a NIC) read free on loopback
        except OSError as exc:
            return Check(f"Serve port {port} free", False, f"in use ({exc.strerror}); serving.port in the A/B spec picks another")
    return Check(f"Serve port {port} free", True, "free on this machine")


def _databases(folder: str) -> list[Check]:
    urls = set()
    for _, raw in _specs(folder):
        for value in ((raw.get("events") or {}).get("url"), raw.get("storage")):
            if isinstance(value, str) and "://" in value and not value.startswith("sqlite"):
                urls.add(value)
    if not urls:
        return [Check("databases", True, "specs use SQLite in the run folders")]
    return [_db(url) for url in sorted(urls)]


def _db(url: str) -> Check:
    import sqlalchemy

    driver_url = url.replace("postgresql://", "postgresql+psycopg://", 1) if url.startswith("postgresql://") else url
    try:
        engine = sqlalchemy.create_engine(driver_url, connect_args={"connect_timeout": 5} if "postgresql" in url else {})
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("select 1"))
        engine.dispose()
    except Exception as exc:  # noqa: BLE001
        detail = str(exc).splitlines()[0].replace(driver_url, shown_url(driver_url)).replace(url, shown_url(url))
        return Check(f"database {shown_url(url)}", False, f"{type(exc).__name__}: {detail}")
    return Check(f"database {shown_url(url)}", True, "reachable")
