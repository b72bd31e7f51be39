"""Up-front refusals of what a cluster cannot run: storage every node sees, resources that fit."""

import pytest

from rayload.train import resources

MOUNTS = "/dev/sda1 / ext4 rw 0 0\nserver:/export /data nfs4 rw 0 0\nserver:/scratch /mnt/shared/ nfs rw 0 0\n"


def test_shared_mounts_hold_the_paths_below_them_by_whole_components(monkeypatch, tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(MOUNTS)

    def shared(path: str) -> bool:
        return resources.is_shared(path, mounts_file=str(mounts))

    monkeypatch.delenv("RAYLOAD_SHARED_PATHS", raising=False)
    assert shared("/data") and shared("/data/runs") and shared("/data/")
    assert not shared("/database/runs") and not shared("/data2")  # on ext4 /
    assert shared("/mnt/shared/runs") and not shared("/mnt/sharedx")
    assert not resources.is_shared("/data/runs", mounts_file=str(tmp_path / "missing"))  # no table: nothing is shared
    monkeypatch.setenv("RAYLOAD_SHARED_PATHS", "/srv/team/")
    assert shared("/srv/team/runs") and not shared("/srv/teammate")


def test_of_two_file_systems_at_one_mount_point_the_one_on_top_counts(tmp_path, monkeypatch):
    """/proc/mounts lists the one on top last: an autofs direct map then the NFS it mounted at
    /data read as not shared (a multi-node run refused), a tmpfs over an NFS mount as shared."""
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\n/etc/auto.direct /data autofs rw 0 0\nserver:/export /data nfs4 rw 0 0\n"
                      "server:/scratch /scratch nfs4 rw 0 0\ntmpfs /scratch tmpfs rw 0 0\n")
    monkeypatch.delenv("RAYLOAD_SHARED_PATHS", raising=False)
    assert resources.is_shared("/data/runs", mounts_file=str(mounts))
    assert not resources.is_shared("/scratch/runs", mounts_file=str(mounts))


def test_fuse_clients_of_shared_file_systems_are_shared_and_types_match_whole(tmp_path, monkeypatch):
    """GlusterFS and CephFS clients mount as fuse.glusterfs / fuse.ceph-fuse, which the prefix
    match never took for shared (a multi-node run on them was refused), and it took nfsd for NFS."""
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\nsrv:/vol /gluster fuse.glusterfs rw 0 0\nceph-fuse /cephfs fuse.ceph-fuse rw 0 0\n"
                      "nfsd /proc/fs/nfsd nfsd rw 0 0\ns3fs /bucket fuse.s3fs rw 0 0\nfoo /fusex fuse.sshfs rw 0 0\n")
    monkeypatch.delenv("RAYLOAD_SHARED_PATHS", raising=False)
    shared = [p for p in ("/gluster/runs", "/cephfs/runs", "/proc/fs/nfsd/x", "/bucket/runs", "/fusex/runs")
              if resources.is_shared(p, mounts_file=str(mounts))]
    assert shared == ["/gluster/runs", "/cephfs/runs", "/bucket/runs"]


def test_the_largest_node_named_is_the_largest_and_the_fields_are_the_callers(monkeypatch):
    """When no node placed one worker, every node tied at 0 and the first was named "the largest"
    (a CPU-only node for a GPU request); a search's trial was told to lower resources.* fields
    it does not have."""
    from ray._private import state

    from rayload._tune_capacity import SearchResourceError, _check_shape
    from rayload.spec import ResourcesSpec

    monkeypatch.setattr(state.state, "get_max_resources_from_cluster_config", lambda: None)
    monkeypatch.setattr(resources, "_v1_autoscaler_running", lambda: False)
    nodes = [{"CPU": 16.0}, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.5, "GPU": 1.0}]
    monkeypatch.setattr(resources, "alive_nodes", lambda: [{"Alive": True, "Resources": n} for n in nodes])
    with pytest.raises(resources.ResourceError, match=r"the largest has CPU=1.5, GPU=1; no autoscaler\); lower resources.workers"):
        resources.check_resources(ResourcesSpec(workers=1, cpus_per_worker=2, gpus_per_worker=1))
    with pytest.raises(SearchResourceError, match=r"^trial_resources: .* lower trial_resources.workers / cpus_per_worker"):
        _check_shape(1, 2, 1, None)
    with pytest.raises(SearchResourceError, match=r"^cpus: one trial can never run here: .*CPU=18.5 in total \(no autoscaler\); lower cpus or"):
        _check_shape(1, 32, 0, None, fields="cpus")


