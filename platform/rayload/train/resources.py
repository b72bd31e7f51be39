"""Refuse, before training starts, what a cluster can never run: too few resources, local storage across nodes."""

from __future__ import annotations

import json
import logging
import os
import re

from ..errors import RayloadError

# Filesystems every node can see; a local path on any other filesystem is per-node.
# Matched whole, with a FUSE client's "fuse." prefix dropped (GlusterFS mounts as fuse.glusterfs,
# CephFS as fuse.ceph-fuse); a prefix match took /proc/fs/nfsd's "nfsd" for NFS.
_SHARED_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "ceph", "ceph-fuse", "glusterfs", "s3fs",
                        "gcsfuse", "juicefs", "efs"})


log = logging.getLogger(__name__)


class ResourceError(RayloadError):
    pass


def alive_nodes() -> list[dict]:
    """`ray.nodes()` entries of the nodes that are alive (Ray keeps dead ones in the list)."""
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def requested(resources) -> tuple[int, dict[str, float]]:
    """(minimum workers, resources of one worker)."""
    workers = resources.workers if isinstance(resources.workers, int) else resources.workers.min
    per = {"CPU": resources.cpus_per_worker}
    if resources.gpus_per_worker:
        per["GPU"] = resources.gpus_per_worker
    if resources.accelerator_type:
        per[f"accelerator_type:{resources.accelerator_type}"] = 0.001
    return workers, per


_JOB_FIELDS = "resources.workers / cpus_per_worker / gpus_per_worker"


def check_resources(resources, driver: dict[str, float] | None = None, fields: str = _JOB_FIELDS) -> None:
    """With an autoscaler, compare with the cluster config's maximum; else with the live nodes.
    `driver`: what the process that drives the workers holds besides them, on any node (a
    search's trial that starts a TorchTrainer holds a hundredth of a CPU). `fields`: the
    settings the message tells the user to lower (a search's trial_resources, tune_function's cpus)."""
    from ray._private.state import state

    workers, per = requested(resources)
    driver = {k: v for k, v in (driver or {}).items() if v}
    ceiling = state.get_max_resources_from_cluster_config()
    if not ceiling and _v1_autoscaler_running():
        # Autoscaler v1 (`ray up` default) does not publish its node types' limits: the
        # nodes may come, so leave the bound to resources.placement_timeout_s.
        log.info("an autoscaler runs but does not publish its limits; not checking %d x %s up front", workers, per)
        return
    keys = [*per, *(k for k in driver if k not in per)]
    if ceiling:
        nodes_can = {k: ceiling.get(k, 0) for k in keys}
        fits = _fits_total(workers, per, driver, nodes_can)
    else:
        alive = [n["Resources"] for n in alive_nodes()]
        nodes_can = {k: sum(n.get(k, 0) for n in alive) for k in keys}
        fits = _placeable(workers, per, alive) and _fits_total(workers, per, driver, nodes_can)
        if not fits and _fits_total(workers, per, driver, nodes_can):
            # the totals would do: no node is big enough ("asks for CPU=3 ... has CPU=4 in total" read as a fit)
            asked = ", ".join(f"{k}={v:g}" for k, v in per.items())
            # most workers placed, then the most of the scarcest resource asked: when no node places
            # one, the first node was named "the largest" (a CPU-only node for a GPU request)
            largest = max(alive, key=lambda n: (placeable_count(per, [n]), min(n.get(k, 0) / v for k, v in per.items())), default={})
            biggest = ", ".join(f"{k}={largest.get(k, 0):g}" for k in per)
            raise ResourceError(
                f"resources ask for {workers} worker(s) with {asked} each, and each worker must fit on one node: the "
                f"{len(alive)} node(s) place {placeable_count(per, alive)} (the largest has {biggest}; no autoscaler); "
                f"lower {fields}, or add bigger nodes")
    if not fits:
        asked = ", ".join(f"{k}={v:g}" for k, v in per.items()) + " each"
        if driver:
            asked += ", plus " + ", ".join(f"{k}={v:g}" for k, v in driver.items()) + " for the process that drives them"
        have = ", ".join(f"{k}={v:g}" for k, v in nodes_can.items())
        raise ResourceError(
            f"resources ask for {workers} worker(s) with {asked}, but the cluster "
            f"{'can grow to' if ceiling else 'has'} {have} in total{'' if ceiling else ' (no autoscaler)'}; "
            f"lower {fields} or add nodes"
        )


