"""The one place that connects to Ray: an embedded local Ray by default, or a cluster address."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def _ray_log_level() -> int:
    """Ray's driver logs at rayload's level: its INFO lines (a started instance, Parquet encoding
    estimates, Ray Data's plans and progress) came with every command, while -v is what asks for
    INFO. Ray Data's own loggers follow the "ray" logger."""
    import ray.data  # noqa: F401  (configures its loggers on import: after it, or it would reset them)

    level = logging.INFO if logging.getLogger().getEffectiveLevel() <= logging.INFO else logging.WARNING
    for name in ("ray.data", "ray.tune", "ray.train"):
        logging.getLogger(name).setLevel(level)
    return level


def ensure_ray(address: str | None = None, num_cpus: int | None = None, env: dict[str, str] | None = None) -> None:
    """Connect once per process. `address` (or $RAY_ADDRESS) joins a running cluster.

    `env`: settings for the embedded local Ray's processes (Ray and Serve read some only from
    the environment of the processes they start). They are set for `ray.init()` alone, which
    starts the raylet that every later worker inherits its environment from; a user's own
    value wins, and a cluster that is joined keeps its own.

    A job started by `ray job submit` already runs inside its cluster; `ray.init()` with no
    address joins it there, and starts an embedded local Ray everywhere else, except where
    Ray's own rule applies first: a live cluster from `ray start` on this machine (named in
    /tmp/ray/ray_current_cluster) is joined.
    """
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        check_reachable(address)
        _token_env()
        try:
            ray.init(address=address, log_to_driver=True, logging_level=_ray_log_level())
        except ConnectionError as exc:  # something answers there, but not a Ray GCS that lets us in
            from .errors import RayloadError

            raise RayloadError(f"cannot connect to a Ray cluster at {address}: {exc}") from None
        log.info("connected to Ray at %s", address)
        return
    env = {k: v for k, v in (env or {}).items() if k not in os.environ}
    os.environ.update(env)
    level = _ray_log_level()
    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True, logging_level=level)
    finally:
        for k in env:
            os.environ.pop(k, None)
    ctx = ray.data.DataContext.get_current()
    # The cluster is ours alone: keep Ray Data's console output to one progress bar per pass.
    ctx.enable_operator_progress_bars = False
    _drop_worker_lines(EMBEDDED_NOISE + (QUIET_NOISE if level > logging.INFO else ()))
    log.info("started an embedded local Ray")


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """Raise RayloadError naming `address` when nothing listens at a host:port address: ray.init
    would retry an unreachable GCS for about 14 minutes, then raise with a traceback. `auto`
    (Ray's own lookup of a cluster on this machine), ray:// (the Ray client) and other URLs are
    left to ray.init."""
    import socket

    from .errors import RayloadError

    if "://" in address or address in ("auto", "local"):
        return
    if ":" not in address:  # ray.init raised "Invalid address format" (a ValueError traceback)
        raise RayloadError(f"not a Ray address: {address!r} (host:port of the cluster's GCS, e.g. {address}:6379; or auto)")
    host, port = address.rsplit(":", 1)
    host = host.strip("[]")  # [::1]:6379
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except ValueError:
        raise RayloadError(f"not a Ray address: {address!r} (host:port of the cluster's GCS, e.g. 10.0.0.5:6379)") from None
    except OSError as exc:
        raise RayloadError(f"nothing answers at {address} ({exc.strerror or exc}): is the cluster up, and is this its GCS "
                           "address (the head's host and `ray start --port`)?") from None


def token_path() -> str:
    """Where the client's token file is: $RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token (as Ray looks)."""
    return os.path.expanduser(os.environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token")


def embedded() -> bool:
    """Whether this process started the Ray it is connected to (ensure_ray's embedded local Ray,
    or a plain `ray.init()` here), which ends when this process ends; False when it joined a
    cluster, and in Ray's own worker processes."""
    try:
        import ray._private.worker as worker
    except ImportError:
        return False
    node = worker._global_node
    return bool(node is not None and node.head)


# Worker log lines that say nothing in the embedded Ray. Ray Train's PlacementGroupCleaner asks
# the State API (a dashboard module, which the embedded Ray does not start) whether the train
# controller is alive, once a second for the whole run, and logs a warning each time it cannot:
# about 1,100 lines in a 22-minute 2-worker run. Its job, removing the placement group of a
# controller that died with its driver still running, does not arise when the cluster is this
# process's own and ends with it. rayload's own `fit` in the embedded Ray runs without the
# cleaner (train.trainer._trainer_class); a TorchTrainer started inside a Tune trial's process
# (a search with more than one worker per trial) still has one, and its lines end here.
EMBEDDED_NOISE = ("Failed to query Ray Train Controller actor state",)
# Ray Data's INFO lines from workers (a trial's reads), shown by the driver whatever its level; with -v they stay
QUIET_NOISE = ("Progress bars disabled. To enable", "execution finished in")


def _drop_worker_lines(substrings: tuple[str, ...]) -> None:
    """Filter the worker log lines this driver prints (Ray's `log_to_driver` handler, wrapped
    in place once per `ray.init`; Ray removes it by name at shutdown) so that lines holding any
    of `substrings` are not shown. They stay in the session's log files."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:  # another Ray: its lines are shown as they are
        return

    def wrap(handler):
        def filtered(data):
            lines = [line for line in data.get("lines", ()) if not any(s in line for s in substrings)]
            if lines:
                handler({**data, "lines": lines})
        return filtered

    with dispatcher._lock:
        dispatcher.handlers = [(name, wrap(h) if name == "ray_print_logs" else h) for name, h in dispatcher.handlers]


def _token_env() -> None:
    """Ray 2.60 clusters require token auth: switch the client to token mode when a token is there
    ($RAY_AUTH_TOKEN, or the token file: $RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token) and
    RAY_AUTH_MODE does not say otherwise. (A token in RAY_AUTH_TOKEN alone left the client in
    auth-off mode, which a cluster with auth refuses.)

    Ray reads RAY_AUTH_MODE into its C++ config when it is imported, so setting the variable
    afterwards is not enough: Ray's own helper sets it and re-initialises that config (the same
    thing `ray.init()` does for a cluster it starts)."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    if "RAY_AUTH_TOKEN" not in os.environ and not os.path.exists(token_path()):  # the token given in the env counts too
        return
    try:
        from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available
    except ImportError:  # an older Ray without token auth
        os.environ["RAY_AUTH_MODE"] = "token"
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
