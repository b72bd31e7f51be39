"""The fixed cost of Ray Train itself, with no rayload code: a no-op training run on each side.

    .venv/bin/python benchmarks/bench_train_floor.py [--rounds 3] [--workers 2] [--rayload-env]

Both sides are fresh processes launched from here and timed from launch to exit; the sides
alternate (A B B A ...) and each figure is the median over rounds.

- ray:   `ray.init(num_cpus=workers)`, then Ray Train V2's `TorchTrainer` with `workers` gloo
         workers of 1 CPU (OMP_NUM_THREADS=1) whose train function runs one all_reduce on the
         process group Ray Train set up and reports once; `trainer.fit()`, then exit.
- plain: `python -m torch.distributed.run --standalone --nproc_per_node workers` with a
         worker that imports torch, joins a gloo process group, runs the same all_reduce and
         exits.

`--rayload-env` adds a third side, alternating with the other two: Ray Train with the settings
rayload's `fit` gives it in the embedded Ray on one node (the controller polls every 0.5 s, no
preemption watcher: `train.trainer._controller_env`; no PlacementGroupCleaner:
`train.trainer._trainer_class`).

The difference is the part of bench_training.py's DDP fixed cost (DDP_STARTUP) that a
training run on Ray Train pays before and after any rayload code runs: Ray's start, the Train
controller, the worker group's actors and processes, its polling and shut-down. It also
prints how many Ray worker processes the run started (from Ray's session logs) and where the
Ray side's time goes: importing Ray and Ray Train, ray.init, TorchTrainer.fit, ray.shutdown.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

RAY_SIDE = """
import glob, os, sys, time
t0 = time.perf_counter()
import ray
import ray.train
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

def loop(config):
    import torch
    import torch.distributed as dist
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0] == dist.get_world_size()
    ray.train.report({"sum": float(t[0])})

workers, storage, settings = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if settings == "rayload":  # counted with the imports
    from rayload.train.trainer import _trainer_class
t1 = time.perf_counter()
ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
t2 = time.perf_counter()
logs = ray._private.worker._global_node.get_logs_dir_path()
# rayload's fit picks its trainer class in the Ray it runs in (here: embedded)
trainer_class = _trainer_class() if settings == "rayload" else TorchTrainer
result = trainer_class(loop, scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
                      run_config=RunConfig(storage_path=storage, name=f"floor-{time.time_ns()}")).fit()
t3 = time.perf_counter()
assert result.error is None, result.error
print("PROCESSES", len(glob.glob(os.path.join(logs, "python-core-worker-*.log"))))
ray.shutdown()
print("PHASES", t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
"""

PLAIN_SIDE = """
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4)
dist.all_reduce(t)
assert t[0] == dist.get_world_size()
dist.destroy_process_group()
"""


def launch(cmd: list[str], env: dict) -> tuple[float, str]:
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return wall, out.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rayload-env", action="store_true", help="Ray Train settings as rayload's fit sets them")
    args = ap.parse_args()
    work = os.path.abspath(os.path.join("runs", "bench-train-floor"))
    os.makedirs(work, exist_ok=True)
    plain_file = os.path.join(work, "plain_worker.py")
    with open(plain_file, "w") as f:
        f.write(PLAIN_SIDE)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    sides = ["ray", "plain"]
    if args.rayload_env:
        sides.insert(1, "rayload")
    walls: dict[str, list[float]] = {side: [] for side in sides}
    procs: dict[str, list[int]] = {"ray": [], "rayload": []}
    phases: dict[str, list[list[float]]] = {"ray": [], "rayload": []}
    for i in range(args.rounds):
        for side in (sides if i % 2 == 0 else sides[::-1]):
            if side == "plain":
                wall, _ = launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                  str(args.workers), plain_file], env)
            else:
                wall, out = launch([sys.executable, "-c", RAY_SIDE, str(args.workers), work, side], {**env, **side_env(side)})
                procs[side].append(int(out.split("PROCESSES", 1)[1].split()[0]))
                phases[side].append([float(x) for x in out.split("PHASES", 1)[1].split()[:4]])
            walls[side].append(wall)
            print(f"round {i} {side:7s} {wall:5.1f} s", flush=True)
    plain_s = statistics.median(walls["plain"])
    names = ("import ray + Train", "ray.init", "TorchTrainer.fit", "ray.shutdown")
    print(f"\nno-op run, {args.workers} workers, median of {args.rounds}: torchrun {plain_s:.1f} s")
    for side in sides[:-1]:
        wall = statistics.median(walls[side])
        label = "Ray Train, rayload's settings" if side == "rayload" else "Ray Train, Ray's defaults"
        print(f"{label}: {wall:.1f} s, minus torchrun {wall - plain_s:+.1f} s, ratio {wall / plain_s:.2f}x; "
              f"Ray worker processes started per run: {', '.join(map(str, procs[side]))}")
        print("  median seconds: " + ", ".join(f"{n} {statistics.median(p[i] for p in phases[side]):.1f}" for i, n in enumerate(names))
              + f", interpreter start and exit {wall - sum(statistics.median(p[i] for p in phases[side]) for i in range(4)):.1f}")
    if args.rayload_env:
        ray_s, ours = statistics.median(walls["ray"]), statistics.median(walls["rayload"])
        fit = [statistics.median(p[2] for p in phases[side]) for side in ("ray", "rayload")]
        print(f"rayload's settings against Ray's defaults: wall {ours - ray_s:+.1f} s, TorchTrainer.fit {fit[1] - fit[0]:+.1f} s "
              f"(fit ratio {fit[1] / fit[0]:.2f})")


def side_env(side: str) -> dict:
    if side != "rayload":
        return {}
    from rayload.train.trainer import HEALTH_CHECK_INTERVAL_S

    return {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(HEALTH_CHECK_INTERVAL_S), "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}

if __name__ == "__main__":
    main()
