"""Training overheads of rayload: three ratios measured side by side in one run.

    .venv/bin/python benchmarks/bench_training.py            # full run (about 5-7 minutes on 2 cores)
    .venv/bin/python benchmarks/bench_training.py --quick    # smoke run: small sizes, one round

Options: --spec (default jobs/synthetic_dlrm.yaml), --set key=value (extra spec overrides),
--rows, --epochs, --rounds, --ingest-epochs, --accum-epochs, --threads, --only ddp,ingest,accum,
--home (RAYLOAD_HOME for the preprocessed-shard cache; default $RAYLOAD_HOME, else
/tmp/rayload-bench-training), --child-timeout, --keep.

Every measurement uses the same job spec (the synthetic DLRM by default, shrunk to --rows
rows in 4 shards, early stopping off, fp32), the same preprocessed Parquet shards (made once
by `rayload.data.pipeline.preprocess`, cached under --home) and the same batch size. This
machine is shared and noisy, so the two sides of every ratio alternate (A B B A ...) and
each side's figure is the median of its measurements.

1. DDP: `rayload.train.trainer.fit(spec)` with resources.workers=2 (TorchTrainer, Ray Train
   V2, 2 gloo workers of 1 CPU, the data streamed by Ray Data) against a hand-written loop
   started by `python -m torch.distributed.run --standalone --nproc_per_node 2` (this file
   run with --plain-worker, see `plain_worker`): each rank reads the same train shards with
   pyarrow, keeps its contiguous half of the rows, collates them once with
   `rayload.train.batch.collate` before training and deals them out in a new row order every
   epoch, as a DistributedSampler(shuffle=True) loop does (rayload's workers keep their rows
   after the first epoch, `train.worker_cache_mb`, and reshuffle them the same way), trains `rayload.models.build_model`'s model wrapped in
   DDP(gloo) with the same AdamW (+ SparseAdam for sparse embedding tables) and LR schedule
   (sparse tables averaged by rayload's SparseGradSync, or with --plain-sparse-sync ddp by
   DDP's own gloo sparse all-reduce, which rayload replaced: RESULTS.md),
   for the same epochs and batches per rank (drop_last, as rayload does with 2 workers),
   and, like rayload's loop, validates every epoch (each rank a stride of val batches,
   all_gather, the same metrics) and saves a checkpoint on rank 0. Both run as fresh
   subprocesses (one Ray per fit; OMP_NUM_THREADS=1 per worker on both sides), each
   stopped after --child-timeout seconds. eval.batch_size is set to half the validation
   rows so both sides validate one batch per rank. (That first avoided a deadlock, since
   fixed in `Trainer.validate`, which now runs the unwrapped module: DDP's forward
   broadcasts buffers from rank 0 and the ranks run different numbers of val batches.)
   - throughput: median per-epoch samples/s, epoch 0 skipped as warm-up (rayload: the
     `samples_per_s` of `result.history`; plain: the same formula, rows x world / seconds
     of rank 0's epoch loop).  ratio = rayload / plain, target >= 0.95.
   - fixed cost: wall time from launching the command to its exit, minus the time the
     epochs would take at the steady rate (epochs x rows per epoch / median steady
     samples/s of that run). What is left is everything that does not scale with the
     data: interpreter and library imports, Ray start (rayload), worker-group and process
     group start, reading/streaming set-up, epoch-0 warm-up, per-epoch validation and
     checkpoints, shut-down. Measured the same way for both, so the difference is
     rayload's extra fixed cost, target <= 5 s. We do not use "fit() to first report":
     nothing outside the workers sees the first step, and the first report already
     includes a whole epoch.
2. INGEST: one process, `Trainer.train_epoch` (exactly the loop's code) fed by a
   `LocalSession` over `training_datasets(pre, train.cache_dataset)["train"]` (Ray Data
   `iter_torch_batches` with `ArrowCollate`, prefetching, as `rayload train` with one worker
   does: by default over the decoded rows materialised once in the object store,
   `train.cache_dataset`; `--set train.cache_dataset=false` measures a Parquet read every
   epoch; with train.worker_cache_mb=0, so that every epoch streams) against the
   same Trainer loop over a list of `Batch` objects collated in memory beforehand (same
   rows, same batch boundaries). Two Trainers with identical initial weights; epochs
   alternate; each side's first epoch is skipped as warm-up. ratio = stream / memory
   samples/s, target >= 0.95. torch uses --threads threads (default 1: the other core is
   left to the Ray Data reader, as a 1-CPU Ray Train worker would have it).
3. ACCUMULATION: `Trainer.train_epoch` with train.accumulation=4 (micro-batches of the
   spec's batch size B, one optimizer step per 4; one process, so `no_sync` plays no part)
   against accumulation=1 with batches of 4B: both step the optimizer once per 4B rows,
   over batches collated in memory beforehand, epochs alternating, first skipped. ratio = accumulated / big-batch samples/s, target >= 0.9. Then the
   equivalence check: two fresh Trainers (same seed, dropout 0, no batch norm, warm-up off
   so the first step uses the full learning rate) take one `Trainer.step` over 4
   micro-batches of B rows vs one over the same 4B rows as one batch; every parameter must
   match with torch.testing.assert_close(atol=1e-5, rtol=0). The max abs difference is
   printed; the exit status is 1 when the check fails.

Nothing is recorded: the figures are printed only. Scratch files live in a temporary folder
that is removed at the end (--keep to keep it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "platform"))


# ----------------------------------------------------------------------------- arguments


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes and one round (smoke run)")
    ap.add_argument("--spec", default=os.path.join(ROOT, "jobs", "synthetic_dlrm.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra spec override (repeatable)")
    ap.add_argument("--rows", type=int, help="synthetic-ctr rows (default 200000; quick 40000)")
    ap.add_argument("--epochs", type=int, help="epochs per DDP run, the first is warm-up (default 3; quick 2)")
    ap.add_argument("--rounds", type=int, help="rayload/plain DDP run pairs (default 2; quick 1)")
    ap.add_argument("--ingest-epochs", type=int, help="measured epochs per side after one warm-up epoch (default 3; quick 1)")
    ap.add_argument("--accum-epochs", type=int, help="measured epochs per side after one warm-up epoch (default 3; quick 1)")
    ap.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the 1-process measurements")
    ap.add_argument("--only", default="ddp,ingest,accum", help="comma-separated subset of ddp,ingest,accum")
    ap.add_argument("--plain-sparse-sync", choices=["rayload", "ddp"], default="rayload",
                    help="how the plain DDP loop averages sparse embedding gradients: rayload's SparseGradSync (like for like, "
                         "the default) or DDP's own gloo sparse all-reduce (what a hand-written loop gets)")
    ap.add_argument("--home", default=os.environ.get("RAYLOAD_HOME") or os.path.join(tempfile.gettempdir(), "rayload-bench-training"),
                    help="RAYLOAD_HOME: where the preprocessed shards are cached")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder (logs, checkpoints)")
    ap.add_argument("--child-timeout", type=float, default=600.0, help="seconds before a DDP run is stopped as hung")
    # Internal entry points (the subprocesses of measurement 1).
    ap.add_argument("--fit-child", metavar="CONFIG", help=argparse.SUPPRESS)
    ap.add_argument("--plain-worker", metavar="CONFIG", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    quick = args.quick
    args.rows = args.rows or (40_000 if quick else 200_000)
    args.epochs = args.epochs or (2 if quick else 3)
    args.rounds = args.rounds or (1 if quick else 2)
    args.ingest_epochs = args.ingest_epochs or (1 if quick else 3)
    args.accum_epochs = args.accum_epochs or (1 if quick else 3)
    if args.epochs < 2:
        ap.error("--epochs must be >= 2 (epoch 0 is warm-up)")
    return args


def overrides(args, kind: str) -> list[str]:
    """Spec overrides shared by every measurement."""
    # The hand-written loops have no per-ID embedding prior (jobs/synthetic_dlrm.yaml ships one
    # since 2026-11-24): both sides train without it, as every figure before that date did.
    out = ["train.early_stopping=null", "train.precision=fp32", f"train.epochs={args.epochs}", "train.embedding_prior=0"]
    if kind == "synthetic-ctr":
        out += [f"data.source.rows={args.rows}", f"data.source.shard_rows={max(1, args.rows // 4)}"]
    return out


def load(args, extra: list[str] = ()):
    """The spec with the shared overrides, then the measurement's, then --set (last wins)."""
    import rayload

    kind = rayload.load_spec(args.spec).data.source.kind
    return rayload.load_spec(args.spec, overrides(args, kind) + list(extra) + list(args.set))


