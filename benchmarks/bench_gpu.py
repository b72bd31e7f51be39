"""GPU training throughput of rayload's loop: bf16 autocast / TF32 samples/s and MLP TFLOP/s.

Runs THE training loop's optimizer step (`rayload.train.loop.Trainer.step`: autocast, loss,
backward, the fused AdamW for the dense weights and the embedding tables (dense gradients, as
GPU workers train), the shipped job's warmup and cosine schedule) in-process on one CUDA device, over batches already on the device, so
the figure is the training step itself and not the input pipeline (bench_training.py measures
that). Each model runs at every precision in alternating rounds (A B A B ...) and each side's
median is taken, so the ratios are measured side by side in one run.

The MLP part's achieved TFLOP/s counts every nn.Linear's matrix products in one training step,
exactly from forward hooks: 2*in*out multiply-adds per row forward, the same for the weight
gradient, and the same again for the input gradient when the layer's input needs one. The
device's peak is measured in the same run (a large square matrix product in bf16 and in TF32),
and the fraction is also given against the datasheet's dense peak when the device is known.

    python benchmarks/bench_gpu.py                 # on a CUDA machine
    python benchmarks/bench_gpu.py --device cpu --quick   # smoke run of the code path
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "platform"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from rayload.features import CategoricalState, FittedFeatures, LabelState, NumericState  # noqa: E402
from rayload.spec import JobSpec  # noqa: E402
from rayload.train import loop  # noqa: E402
from rayload.train.batch import Batch, Layout  # noqa: E402
from rayload.train.session import Session  # noqa: E402

# Dense (no sparsity) tensor-core peaks from the vendors' datasheets, TFLOP/s: (bf16, tf32).
DATASHEET = {"H100": (989.4, 494.7), "H200": (989.4, 494.7), "A100": (312.0, 156.0), "L4": (121.0, 60.0)}

# synthetic-ctr's shape (jobs/synthetic_dlrm.yaml): 13 dense counts, 26 categorical columns.
DENSE, SPARSE = 13, 26

MODELS = {
    # the shipped job's model (jobs/synthetic_dlrm.yaml): small, so launch-bound on a GPU
    "dlrm-shipped": {"name": "dlrm", "embedding_dim": 16, "bottom": [64, 32], "hidden": [256, 128], "dropout": 0.0},
    # a production-size DLRM top (MLPerf's DLRM uses 1024-1024-512-256 on 128-dim embeddings)
    "dlrm-large": {"name": "dlrm", "embedding_dim": 128, "bottom": [512, 256], "hidden": [1024, 1024, 512, 256],
                   "dropout": 0.0},
    # a deep MLP over the same embeddings: where the dense matrix products dominate the step
    "mlp-wide": {"name": "mlp", "embedding_dim": 64, "hidden": [4096, 4096, 4096, 2048], "dropout": 0.0},
}


class DeviceSession(Session):
    """The loop's session on one device; batches are handed to Trainer.step directly."""

    def __init__(self, device: torch.device):
        super().__init__({"layout": Layout(tuple(f"I{i}" for i in range(DENSE)), tuple(f"C{i}" for i in range(SPARSE)), ()),
                          "seed": 0, "prefetch_batches": 0, "shuffle_buffer": 0})
        self.device = device


def features(cardinality: int) -> FittedFeatures:
    return FittedFeatures(
        numeric=[NumericState(f"I{i}", 0.0, None, None, True, "zscore") for i in range(DENSE)],
        categorical=[CategoricalState(f"C{i}", "hash", buckets=cardinality) for i in range(SPARSE)],
        crosses=[], label=LabelState("label", "binary"), columns=[],
    )