def test_fractional_workers_are_counted_as_ray_places_them():
    """Ray counts resources in units of 1/10,000; in floats 1.0 // 0.1 == 9 refused 10 x 0.1 CPU on 1 CPU."""
    one_cpu = [{"CPU": 1.0, "memory": 1e9}]
    assert resources._placeable(10, {"CPU": 0.1}, one_cpu) and not resources._placeable(11, {"CPU": 0.1}, one_cpu)
    assert resources._placeable(3, {"CPU": 0.3}, one_cpu) and not resources._placeable(4, {"CPU": 0.3}, one_cpu)
    assert resources._placeable(2, {"CPU": 0.5, "GPU": 0.5}, [{"CPU": 1.0, "GPU": 1.0}])
    assert not resources._placeable(2, {"CPU": 0.5, "GPU": 0.6}, [{"CPU": 1.0, "GPU": 1.0}])
    assert resources._placeable(2, {"CPU": 1.0}, [{"CPU": 1.0}, {"CPU": 1.0}])  # one worker per node
    assert not resources._placeable(1, {"CPU": 1.5}, [{"CPU": 1.0}, {"CPU": 1.0}])  # a worker cannot span nodes
    # totals, here an autoscaler's ceiling of 0.3 CPU: 3 x 0.1 is 0.30000000000000004 in floats
    assert resources._fits_total(3, {"CPU": 0.1}, {}, {"CPU": 0.3})
    assert not resources._fits_total(3, {"CPU": 0.1}, {"CPU": 0.01}, {"CPU": 0.3})
    assert resources._fits_total(10, {"CPU": 0.1}, {}, {"CPU": 1.0})


def test_ten_workers_of_a_tenth_of_a_cpu_fit_a_one_cpu_node(monkeypatch):
    from ray._private import state

    from rayload.spec import ResourcesSpec

    monkeypatch.setattr(state.state, "get_max_resources_from_cluster_config", lambda: None)
    monkeypatch.setattr(resources, "_v1_autoscaler_running", lambda: False)
    monkeypatch.setattr(resources, "alive_nodes", lambda: [{"Alive": True, "Resources": {"CPU": 1.0, "memory": 1e9}}])
    resources.check_resources(ResourcesSpec(workers=10, cpus_per_worker=0.1))
    with pytest.raises(resources.ResourceError, match="11 worker"):
        resources.check_resources(ResourcesSpec(workers=11, cpus_per_worker=0.1))


def _free(monkeypatch, *snapshots, grows: bool = False):
    """available_resources_per_node answers each snapshot in turn (the last one from then on)."""
    import ray._private.state as ray_state

    answers = list(snapshots)
    monkeypatch.setattr(ray_state, "available_resources_per_node",
                        lambda: {f"node{i}": n for i, n in enumerate(answers.pop(0) if len(answers) > 1 else answers[0])})
    monkeypatch.setattr(resources, "cluster_can_grow", lambda: grows)


def test_an_elastic_group_starts_with_what_the_free_resources_place(monkeypatch, caplog):
    """Ray's elastic policy sized the group from the totals and waited for CPUs another job held."""
    import logging

    from rayload.spec import ResourcesSpec

    elastic = ResourcesSpec(workers={"min": 1, "max": 4}, cpus_per_worker=1)
    _free(monkeypatch, [{"CPU": 1.0}, {"CPU": 1.5}])
    with caplog.at_level(logging.WARNING, logger="rayload.train.resources"):
        assert resources.elastic_max(elastic, wait_s=0) == 2  # one worker per node
    assert "place 2 worker(s) of CPU=1 now" in caplog.text and "at most 2" in caplog.text
    _free(monkeypatch, [{"CPU": 0.5}])
    assert resources.elastic_max(elastic, wait_s=0) == 1  # never below min: Ray waits for it, bounded by placement_timeout_s
    _free(monkeypatch, [{"CPU": 8.0}])
    assert resources.elastic_max(elastic, wait_s=0) == 4  # never above max
    _free(monkeypatch, [{"CPU": 1.0}], [{"CPU": 4.0}])  # what a run that just ended released shows a moment later
    assert resources.elastic_max(elastic, wait_s=0) == 4
    _free(monkeypatch, [{"CPU": 1.0}], grows=True)  # an autoscaler adds nodes for the rest
    assert resources.elastic_max(elastic, wait_s=0) == 4
    gpu = ResourcesSpec(workers={"min": 1, "max": 4}, cpus_per_worker=1, gpus_per_worker=1)
    _free(monkeypatch, [{"CPU": 8.0, "GPU": 2.0}])
    assert resources.elastic_max(gpu, wait_s=0) == 2