def quiet() -> None:
    """Ray Data's per-dataset INFO lines would bury the results."""
    import logging

    for name in ("ray.data", "ray.train"):
        logging.getLogger(name).setLevel(logging.WARNING)


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def alternating(n: int):
    """A B, B A, A B, ...: which side goes first in round i (drift hits both alike)."""
    for i in range(n):
        yield ("a", "b") if i % 2 == 0 else ("b", "a")


# ----------------------------------------------------------------------------- 1. DDP


def fit_child(config_path: str) -> None:
    """A fresh process running rayload's fit(spec) with 2 Ray Train workers."""
    with open(config_path) as f:
        cfg = json.load(f)
    from rayload._ray import ensure_ray
    from rayload.spec import JobSpec
    from rayload.train.trainer import fit

    spec = JobSpec.model_validate(cfg["spec"])
    t = time.perf_counter()
    ensure_ray()
    ray_init = time.perf_counter() - t
    t = time.perf_counter()
    result = fit(spec, evaluate_test=False)
    fit_s = time.perf_counter() - t
    with open(cfg["out"], "w") as f:
        json.dump({"history": result.history, "ray_init_s": ray_init, "fit_s": fit_s}, f)


def plain_worker(config_path: str) -> None:
    """The hand-written baseline: one torchrun rank, DDP over gloo, no Ray anywhere."""
    launched = float(os.environ.get("BENCH_LAUNCH_T", time.time()))
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from rayload.evaluate import metrics_for
    from rayload.features import FittedFeatures
    from rayload.models import InputShape, build_model
    from rayload.models._inputs import FieldEmbeddings
    from rayload.spec import JobSpec
    from rayload.train.batch import Layout, collate
    from rayload.train.loop import lr_lambda

    with open(config_path) as f:
        cfg = json.load(f)
    spec, features = JobSpec.model_validate(cfg["spec"]), FittedFeatures.from_json(cfg["features"])
    t = spec.train
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(t.seed)
    np.random.seed(t.seed)
    model = build_model(spec.model.model_dump(), InputShape.from_features(features))
    sync = None
    if cfg["sparse_sync"] == "rayload":  # the sparse tables averaged as rayload's loop does, outside DDP
        from rayload.train.sparse_sync import SparseGradSync, keep_out_of_ddp

        sync = SparseGradSync(keep_out_of_ddp(model), world)
    ddp = DDP(model)
    sparse = [m.weight for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    sparse_ids = {id(p) for p in sparse}
    optimizers = [torch.optim.AdamW([p for p in model.parameters() if id(p) not in sparse_ids], lr=t.lr, weight_decay=t.weight_decay)]
    if sparse:
        optimizers.append(torch.optim.SparseAdam(sparse, lr=t.sparse_lr or t.lr))

    layout = Layout.from_features(features)
    columns = [*layout.columns, "label"]
    train = pa.concat_tables([pq.read_table(p, columns=columns) for p in cfg["train_files"]])
    val = pa.concat_tables([pq.read_table(p, columns=columns) for p in cfg["val_files"]])
    per_rank = train.num_rows // world
    mine = train.slice(rank * per_rank, per_rank)
    bs = t.batch_size
    steps = per_rank // bs  # drop_last, as rayload does with more than one worker
    total_steps = max(1, train.num_rows // max(1, world * bs))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizers[0], lr_lambda(spec, total_steps * t.epochs))
    binary = features.label.task == "binary"
    ckpt_dir = cfg["ckpt_dir"]

    def loss_of(batch):
        out = ddp(*batch.inputs())
        if binary:
            loss = nn.functional.binary_cross_entropy_with_logits(out, batch.label)
        else:
            loss = nn.functional.mse_loss(out, batch.label)
        if t.embedding_l2:
            loss = loss + t.embedding_l2 * sum(sq for m in model.modules() if isinstance(m, FieldEmbeddings) and (sq := m.last_sq) is not None)
        return loss

    # Collated once, before training: the strongest hand-written baseline holds its rank's
    # tensors in memory (rayload's loop keeps its rows after the first epoch). Like a loop with
    # DistributedSampler(shuffle=True) and set_epoch, it deals its rows out in a new order every
    # epoch, here with the same row gather rayload's worker cache uses (train.session._Rows),
    # so both sides do the same data-order work per batch.
    from rayload.train.session import _Rows

    rows_kept = _Rows([collate(mine.slice(i * bs, bs), layout) for i in range(steps)])
    history, first_step = [], None
    for epoch in range(t.epochs):
        ddp.train()
        start, losses = time.perf_counter(), []
        epoch_batches = rows_kept.batches(t.seed * 100_003 + epoch * 1009 + rank)
        for i in range(steps):
            batch = next(epoch_batches)
            loss = loss_of(batch)
            loss.backward()
            if sync is not None:
                sync()
            for opt in optimizers:
                opt.step()
            scheduler.step()
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            if first_step is None:
                first_step = time.time() - launched
        seconds = time.perf_counter() - start
        rows = steps * bs * world
        # Validation as rayload does it: every rank takes a stride of the batches, gather.
        ddp.eval()
        outs, labels = [], []
        with torch.no_grad():
            for j, s in enumerate(range(0, val.num_rows, spec.eval.batch_size)):
                if j % world != rank:
                    continue
                batch = collate(val.slice(s, spec.eval.batch_size), layout)
                out = model(*batch.inputs())
                outs.append((torch.sigmoid(out) if binary else out).numpy())
                labels.append(batch.label.numpy())
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (np.concatenate(labels) if labels else np.zeros(0, np.float32),
                                          np.concatenate(outs) if outs else np.zeros(0, np.float32)))
        m = metrics_for(features.label.task, np.concatenate([g[0] for g in gathered]), np.concatenate([g[1] for g in gathered]))
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizers": [o.state_dict() for o in optimizers],
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, os.path.join(ckpt_dir, f"epoch_{epoch:04d}.pt"))
        dist.barrier()  # rayload's report() is collective too
        history.append({"epoch": epoch, "train_loss": float(np.mean(losses)) if losses else None, "train_rows": rows,
                        "samples_per_s": rows / seconds if seconds else None, "val_auc": m.auc})
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump({"history": history, "first_step_s": first_step}, f)
    dist.destroy_process_group()