# Ray accounts resources in fixed point, in units of 1/10,000: counted in those units, 10
# workers of 0.1 CPU fill a 1-CPU node as Ray places them, where floats say 1.0 // 0.1 == 9.
_UNITS_PER_RESOURCE = 10_000


def _units(amount: float) -> int:
    return round(amount * _UNITS_PER_RESOURCE)


def _placeable(workers: int, per: dict[str, float], nodes: list[dict[str, float]]) -> bool:
    """Whether `workers` workers of `per` each fit on `nodes`, each worker on one node."""
    return placeable_count(per, nodes) >= workers


def placeable_count(per: dict[str, float], nodes: list[dict[str, float]]) -> int:
    """How many workers of `per` each fit on `nodes`, each worker on one node."""
    return sum(min(_units(n.get(k, 0)) // max(1, _units(v)) for k, v in per.items()) for n in nodes)


def elastic_max(resources, polls: int = 5, wait_s: float = 0.4) -> int:
    """The most workers an elastic group ({min, max}) starts with: max, capped at what the
    cluster's free resources place now (never below min). Ray Train's elastic policy sizes the
    group from the cluster's total resources, so on a cluster partly held by other work (serving
    replicas, another job) it asked for max workers and waited for resources that never came,
    failing after resources.placement_timeout_s instead of starting smaller. With an autoscaler
    the cap is left out: nodes can come for the rest. Free resources are polled a few times
    (`polls` x `wait_s`) while they place fewer than max, since what a run that just ended
    released reaches the cluster's view a moment later."""
    import time

    import ray

    low, high = resources.workers.min, resources.workers.max
    _, per = requested(resources)
    if cluster_can_grow():
        return high
    can = 0
    for attempt in range(polls):
        can = max(can, placeable_count(per, list(ray._private.state.available_resources_per_node().values())))
        if can >= high or attempt == polls - 1:
            break
        time.sleep(wait_s)
    capped = max(low, min(high, can))
    if capped < high:
        held = ", ".join(f"{k}={v:g}" for k, v in per.items())
        log.warning("resources.workers {min: %d, max: %d}: the cluster's free resources place %d worker(s) of %s now (other "
                    "work holds the rest); starting with at most %d", low, high, can, held, capped)
    return capped


PLACEMENT_TIMEOUT_S = 60.0
# A node an autoscaler starts takes minutes (a VM, a GPU image of several GB, setup commands):
# a group waiting for one failed at 60 s, on the first start and on every restart after a lost node.
GROWING_PLACEMENT_TIMEOUT_S = 900.0


START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # Ray Train reads the bound from it


def start_timeout(resources) -> float:
    """How long a worker group may wait to be placed: resources.placement_timeout_s where set,
    else a user's own RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, else 60 s, or 15 minutes where an
    autoscaler can add nodes."""
    if resources.placement_timeout_s is not None:
        return float(resources.placement_timeout_s)
    if START_TIMEOUT_ENV in os.environ:
        return float(os.environ[START_TIMEOUT_ENV])
    return GROWING_PLACEMENT_TIMEOUT_S if cluster_can_grow() else PLACEMENT_TIMEOUT_S


def placement_timed_out(resources, timeout: float, fields: str = _JOB_FIELDS) -> str:
    """Ray Train's WorkerGroupStartupTimeoutError said as rayload's: what was asked, what the
    cluster has now, and the setting to raise (its own advice, an environment variable, is one
    rayload sets from resources.placement_timeout_s)."""
    workers, per = requested(resources)
    alive = [n["Resources"] for n in alive_nodes()]
    have = ", ".join(f"{k}={sum(n.get(k, 0) for n in alive):g}" for k in per)
    asked = ", ".join(f"{k}={v:g}" for k, v in per.items())
    return (f"the worker group was not placed within {timeout:g} s (resources.placement_timeout_s): resources ask for {workers} "
            f"worker(s) with {asked} each; the cluster's {len(alive)} live node(s) have {have} in total and place "
            f"{placeable_count(per, alive)}. Other work may hold them, or nodes were still starting: raise "
            f"resources.placement_timeout_s, lower {fields}, or add nodes")


def elastic_wait_bound(resources):
    """A Ray Train controller callback that ends an elastic run whose group has waited longer
    than `start_timeout` to be started (first, or again after a failure) while the live nodes
    place fewer than `min` workers. Ray's elastic policy makes no placement then (so no placement
    timeout applies): after a lost node, on a cluster that cannot grow, it waited forever. A wait
    while the nodes do place `min` is Ray's queue (another elastic run, or a killed driver's
    request that lapses after 3 minutes, holds the resources) and is left to Ray."""
    import time

    from ray.train.v2._internal.execution.callback import ControllerCallback

    bound, low = start_timeout(resources), resources.workers.min
    waiting = ("InitializingState", "RestartingState", "ReschedulingState")

    class ElasticWaitBound(ControllerCallback):
        def __init__(self):
            self.since = None

        def after_controller_state_update(self, previous_state, current_state):
            if type(current_state).__name__ not in waiting:
                self.since = None
                return
            _, per = requested(resources)
            alive = [n["Resources"] for n in alive_nodes()]
            if (can := placeable_count(per, alive)) >= low:
                self.since = None
                return
            now = time.monotonic()
            self.since = self.since if self.since is not None else now
            if now - self.since > bound:
                raise ResourceError(
                    f"resources.workers {{min: {low}, max: {resources.workers.max}}}: the worker group waited {bound:g} s "
                    f"(resources.placement_timeout_s) for nodes that place {low} worker(s) of "
                    f"{', '.join(f'{k}={v:g}' for k, v in per.items())}; the {len(alive)} live node(s) place "
                    f"{can}. Add nodes or lower min; a relaunch with the same train.run_name resumes")

    return ElasticWaitBound()


def cluster_can_grow() -> bool:
    """Whether an autoscaler can add nodes (one that publishes its limits, or autoscaler v1)."""
    from ray._private.state import state

    return bool(state.get_max_resources_from_cluster_config()) or _v1_autoscaler_running()


def _fits_total(workers: int, per: dict[str, float], driver: dict[str, float], have: dict[str, float]) -> bool:
    return all(_units(per.get(k, 0)) * workers + _units(driver.get(k, 0)) <= _units(v) for k, v in have.items())


def _v1_autoscaler_running() -> bool:
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

    if not _internal_kv_initialized():
        return False
    raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
    if not raw:
        return False
    report = json.loads(raw).get("autoscaler_report") or {}
    # A plain `ray start`/`ray.init` runs a read-only monitor that names every node "node_<id>";
    # an autoscaler with a cluster config names them by its node types (head, gpu_worker, ...).
    types = set(report.get("active_nodes") or {}) | set(report.get("pending_launches") or {})
    return any(not t.startswith("node_") for t in types)


STORAGE_FIX = ("Set train.storage_path or RAYLOAD_STORAGE_PATH to shared storage (s3://bucket/path, gs://..., or an NFS "
               "mount; RAYLOAD_SHARED_PATHS declares mounts /proc/mounts cannot tell).")
SEARCH_FIX = ("A search keeps its trials' checkpoints in its run folder: set RAYLOAD_HOME to a folder every node mounts "
              "(NFS, EFS; RAYLOAD_SHARED_PATHS declares mounts /proc/mounts cannot tell).")


def check_storage(storage_path: str, what: str = "train.storage_path", fix: str = STORAGE_FIX) -> None:
    """A multi-node run needs checkpoint storage that every node reaches: object storage, or a
    folder on a shared mount (a file:// URI names a folder like any other)."""
    from ..paths import is_remote, local_path

    if is_remote(storage_path) or is_shared(local_path(storage_path)):
        return
    nodes = alive_nodes()
    if len(nodes) > 1:
        raise ResourceError(
            f"{what} {storage_path!r} is a local folder, but the cluster has {len(nodes)} nodes: "
            f"workers on other nodes could not write or read checkpoints. {fix}"
        )
    if cluster_can_grow():  # one node now; the workers may start on nodes it adds (cluster.yaml's head holds none)
        raise ResourceError(
            f"{what} {storage_path!r} is a local folder, and an autoscaler can add nodes to this cluster: workers "
            f"started on them could not write or read checkpoints (Ray failed at the first checkpoint). {fix}"
        )


def check_writable(storage_path: str, given: str | None) -> None:
    """A local checkpoint folder this process can write (or make): before Ray and the data,
    making nothing (a refused launch leaves no folder behind). A read-only mount or a file
    there failed only when the first checkpoint was written, with a bare OSError (a
    traceback), after the whole preprocessing. `given`: the job's train.storage_path; without
    it the folder came from the environment, named so."""
    from ..errors import RayloadError
    from ..paths import is_remote, local_path

    if is_remote(storage_path):
        return
    what = ("train.storage_path" if given else "RAYLOAD_STORAGE_PATH" if os.environ.get("RAYLOAD_STORAGE_PATH")
            else "the run folder (RAYLOAD_HOME)")
    path = os.path.abspath(local_path(storage_path))
    existing = path
    while not os.path.lexists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)  # the folder the missing ones would be made in
    if os.path.islink(existing) and not os.path.exists(existing):  # a link to an unmounted volume, say
        raise RayloadError(f"{what} {storage_path!r}: {existing} is a link to {os.readlink(existing)}, which does not exist; "
                           "give a folder this user can write")
    if not os.path.isdir(existing):
        raise RayloadError(f"{what} {storage_path!r}: {existing} is a file, not a folder; give a folder this user can write")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RayloadError(f"{what} {storage_path!r}: this user cannot write in {existing} (a read-only mount, or another "
                           "owner's folder); give a folder this user can write")


def is_shared(path: str, mounts_file: str = "/proc/mounts") -> bool:
    """On a shared filesystem by /proc/mounts (`mounts_file`, a table in its format), or under a
    folder listed in RAYLOAD_SHARED_PATHS (os.pathsep-separated: mounts the table cannot tell,
    or every node on one machine)."""
    # realpath: a symlink into an NFS mount is on NFS; ~ expanded in the declared folders
    path = os.path.realpath(os.path.expanduser(path))
    declared = [os.path.realpath(os.path.expanduser(p)) for p in os.environ.get("RAYLOAD_SHARED_PATHS", "").split(os.pathsep) if p]
    if any(_within(path, d) for d in declared):
        return True
    best, fstype = "", ""
    try:
        with open(mounts_file) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                # the table writes a space in a mount point as \040 (tab \011, newline \012, backslash \134)
                mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[1])
                # >=: of two file systems mounted at one point, the later line is the one on top (an
                # autofs direct map, then the NFS it mounts there)
                if _within(path, mount) and len(mount) >= len(best):
                    best, fstype = mount, parts[2]
    except OSError:
        return False
    return fstype.removeprefix("fuse.") in _SHARED_FS


def _within(path: str, folder: str) -> bool:
    """`path` is `folder` or lies under it, by whole components: a mount at /data holds
    /data/runs, not /database/runs nor /data2."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)