def batches(n: int, size: int, cardinality: int, device: torch.device, seed: int = 0) -> list[Batch]:
    """Synthetic-ctr-like batches generated on the device: Zipf-ish IDs, a planted logistic label."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(DENSE, generator=g, device=device)
    out = []
    for _ in range(n):
        dense = torch.randn(size, DENSE, generator=g, device=device)
        u = torch.rand(size, SPARSE, generator=g, device=device)
        sparse = (cardinality ** u).long().clamp_(max=cardinality - 1)  # log-uniform: a heavy head, a long tail
        logit = dense @ w * 0.3 + (sparse[:, 0] % 7 == 0).float() - 1.0
        label = (torch.rand(size, generator=g, device=device) < torch.sigmoid(logit)).float()
        out.append(Batch(dense, sparse, [], [], label))
    return out


@functools.cache
def shipped_train() -> dict:
    """The shipped job's training settings (jobs/synthetic_dlrm.yaml: lr, warmup, decay, no clipping)."""
    import yaml

    with open(os.path.join(ROOT, "jobs", "synthetic_dlrm.yaml")) as f:
        return {k: v for k, v in yaml.safe_load(f)["train"].items() if k in ("lr", "warmup_steps", "lr_decay", "grad_clip")}


def spec(model: dict, precision: str, batch_size: int, sparse: bool) -> JobSpec:
    """The shipped job's training settings with this run's model, batch size and precision."""
    return JobSpec.model_validate({
        "name": "bench-gpu", "data": {"source": {"kind": "synthetic-ctr"}}, "model": {**model, "sparse_embeddings": sparse},
        "train": {**shipped_train(), "batch_size": batch_size, "precision": "fp32" if precision in ("tf32", "fp32") else precision,
                  "tf32": precision == "tf32"},
    })


