"""cluster.yaml's node types on one machine: Ray's fake multi-node provider starts the head
with an autoscaling config derived from cluster.yaml (same node types, resources, min/max),
a training job asking for GPU workers goes through `ray job submit` with token auth, and the
autoscaler has to launch the GPU worker type for it. The GPUs are logical: the workers say
they fall back to the CPU (resources.cpu_fallback), they never do it silently."""

import glob
import os
import re
import subprocess

import pytest
from ray_head import BIN, ROOT, Head, ensure_token

from rayload.cluster import local_config, read_cluster

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster():
    ensure_token()
    config = read_cluster(os.path.join(ROOT, "cluster.yaml"))
    # Every fake node runs on this machine, so their folders are one filesystem.
    h = Head(num_cpus=0, autoscaling_config=lambda gcs: local_config(config, gcs), env={"RAYLOAD_SHARED_PATHS": "/tmp"})
    yield h, config
    h.stop()


def _status(h: Head) -> str:
    """`ray status` of the head: an answer listing the head node (a failed call read as "no GPU node")."""
    done = h.run(os.path.join(BIN, "ray"), "status", f"--address={h.gcs}", timeout=60)
    assert done.returncode == 0 and "ray.head.default" in done.stdout, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    return done.stdout


def test_derived_config_keeps_cluster_yaml_node_types(cluster):
    h, config = cluster
    derived = local_config(config, h.gcs)
    workers = {k: v for k, v in config["available_node_types"].items() if k != config["head_node_type"]}
    for name, node in workers.items():
        assert {k: v for k, v in derived["available_node_types"][name]["resources"].items() if k != "object_store_memory"} == node["resources"]
        assert derived["available_node_types"][name]["max_workers"] == node["max_workers"]
    assert derived["available_node_types"]["ray.head.default"]["resources"] == {"CPU": 0}
    assert "gpu_worker" not in _status(h)  # nothing asked for a GPU yet


def test_gpu_training_job_launches_the_gpu_worker_type(cluster):
    h, config = cluster
    gpu_type = next(k for k, v in config["available_node_types"].items() if v.get("resources", {}).get("GPU"))
    # No working_dir upload here (test_job_submit covers it): every fake node lives in one session
    # folder, so a node that joins re-extracts the shared working_dir package under workers that
    # run in it; their cwd vanishes and MKL then cannot load libtorch ("getcwd() failed"). Real
    # nodes each have their own session folder.
    r = h.job_submit("rayload", "train", os.path.join(ROOT, "jobs", "movielens_deepfm.yaml"), "--set", "resources.workers=2", "--set",
                     "resources.gpus_per_worker=1", "--set", "resources.cpu_fallback=true", "--set", "train.epochs=1", "--set", "train.max_failures=3",
                     "--set", "model.hidden=[16]", "--set", f"train.storage_path={h.dir}/checkpoints", timeout=600, working_dir=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    assert "best checkpoint:" in out
    # Both ranks ran on nodes of the GPU worker type, and said they computed on the CPU. The job's
    # output carries the workers' lines only as far as Ray's log monitor forwarded them before the
    # job ended (on a loaded machine it missed them once); the workers' own log files have them all.
    logs = out + _worker_logs(h.dir)
    ranks = set(re.findall(rf"CPU FALLBACK: rank (\d) on node type {gpu_type} was given GPU\(s\) '0'", logs))
    assert ranks == {"0", "1"}, out[-5000:]
    status = _status(h)
    launched = re.search(rf"(\d+) {gpu_type}", status)
    # At least the two nodes the ranks ran on (the autoscaler may start a spare while a slow node boots).
    assert launched and int(launched.group(1)) >= 2, status
    assert os.path.exists(os.path.join(h.dir, "checkpoints"))


def _worker_logs(folder: str) -> str:
    texts = []
    for path in glob.glob(os.path.join(folder, "ray", "session_*", "logs", "worker-*")):
        with open(path, errors="replace") as f:
            texts.append(f.read())
    return "\n".join(texts)


def test_cluster_lint_cli_passes_on_cluster_yaml():
    r = subprocess.run([os.path.join(BIN, "rayload"), "cluster", "lint", "cluster.yaml"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
