"""Refuse, before training starts, what a cluster can never run: too few resources, local storage across nodes."""

from __future__ import annotations

import os

from ..errors import RayloadError

# Filesystems every node can see; a local path on any other filesystem is per-node.
_SHARED_FS = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs", "efs")


class ResourceError(RayloadError):
    pass


def requested(resources) -> tuple[int, dict[str, float]]:
    """(minimum workers, resources of one worker)."""
    workers = resources.workers if isinstance(resources.workers, int) else resources.workers.min
    per = {"CPU": resources.cpus_per_worker}
    if resources.gpus_per_worker:
        per["GPU"] = resources.gpus_per_worker
    if resources.accelerator_type:
        per[f"accelerator_type:{resources.accelerator_type}"] = 0.001
    return workers, per


def check_resources(resources) -> None:
    """With an autoscaler, compare with the cluster config's maximum; else with the live nodes."""
    import ray
    from ray._private.state import state

    workers, per = requested(resources)
    ceiling = state.get_max_resources_from_cluster_config()
    if ceiling:
        nodes_can = {k: ceiling.get(k, 0) for k in per}
        fits = all(per[k] * workers <= ceiling.get(k, 0) for k in per)
    else:
        alive = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        fits = sum(min(int(n.get(k, 0) // v) for k, v in per.items()) for n in alive) >= workers
        nodes_can = {k: sum(n.get(k, 0) for n in alive) for k in per}
    if not fits:
        asked = ", ".join(f"{k}={v:g}" for k, v in per.items())
        have = ", ".join(f"{k}={v:g}" for k, v in nodes_can.items())
        raise ResourceError(
            f"resources ask for {workers} worker(s) with {asked} each, but the cluster "
            f"{'can grow to' if ceiling else 'has'} {have} in total{'' if ceiling else ' (no autoscaler)'}; "
            "lower resources.workers / cpus_per_worker / gpus_per_worker or add nodes"
        )


def check_storage(storage_path: str) -> None:
    """A multi-node run needs checkpoint storage that every node reaches."""
    import ray

    if "://" in storage_path:
        return
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) > 1 and not is_shared(storage_path):
        raise ResourceError(
            f"train.storage_path {storage_path!r} is a local folder, but the cluster has {len(nodes)} nodes: "
            "workers on other nodes could not write or read checkpoints. Set train.storage_path to shared "
            "storage (s3://bucket/path, gs://..., or an NFS mount)."
        )


def is_shared(path: str) -> bool:
    path = os.path.abspath(path)
    best, fstype = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and path.startswith(parts[1]) and len(parts[1]) > len(best):
                    best, fstype = parts[1], parts[2]
    except OSError:
        return False
    return fstype.startswith(_SHARED_FS)