def linear_flops(model: nn.Module, batch: Batch, trainer: loop.Trainer) -> float:
    """Matrix-product FLOPs of every nn.Linear in one training step on `batch` (hooks, exact)."""
    total = [0.0]

    def hook(mod, inp, _out):
        x = inp[0]
        rows = x.numel() // x.shape[-1]
        per = 2.0 * rows * mod.in_features * mod.out_features
        total[0] += per * (3 if x.requires_grad else 2)  # forward + weight grad (+ input grad)

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        with trainer.autocast():
            trainer.model(*batch.inputs())
    finally:
        for h in handles:
            h.remove()
    return total[0]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(trainer: loop.Trainer, data: list[Batch], steps: int, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    for i in range(steps):
        trainer.step([data[i % len(data)]])
    sync(device)
    return time.perf_counter() - start


def profile(trainers: dict, data: list[Batch], device: torch.device, label: str, path: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with open(path, "a") as f:
        for p, tr in trainers.items():
            torch.backends.cuda.matmul.allow_tf32 = p.startswith("tf32")
            with torch_profile(activities=acts) as prof:
                timed_steps(tr, data, 5, device)
            key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
            f.write(f"\n### {label} {p} (5 steps)\n")
            f.write(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))


def matmul_peak(device: torch.device, dtype: torch.dtype, tf32: bool, n: int, reps: int) -> float:
    """TFLOP/s of an n x n x n product, median of `reps` timed products after warm-up."""
    torch.backends.cuda.matmul.allow_tf32 = tf32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times) / 1e12


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    ap.add_argument("--precisions", default="tf32,bf16",
                    help="comma-separated sides, each a precision (tf32, bf16, fp16, fp32) with an optional dense AdamW kernel "
                         "(tf32:foreach, bf16:fused); without one the loop chooses (fused on CUDA)")
    ap.add_argument("--batch-size", type=int, default=16384)
    ap.add_argument("--cardinality", type=int, default=100_000, help="rows per embedding table")
    ap.add_argument("--steps", type=int, default=60, help="timed optimizer steps per round")
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sparse-embeddings", action="store_true",
                    help="sparse embedding gradients with SparseAdam (rayload allows them on CPU workers only; "
                         "default: dense tables, as GPU workers train)")
    ap.add_argument("--profile", metavar="FILE", help="also profile 5 steps of each model and precision (torch.profiler) "
                    "and write the top operators by device time here")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch_size, args.cardinality, args.steps, args.warmup, args.rounds = 256, 1000, 3, 1, 1
    device = torch.device(args.device)
    precisions = args.precisions.split(",")
    def trainer_for(model: dict, side: str) -> loop.Trainer:
        """The loop's Trainer for one side; a named AdamW kernel is passed to the loop's own
        make_optimizers for this construction only."""
        precision, _, kernel = side.partition(":")
        fused = {"": None, "fused": True, "foreach": False}[kernel]
        with mock.patch.object(loop, "make_optimizers", functools.partial(loop.make_optimizers, fused=fused)):
            return loop.Trainer(spec(model, precision, args.batch_size, args.sparse_embeddings), features(args.cardinality),
                                DeviceSession(device), 10_000)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}; batch {args.batch_size}; {args.steps} steps x {args.rounds} rounds; "
          f"{'sparse' if args.sparse_embeddings else 'dense'} embedding gradients")
    peaks = {}
    if device.type == "cuda":
        peaks = {"bf16": matmul_peak(device, torch.bfloat16, False, 8192, 10),
                 "tf32": matmul_peak(device, torch.float32, True, 8192, 10)}
        print(f"measured matmul peak (8192^3): bf16 {peaks['bf16']:.0f} TFLOP/s, tf32 {peaks['tf32']:.0f} TFLOP/s")
    sheet = next((v for k, v in DATASHEET.items() if k in name), None)

    data = batches(8, args.batch_size, args.cardinality, device)
    results = {"device": name, "torch": torch.__version__, "batch_size": args.batch_size, "peaks": peaks, "models": {}}
    for model_name in args.models.split(","):
        trainers = {p: trainer_for(MODELS[model_name], p) for p in precisions}
        params = sum(p.numel() for p in next(iter(trainers.values())).model.parameters())
        rates = {p: [] for p in precisions}
        for r in range(args.rounds):
            for p in (precisions if r % 2 == 0 else precisions[::-1]):
                tr = trainers[p]
                torch.backends.cuda.matmul.allow_tf32 = p.startswith("tf32")  # each trainer's own setting (set at its init)
                timed_steps(tr, data, args.warmup, device)
                seconds = timed_steps(tr, data, args.steps, device)
                rates[p].append(args.steps * args.batch_size / seconds)
        if args.profile:
            profile(trainers, data, device, model_name, args.profile)
        flops = linear_flops(trainers[precisions[0]].model, data[0], trainers[precisions[0]]) / args.batch_size
        row = {"params": params, "mlp_flop_per_row": flops, "samples_per_s": {p: statistics.median(v) for p, v in rates.items()},
               "per_round": rates}
        for p, sps in row["samples_per_s"].items():
            tflops = flops * sps / 1e12
            row.setdefault("mlp_tflops", {})[p] = tflops
            prec = p.partition(":")[0]
            if prec in ("bf16", "tf32", "fp16") and peaks:
                row.setdefault("fraction_of_measured_peak", {})[p] = tflops / peaks["bf16" if prec == "fp16" else prec]
            if sheet and prec in ("bf16", "tf32", "fp16"):
                row.setdefault("fraction_of_datasheet_peak", {})[p] = tflops / sheet[1 if prec == "tf32" else 0]
        results["models"][model_name] = row
        trainers.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print()
    print("| model | params | MLP GFLOP/row-step | precision | samples/s (median) | MLP TFLOP/s | of measured peak | of datasheet peak |")
    print("|---|---|---|---|---|---|---|---|")
    for m, row in results["models"].items():
        for p in precisions:
            fm = row.get("fraction_of_measured_peak", {}).get(p)
            fd = row.get("fraction_of_datasheet_peak", {}).get(p)
            print(f"| {m} | {row['params'] / 1e6:.1f}M | {row['mlp_flop_per_row'] / 1e9:.4f} | {p} | {row['samples_per_s'][p]:,.0f} | "
                  f"{row['mlp_tflops'][p]:.1f} | {'' if fm is None else f'{fm:.1%}'} | {'' if fd is None else f'{fd:.1%}'} |")
    print()
    for m, row in results["models"].items():
        sps = row["samples_per_s"]
        if "bf16" in sps and "tf32" in sps:
            print(f"{m}: bf16 / TF32 samples/s = {sps['bf16'] / sps['tf32']:.2f}x (target >= 1.6)")
        for a, b in zip(precisions, precisions[1:]):
            if a.partition(":")[0] == b.partition(":")[0] and ":" in a + b:
                print(f"{m}: {b} / {a} samples/s = {sps[b] / sps[a]:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