def _launch(cmd: list[str], log_path: str, env: dict, timeout: float) -> float:
    env = dict(env, BENCH_LAUNCH_T=repr(time.time()))
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # SIGTERM: the Ray driver shuts its local Ray down, torchrun stops its ranks
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            code = f"timed out after {timeout:.0f}s (--child-timeout)"
    wall = time.perf_counter() - start
    if code != 0:
        with open(log_path) as f:
            tail = f.read()[-4000:]
        raise SystemExit(f"{' '.join(cmd)} failed ({code}); log {log_path} (--keep keeps it):\n{tail}")
    return wall


def _summarise(name: str, out: dict, wall: float) -> dict:
    hist = out["history"]
    steady = [h["samples_per_s"] for h in hist[1:] if h.get("samples_per_s")]
    rate = median(steady)
    rows = [h["train_rows"] for h in hist]
    startup = wall - sum(rows) / rate
    return {"name": name, "wall": wall, "steady": steady, "rate": rate, "rows": rows[-1], "startup": startup,
            "epoch0": hist[0]["samples_per_s"], "auc": hist[-1].get("val_auc"), **{k: v for k, v in out.items() if k != "history"}}


def bench_ddp(args, pre, work: str) -> dict:
    # One validation batch per rank (see the module docstring: an uneven count of validation
    # forwards through the DDP-wrapped model deadlocks models that have buffers).
    val_batch = max(1, -(-pre.counts["written"]["val"] // 2))
    spec = load(args, ["resources.workers=2", "resources.cpus_per_worker=1", f"eval.batch_size={val_batch}",
                       f"train.storage_path={os.path.join(work, 'ray-storage')}"])
    env = dict(os.environ, RAYLOAD_HOME=args.home, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(ROOT, "platform"), os.environ.get("PYTHONPATH")])))
    me = os.path.abspath(__file__)
    print(f"\n[1] DDP: {spec.model.name}, {pre.counts['written']['train']:,} train rows, batch {spec.train.batch_size} per worker, "
          f"2 workers, {spec.train.epochs} epochs per run (epoch 0 = warm-up), {args.rounds} round(s)", flush=True)
    runs = {"rayload": [], "plain": []}
    for i, order in enumerate(alternating(args.rounds)):
        for side in ["rayload" if s == "a" else "plain" for s in order]:
            out_path = os.path.join(work, f"{side}-{i}.json")
            cfg_path = os.path.join(work, f"{side}-{i}-config.json")
            cfg = {"spec": spec.model_dump(mode="json"), "out": out_path}
            if side == "rayload":
                cmd = [sys.executable, me, "--fit-child", cfg_path]
            else:
                ckpt_dir = os.path.join(work, f"plain-ckpt-{i}")
                os.makedirs(ckpt_dir, exist_ok=True)
                cfg.update(features=pre.features.to_json(), train_files=pre.files["train"], val_files=pre.files["val"], ckpt_dir=ckpt_dir,
                           sparse_sync=args.plain_sparse_sync)
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", me, "--plain-worker", cfg_path]
            with open(cfg_path, "w") as f:
                json.dump(cfg, f)
            wall = _launch(cmd, os.path.join(work, f"{side}-{i}.log"), env, args.child_timeout)
            with open(out_path) as f:
                r = _summarise(side, json.load(f), wall)
            runs[side].append(r)
            extra = f"ray.init {r['ray_init_s']:.1f}s, fit() {r['fit_s']:.1f}s" if side == "rayload" else f"first step at {r['first_step_s']:.1f}s"
            print(f"  round {i} {side:7s}: wall {wall:5.1f}s ({extra}); samples/s epoch0 {r['epoch0']:,.0f}, steady "
                  f"{', '.join(f'{x:,.0f}' for x in r['steady'])}; {r['rows']:,} rows/epoch; fixed cost {r['startup']:.1f}s; "
                  f"val auc {r['auc']:.4f}", flush=True)
    rate = {s: median([x for r in rs for x in r["steady"]]) for s, rs in runs.items()}
    startup = {s: median([r["startup"] for r in rs]) for s, rs in runs.items()}
    ratio, diff = rate["rayload"] / rate["plain"], startup["rayload"] - startup["plain"]
    if runs["rayload"][0]["rows"] != runs["plain"][0]["rows"]:
        print(f"  note: rows per epoch differ: rayload {runs['rayload'][0]['rows']:,}, plain {runs['plain'][0]['rows']:,}")
    print(f"DDP: ratio = {ratio:.3f} (target >= 0.95)  steady samples/s: rayload {rate['rayload']:,.0f}, plain torchrun "
          f"(sparse sync: {args.plain_sparse_sync}) {rate['plain']:,.0f}")
    print(f"DDP_STARTUP: difference = {diff:+.1f} s (target <= 5.0)  fixed cost: rayload {startup['rayload']:.1f}s, plain torchrun {startup['plain']:.1f}s")
    return {"ratio": ratio, "startup_diff": diff}


