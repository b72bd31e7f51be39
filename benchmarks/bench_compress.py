"""int8 against fp32 on one checkpoint, side by side in one run: latency per batch size, size,
validation AUC. Optionally the pruned variant's AUC and sparsity.

    .venv/bin/python benchmarks/bench_compress.py [--source movielens|synthetic] [--epochs 3]
        [--embedding-dim 32] [--hidden 512,256,128] [--repeats 200] [--prune 0.5]

Trains one DeepFM with rayload.train (MovieLens, or synthetic-ctr 200,000 rows), compresses
it with rayload.compress (the gate must pass: the int8 model written is the one measured),
loads both checkpoints the way serving does (train.checkpoint.load, 1 intra-op thread as in a
Serve replica) and times the model's forward pass on real validation batches of 1, 32 and 256
rows, alternating fp32 and int8 calls so both see the same machine state: as served (each
model's frozen TorchScript trace, models/inference.py, which serve/scorer.py runs) and the
eager module. Also times the whole Scorer.score path (features.json transform + served
forward) at the same sizes.
Prints: batch | fp32 ms | int8 ms | speed-up (fp32/int8) | path, then size ratio and AUC difference.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "platform"))

import rayload  # noqa: E402
from rayload.spec import JobSpec  # noqa: E402

SIZES = (1, 32, 256)


def job(args) -> JobSpec:
    source = {"kind": "movielens"} if args.source == "movielens" else {"kind": "synthetic-ctr", "rows": 200_000, "seed": 0}
    raw = {"name": f"bench-compress-{args.source}", "data": {"source": source},
           "model": {"name": "deepfm", "embedding_dim": args.embedding_dim, "hidden": [int(h) for h in args.hidden.split(",")],
                     "dropout": 0.1},
           "train": {"epochs": args.epochs, "batch_size": 1024, "lr": 0.002, "run_name": f"bench-compress-{args.source}-{os.getpid()}"}}
    if args.source == "movielens":
        import yaml

        with open(os.path.join(os.path.dirname(__file__), "..", "jobs", "movielens_deepfm.yaml")) as f:
            base = yaml.safe_load(f)
        raw = {**raw, "data": base["data"], "features": base.get("features", {}), "split": base["split"]}
    return JobSpec.model_validate(raw)


def batches(pre, layout, size: int, count: int = 20):
    from rayload.train.batch import collate

    out = []
    for table in pre.dataset("val").iter_batches(batch_size=size, batch_format="pyarrow"):
        if table.num_rows == size:
            out.append(collate(table, layout).inputs())
        if len(out) == count:
            break
    return out


def time_pair(fns: dict, inputs: list, repeats: int) -> dict[str, float]:
    """Median seconds per call of each function, calls alternating between them."""
    import torch

    samples = {k: [] for k in fns}
    with torch.inference_mode():
        for fn in fns.values():  # warm-up
            for x in inputs[:3]:
                fn(x)
        for i in range(repeats):
            x = inputs[i % len(inputs)]
            for name, fn in fns.items():
                t = time.perf_counter()
                fn(x)
                samples[name].append(time.perf_counter() - t)
    return {k: float(np.median(v)) for k, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", choices=("movielens", "synthetic"), default="movielens")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--embedding-dim", type=int, default=32)
    ap.add_argument("--hidden", default="512,256,128")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--prune", type=float, default=0.5)
    args = ap.parse_args()
    os.environ.setdefault("RAYLOAD_HOME", tempfile.mkdtemp(prefix="bench-compress-"))

    import torch

    from rayload.data.pipeline import preprocess
    from rayload.models import InputShape
    from rayload.models.inference import for_serving
    from rayload.serve.scorer import Scorer
    from rayload.train import checkpoint as ckpt
    from rayload.train.batch import Layout

    spec = job(args)
    result = rayload.train(spec, evaluate_test=False)
    q = rayload.compress(result.checkpoint, "int8")
    torch.set_num_threads(1)  # as in a Serve replica (serve/scorer.py)
    fp32, int8 = ckpt.load(result.checkpoint), ckpt.load(q.checkpoint)
    pre = preprocess(spec)
    layout = Layout.from_features(fp32.features)
    shape = InputShape.from_features(fp32.features)
    served = {"fp32": for_serving(fp32.model, shape), "int8": for_serving(int8.model, shape)}
    print(f"{args.source}: DeepFM dim {args.embedding_dim}, hidden {args.hidden}; quantized engine {torch.backends.quantized.engine}; "
          f"served forward: fp32 {served['fp32'].mode}, int8 {served['int8'].mode}")
    print("| batch | fp32 ms | int8 ms | speed-up fp32/int8 | path |")
    print("|---|---|---|---|---|")
    for size in SIZES:
        inputs = batches(pre, layout, size)
        t = time_pair({"fp32": lambda x: served["fp32"](*x), "int8": lambda x: served["int8"](*x),
                       "fp32 eager": lambda x: fp32.model(*x), "int8 eager": lambda x: int8.model(*x)}, inputs, args.repeats)
        print(f"| {size} | {t['fp32'] * 1e3:.3f} | {t['int8'] * 1e3:.3f} | **{t['fp32'] / t['int8']:.2f}** | model forward, as served |")
        print(f"| {size} | {t['fp32 eager'] * 1e3:.3f} | {t['int8 eager'] * 1e3:.3f} | {t['fp32 eager'] / t['int8 eager']:.2f} | "
              "model forward, eager module |")
    scorers = {"fp32": Scorer.load("a", result.checkpoint), "int8": Scorer.load("b", q.checkpoint)}
    names = [c["name"] for c in fp32.features.columns if c["role"] != "label" and c["name"] not in fp32.features.derived]
    for size in SIZES:
        raw = _raw_rows(spec, names, size)
        t = time_pair({k: (lambda x, s=s: s.score(x)) for k, s in scorers.items()}, raw, max(50, args.repeats // 4))
        print(f"| {size} | {t['fp32'] * 1e3:.3f} | {t['int8'] * 1e3:.3f} | **{t['fp32'] / t['int8']:.2f}** | Scorer.score (transform + model) |")
    print(f"model.pt size: fp32 {q.bytes_before:,} B, int8 {q.bytes_after:,} B: **{q.bytes_before / q.bytes_after:.2f}x smaller**")
    print(f"validation AUC: fp32 {q.auc_before:.5f}, int8 {q.auc_after:.5f}: difference **{q.auc_after - q.auc_before:+.5f}** "
          f"(gate {q.max_auc_drop})")
    if args.prune:
        try:
            p = rayload.compress(result.checkpoint, "prune", amount=args.prune, finetune_epochs=1, max_auc_drop=1.0)
            print(f"prune {args.prune:.0%} + 1 fine-tune epoch: AUC {p.auc_before:.5f} -> {p.auc_after:.5f} "
                  f"({p.auc_after - p.auc_before:+.5f}), sparsity {p.settings['sparsity']:.1%}")
        except Exception as exc:  # the prune line is context; the int8 figures above are the benchmark
            print(f"prune: {exc}")


def _raw_rows(spec, names: list[str], size: int, count: int = 20) -> list[list[dict]]:
    """Raw request rows (what a client sends) from the spec's source, `count` groups of `size`."""
    import pyarrow.parquet as pq

    from rayload.data.builtin import materialize
    from rayload.paths import cache_root

    rows = pq.read_table(materialize(spec.data.source, cache_root())[0]).select(names).slice(0, size * count).to_pylist()
    return [rows[i * size:(i + 1) * size] for i in range(count)]


if __name__ == "__main__":
    main()
