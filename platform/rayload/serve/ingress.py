"""How clients reach an A/B experiment's router: through Ray Serve's HTTP proxy at
`serving.host:port`, or with `serving.ingress: direct` at each router replica's own port
(Ray Serve's direct ingress). The direct ports are read from Serve's target groups, the
routing table Serve publishes for load balancers; a Serve running without direct ingress is
recognised from the same table and refused with the fix.
"""

from __future__ import annotations

import logging
import time

from ..errors import RayloadError

log = logging.getLogger(__name__)


def direct_ingress_env() -> dict[str, str]:
    """What an embedded local Ray needs for `serving.ingress: direct`. Ray Serve reads both
    settings only from its processes' environment:
    - RAY_SERVE_ENABLE_DIRECT_INGRESS=1: every ingress replica runs its own HTTP server on a
      port from Serve's range (30000-31000 unless RAY_SERVE_DIRECT_INGRESS_MIN/MAX_HTTP_PORT say
      otherwise), so a request skips the proxy actor and its handle hop. Serve still runs one
      proxy on the head node at serving.host:port, which keeps answering for every app.
    - a 2 s drain instead of Serve's 30: a stopping direct-ingress replica keeps answering that
      long so that a load balancer in front can deregister it; the embedded Ray has none in
      front, and a stop, rollback or restart would otherwise wait half a minute."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}


NO_DIRECT_INGRESS = (
    "serving.ingress: direct, but this Ray cluster's Serve runs without direct ingress (or behind HAProxy, whose routing "
    "table rayload does not read), so the router would be reachable only through the proxy at {proxy}. Start every node "
    "with RAY_SERVE_ENABLE_DIRECT_INGRESS=1 in the environment of `ray start` (cluster.yaml), let rayload start its own "
    "Ray (no --address, in a process that has not started Ray yet), or set serving.ingress: proxy")


def _proxy_url(serving: dict) -> str:
    return f"http://{serving['host']}:{serving['port']}{serving['route_prefix'].rstrip('/')}"


def proxy_serving(serving: dict) -> dict:
    """`serving` with the host and port Serve's proxy really listens on: Serve keeps the HTTP
    options it was first started with (another experiment's, or `serve start`'s) and ignores
    a later deploy's, so this spec's serving.port can be one where nothing answers."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:  # Serve not running: nothing to read (the deploy starts it with this spec's)
        return serving
    live = client.http_config
    # A wildcard bind is reached at the spec's host (its own loopback or address); a fixed one only there
    host = serving["host"] if live.host in ("0.0.0.0", "::", "") else live.host
    if (host, live.port) != (serving["host"], serving["port"]):
        log.warning("Serve's proxy was started earlier on %s:%s and keeps it: serving.host:port %s:%s of this spec is "
                    "ignored (stop Serve first, or set serving.port: %s, to have them agree)",
                    live.host, live.port, serving["host"], serving["port"], live.port)
    return {**serving, "host": host, "port": live.port}


def check_direct_ingress(serving: dict) -> None:
    """Refuse `ingress: direct` on a Serve that runs without it, before anything is deployed,
    where that can be told: Serve publishes a target group per running app only with direct
    ingress on (through the proxy every group has app_name ''), so it shows once some app runs."""
    if serving.get("ingress", "proxy") != "direct":
        return
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:  # Serve not started yet: nothing runs, nothing to tell from
        return
    details = client.get_serve_details()
    # Serve publishes groups only for apps with an HTTP route (handle-only apps have none).
    running = [name for name, app in (details.get("applications") or {}).items()
               if app.get("status") == "RUNNING" and app.get("route_prefix") is not None]
    if running and not any(g.get("app_name") for g in details.get("target_groups") or []):
        raise RayloadError(NO_DIRECT_INGRESS.format(proxy=_proxy_url(serving)))


def ingress_urls(serving: dict, app: str, wait_s: float = 30, every_replica: bool = True) -> list[str]:
    """Where clients reach a running app's router: Serve's proxy at host:port, or with
    `ingress: direct` each router replica's own (node, port), read from Serve's target groups
    (the routing table Serve publishes for load balancers). A replica that Serve replaces
    gets a new port, so callers that use the URLs later ask again (`live_urls`, which takes
    the replicas that answer now: `every_replica=False`)."""
    if serving.get("ingress", "proxy") == "proxy":
        return [_proxy_url(proxy_serving(serving))]
    import ray
    from ray.serve.context import _get_global_client

    here = ray.util.get_node_ip_address()
    client = _get_global_client()
    # The replicas bind the host Serve was first started with (a later serve.start's options are
    # ignored), which need not be this spec's serving.host.
    bound = {**serving, "host": client.http_config.host}
    need = serving["replicas"] if every_replica else 1
    deadline = time.monotonic() + wait_s
    while True:
        urls = urls_from_target_groups(client.get_serve_details().get("target_groups") or [], bound, app, here, need)
        if urls is not None:
            return urls
        if time.monotonic() > deadline:
            raise RayloadError(f"serving.ingress: direct: fewer than {need} router replica(s) of {app} had an HTTP "
                               f"port within {wait_s:.0f} s (Serve's port range may be taken; see "
                               "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT)")
        time.sleep(0.25)


def urls_from_target_groups(groups: list[dict], serving: dict, app: str, here: str, need: int) -> list[str] | None:
    """The router replicas' URLs from Serve's target groups (one per (node, port): each node
    hands out ports from the same range), or None while fewer than `need` replicas have a port.
    serving["host"]: the host the replicas bind; `here`: this node's IP, where a loopback host
    reaches them."""
    ours = [g for g in groups if g.get("app_name") == app and g.get("protocol") == "HTTP"]
    if not ours:
        raise RayloadError(NO_DIRECT_INGRESS.format(proxy=_proxy_url(serving)))
    targets = sorted({(t["ip"], t["port"]) for g in ours for t in g["targets"] if t["name"].startswith("SERVE_REPLICA::")})
    wildcard = serving["host"] in ("0.0.0.0", "::", "")
    remote = sorted({ip for ip, _ in targets if ip != here})
    if remote and not wildcard:
        raise RayloadError(f"ingress: direct with Serve's HTTP host {serving['host']}: router replicas run on other nodes "
                           f"({', '.join(remote)}) and listen on that host there, out of reach; start Serve with host 0.0.0.0 "
                           "(serving.host: 0.0.0.0 for the experiment that starts Serve on the cluster, or `serve start "
                           "--http-host 0.0.0.0`) and open Serve's ports 30000-31000 to your clients only")
    if len(targets) < need:
        return None
    prefix = serving["route_prefix"].rstrip("/")
    return [f"http://{ip if wildcard else serving['host']}:{port}{prefix}" for ip, port in targets]