# ----------------------------------------------------------------------------- in-memory sessions


def memory_session_class():
    from rayload.train.session import Session

    class MemorySession(Session):
        """Batches collated beforehand, served from a list (one list per batch size)."""

        def __init__(self, loader: dict, table, layout):
            super().__init__(loader)
            self.table, self.layout, self.cache = table, layout, {}

        def batches(self, size: int) -> list:
            from rayload.train.batch import collate

            if size not in self.cache:
                self.cache[size] = [collate(self.table.slice(s, size), self.layout) for s in range(0, self.table.num_rows, size)]
            return self.cache[size]

        def train_batches(self, epoch: int, batch_size: int):
            return iter(self.batches(batch_size))

    return MemorySession


def read_train(pre, layout):
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = [*layout.columns, "label"]
    return pa.concat_tables([pq.read_table(p, columns=columns) for p in pre.files["train"]]).combine_chunks()


def alternate_epochs(trainers: dict, epochs: int) -> dict:
    """One warm-up epoch each, then `epochs` measured epochs each, order alternating."""
    rates = {name: [] for name in trainers}
    names = list(trainers)
    for name in names:
        trainers[name].train_epoch(0)
    for e, order in enumerate(alternating(epochs), start=1):
        for side in order:
            name = names[0] if side == "a" else names[1]
            rates[name].append(trainers[name].train_epoch(e)["samples_per_s"])
    return rates