def test_the_placement_bound_waits_for_an_autoscaler_and_a_timeout_is_said_with_the_numbers(monkeypatch):
    """A group waiting for a node an autoscaler starts (minutes: a VM, a GPU image) failed at 60 s
    with Ray's message, whose advice (an environment variable) rayload overwrote."""
    from types import SimpleNamespace

    from rayload.spec import ResourcesSpec
    from rayload.train.trainer import _failure_message

    monkeypatch.delenv(resources.START_TIMEOUT_ENV, raising=False)
    monkeypatch.setattr(resources, "cluster_can_grow", lambda: True)
    assert resources.start_timeout(ResourcesSpec(workers=2)) == 900.0
    assert resources.start_timeout(ResourcesSpec(workers=2, placement_timeout_s=30)) == 30.0
    monkeypatch.setattr(resources, "cluster_can_grow", lambda: False)
    assert resources.start_timeout(ResourcesSpec(workers=2)) == 60.0
    monkeypatch.setenv(resources.START_TIMEOUT_ENV, "120")  # a user's own setting, with the spec's unset
    assert resources.start_timeout(ResourcesSpec(workers=2)) == 120.0
    monkeypatch.setattr(resources, "alive_nodes", lambda: [{"Alive": True, "Resources": {"CPU": 4.0}}])

    class WorkerGroupStartupTimeoutError(Exception):
        pass

    spec = SimpleNamespace(resources=ResourcesSpec(workers=2, cpus_per_worker=3), train=SimpleNamespace(max_failures=0))
    message = _failure_message(SimpleNamespace(controller_failure=WorkerGroupStartupTimeoutError("timed out")), spec)
    assert message == ("training could not run: the worker group was not placed within 120 s (resources.placement_timeout_s): "
                       "resources ask for 2 worker(s) with CPU=3 each; the cluster's 1 live node(s) have CPU=4 in total and place 1. "
                       "Other work may hold them, or nodes were still starting: raise resources.placement_timeout_s, lower "
                       "resources.workers / cpus_per_worker / gpus_per_worker, or add nodes")


def test_a_local_storage_path_is_refused_where_an_autoscaler_can_add_nodes(monkeypatch, tmp_path):
    """One live node passed the check; on cluster.yaml the head holds no worker, every worker ran
    on an added node, and Ray failed at the first checkpoint (each retry losing an epoch)."""
    monkeypatch.delenv("RAYLOAD_SHARED_PATHS", raising=False)
    monkeypatch.setattr(resources, "alive_nodes", lambda: [{"Alive": True, "Resources": {"CPU": 0.0}}])
    monkeypatch.setattr(resources, "cluster_can_grow", lambda: True)
    with pytest.raises(resources.ResourceError, match=r"is a local folder, and an autoscaler can add nodes to this cluster"):
        resources.check_storage(str(tmp_path))
    resources.check_storage("s3://bucket/runs")  # object storage: fine
    monkeypatch.setenv("RAYLOAD_SHARED_PATHS", str(tmp_path))
    resources.check_storage(str(tmp_path))  # a declared shared mount: fine
    monkeypatch.delenv("RAYLOAD_SHARED_PATHS")
    monkeypatch.setattr(resources, "cluster_can_grow", lambda: False)
    resources.check_storage(str(tmp_path))  # one node that cannot grow: fine


def test_an_elastic_group_that_cannot_be_started_again_fails_after_the_bound(monkeypatch):
    """After a lost node Ray's elastic policy makes no placement while the live nodes place fewer
    than min workers, so no placement timeout applied and the run waited forever."""
    from ray.train.v2._internal.execution.controller.state import InitializingState, RestartingState, RunningState

    from rayload.spec import ResourcesSpec

    clock = [1000.0]
    monkeypatch.setattr("time.monotonic", lambda: clock[0])
    monkeypatch.setattr(resources, "alive_nodes", lambda: [{"Alive": True, "Resources": {"CPU": 2.0}}])
    bound = resources.elastic_wait_bound(ResourcesSpec(workers={"min": 3, "max": 4}, placement_timeout_s=30))
    restarting = RestartingState(training_failed_error=RuntimeError("a node was lost"))
    bound.after_controller_state_update(RunningState(), restarting)
    clock[0] += 29
    bound.after_controller_state_update(restarting, restarting)  # within the bound: waits on
    clock[0] += 2
    with pytest.raises(resources.ResourceError, match=r"resources.workers \{min: 3, max: 4\}: the worker group waited 30 s "
                                                       r"\(resources.placement_timeout_s\) for nodes that place 3 worker\(s\) of CPU=1; "
                                                       r"the 1 live node\(s\) place 2"):
        bound.after_controller_state_update(restarting, restarting)
    bound.after_controller_state_update(restarting, RunningState())  # running again: the clock starts over
    bound.after_controller_state_update(RunningState(), InitializingState())
    clock[0] += 29
    bound.after_controller_state_update(InitializingState(), InitializingState())
    # nodes that do place min: a wait for resources another run holds is Ray's queue, never ended here
    monkeypatch.setattr(resources, "alive_nodes", lambda: [{"Alive": True, "Resources": {"CPU": 4.0}}])
    for _ in range(3):
        clock[0] += 61
        bound.after_controller_state_update(InitializingState(), InitializingState())