# ----------------------------------------------------------------------------- 2. ingest


def bench_ingest(args, pre, work: str) -> dict:
    import torch

    from rayload._ray import ensure_ray
    from rayload.train.batch import Layout
    from rayload.train.loop import Trainer, loader_options
    from rayload.train.local_session import LocalSession
    from rayload.train.trainer import score_metric

    # The stream side streams every epoch (train.worker_cache_mb=0): with the default cache,
    # epochs after the first come from the worker's memory, which is what the memory side is.
    spec = load(args, ["resources.workers=1", "train.worker_cache_mb=0"])
    torch.set_num_threads(args.threads)
    ensure_ray()
    quiet()
    features = pre.features
    layout = Layout.from_features(features)
    steps = max(1, pre.counts["written"]["train"] // spec.train.batch_size)
    score, mode = score_metric(spec, features.label.task)
    from rayload.train.trainer import training_datasets

    train = training_datasets(pre, spec.train.cache_dataset)["train"]  # as _fit_local does
    train.context.enable_progress_bars = False
    stream = LocalSession(loader_options(spec, features), {"train": train, "val": pre.dataset("val")},
                          os.path.join(work, "ingest-run"), 1, score, mode)
    memory = memory_session_class()(loader_options(spec, features), read_train(pre, layout), layout)
    memory.batches(spec.train.batch_size)  # collate outside the timing
    print(f"\n[2] INGEST: 1 process, {args.threads} torch thread(s), {pre.counts['written']['train']:,} rows/epoch, "
          f"{'materialised dataset' if spec.train.cache_dataset else 'Parquet read every epoch'}, batch "
          f"{spec.train.batch_size}, prefetch {spec.train.prefetch_batches}, 1 warm-up + {args.ingest_epochs} epochs per side", flush=True)
    trainers = {"stream": Trainer(spec, features, stream, steps), "memory": Trainer(spec, features, memory, steps)}
    rates = alternate_epochs(trainers, args.ingest_epochs)
    for name, xs in rates.items():
        print(f"  {name:6s}: samples/s {', '.join(f'{x:,.0f}' for x in xs)}")
    ratio = median(rates["stream"]) / median(rates["memory"])
    print(f"INGEST: ratio = {ratio:.3f} (target >= 0.95)  samples/s: Ray Data stream {median(rates['stream']):,.0f}, "
          f"in-memory batches {median(rates['memory']):,.0f}")
    return {"ratio": ratio}


# ----------------------------------------------------------------------------- 3. accumulation


def bench_accumulation(args, pre) -> dict:
    import torch

    from rayload.train.batch import Layout
    from rayload.train.loop import Trainer, loader_options

    k = args.accum
    base = load(args, ["model.dropout=0.0", "model.batch_norm=false", "resources.workers=1"])
    micro = base.train.batch_size
    big = micro * k
    spec_acc = load(args, ["model.dropout=0.0", "model.batch_norm=false", "resources.workers=1", f"train.batch_size={big}", f"train.accumulation={k}"])
    spec_big = load(args, ["model.dropout=0.0", "model.batch_norm=false", "resources.workers=1", f"train.batch_size={big}", "train.accumulation=1"])
    torch.set_num_threads(args.threads)
    features = pre.features
    layout = Layout.from_features(features)
    table = read_train(pre, layout)
    Memory = memory_session_class()
    session = Memory(loader_options(base, features), table, layout)  # one session: both read the same cached lists
    session.batches(micro), session.batches(big)
    steps = max(1, table.num_rows // big)
    print(f"\n[3] ACCUMULATION: 1 process, {args.threads} torch thread(s), {k} x {micro} rows per optimizer step vs 1 x {big}, "
          f"{table.num_rows:,} rows/epoch, 1 warm-up + {args.accum_epochs} epochs per side", flush=True)
    trainers = {"accumulated": Trainer(spec_acc, features, session, steps), "big": Trainer(spec_big, features, session, steps)}
    rates = alternate_epochs(trainers, args.accum_epochs)
    for name, xs in rates.items():
        print(f"  {name:11s}: samples/s {', '.join(f'{x:,.0f}' for x in xs)}")
    ratio = median(rates["accumulated"]) / median(rates["big"])

    # Equivalence: one optimizer step, 4 micro-batches vs the same rows as one batch.
    check_over = ["model.dropout=0.0", "model.batch_norm=false", "resources.workers=1", "train.warmup_steps=0", f"train.batch_size={big}"]
    a = Trainer(load(args, check_over + [f"train.accumulation={k}"]), features, session, 1)
    b = Trainer(load(args, check_over + ["train.accumulation=1"]), features, session, 1)
    rows = table.slice(0, big)
    from rayload.train.batch import collate

    initial = max((p - q).abs().max().item() for p, q in zip(a.model.parameters(), b.model.parameters()))
    start = [p.detach().clone() for p in a.model.parameters()]
    a.step([collate(rows.slice(i * micro, micro), layout) for i in range(k)])
    b.step([collate(rows, layout)])
    moved = max((p.detach() - q).abs().max().item() for p, q in zip(a.model.parameters(), start))
    diffs = [(p.detach() - q.detach()).abs().max().item() for p, q in zip(a.model.parameters(), b.model.parameters())]
    ok = True
    try:
        for p, q in zip(a.model.parameters(), b.model.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), atol=1e-5, rtol=0)
    except AssertionError:
        ok = False
    print(f"ACCUMULATION: ratio = {ratio:.3f} (target >= 0.9)  samples/s: {k} x {micro} accumulated "
          f"{median(rates['accumulated']):,.0f}, 1 x {big} {median(rates['big']):,.0f}")
    print(f"ACCUMULATION_EQUIVALENCE: max abs diff = {max(diffs):.2e} over {len(diffs)} parameter tensors after one step "
          f"(assert_close atol=1e-5 rtol=0: {'PASS' if ok else 'FAIL'}; initial diff {initial:.1e}, largest update {moved:.1e}, lr {a.spec.train.lr})")
    return {"ratio": ratio, "max_diff": max(diffs), "ok": ok}


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.fit_child:
        fit_child(args.fit_child)
        return 0
    if args.plain_worker:
        plain_worker(args.plain_worker)
        return 0
    os.environ["RAYLOAD_HOME"] = args.home
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    if unknown := sorted(only - {"ddp", "ingest", "accum"}):  # a typo measured nothing and exited 0, after the preprocess
        raise SystemExit(f"--only: unknown measurement(s) {unknown}; choose from ddp, ingest, accum")
    work = tempfile.mkdtemp(prefix="rayload-bench-training-")
    t0 = time.perf_counter()
    try:
        from rayload.data.pipeline import preprocess

        quiet()
        spec = load(args)
        t = time.perf_counter()
        pre = preprocess(spec)
        print(f"{os.cpu_count()} CPUs; spec {os.path.relpath(args.spec, ROOT)} ({spec.model.name}); preprocessed shards "
              f"{'reused' if pre.cached else 'written'} in {time.perf_counter() - t:.1f}s: {pre.out_dir} "
              f"({len(pre.files['train'])} train files, {pre.counts['written']['train']:,} rows); scratch {work}", flush=True)
        ok = True
        if "ddp" in only:
            import ray

            ray.shutdown()  # each fit runs its own Ray in its own process
            bench_ddp(args, pre, work)
        if "ingest" in only:
            bench_ingest(args, pre, work)
        if "accum" in only:
            ok = bench_accumulation(args, pre)["ok"]
        print(f"\ntotal {time.perf_counter() - t0:.0f}s")
        return 0 if ok else 1
    finally:
        if args.keep:
            print(f"scratch kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
