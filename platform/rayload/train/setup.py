"""What the training loop sets up before its first step: the precision, seeds, the model (with
transfer and DDP preparation), the optimizers and the learning-rate schedule's length and
shape. `train.loop` imports these names, so either module can be named for them."""

from __future__ import annotations

import inspect
import logging
import math
import random

import numpy as np
import torch
from torch import nn

from ..features import FittedFeatures
from ..models import InputShape, build_model
from ..models.zoo import rank_saves_nothing
from ..spec import JobSpec
from . import transfer
from .session import Session
from .sparse_sync import keep_out_of_ddp, sparse_tables

log = logging.getLogger(__name__)


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto`: bf16 on a CUDA device that computes it natively, else fp32."""
    if precision != "auto":
        return precision
    if device.type == "cuda" and native_bf16():
        return "bf16"
    return "fp32"


def native_bf16() -> bool:
    """Whether the current CUDA device has bf16 arithmetic (Ampere and later, ROCm). By default
    torch.cuda.is_bf16_supported() also counts GPUs that only emulate it (Turing, Volta), where
    bf16 runs slower than fp32; a torch without the argument is asked as it is."""
    query = torch.cuda.is_bf16_supported
    if "including_emulation" in inspect.signature(query).parameters:
        return bool(query(including_emulation=False))
    return bool(query())


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def seed_rank(seed: int, rank: int, epoch: int = 0) -> None:
    """Seed this rank's random streams (torch's, CUDA's, numpy's and Python's) for training
    from `epoch` on: drawn from (seed, rank, epoch), so ranks draw different dropout masks and a
    run draws the same ones again. Initialisation uses `seed` alone, the same on every rank."""
    state = np.random.SeedSequence(seed, spawn_key=(rank, epoch)).generate_state(4, np.uint32)
    torch.manual_seed(int(state[0]) << 32 | int(state[1]))  # every CUDA device's too
    np.random.seed(int(state[2]))
    random.seed(int(state[3]))


def _every_rank_on_a_gpu(spec: JobSpec, session: Session) -> bool:
    """Whether every rank computes on a GPU, agreed by all of them: each deciding alone, the GPU
    ranks took SyncBatchNorm and a CPU-fallback rank plain batch norm, so their collectives
    differed (SyncBatchNorm's gather on some ranks, the shared statistics' broadcast on the
    others) and the group deadlocked. Only resources.cpu_fallback lets a rank be on its CPU,
    and it runs gloo, which reduces CPU tensors."""
    on_gpu = session.device.type != "cpu"
    if not spec.resources.cpu_fallback or not torch.distributed.is_initialized():
        return on_gpu
    flag = torch.tensor([int(on_gpu)])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def make_model(spec: JobSpec, features: FittedFeatures, session: Session) -> nn.Module:
    """The model, initialised alike on every rank (the same seed), prepared by the session (DDP);
    it returns with this rank's own random streams seeded for training (`seed_rank`)."""
    seed_everything(spec.train.seed)  # the same initial weights on every rank
    model = build_model(spec.model.model_dump(), InputShape.from_features(features))
    if session.rank == 0 and (note := rank_saves_nothing(model, spec.model.cross_rank)):
        log.warning("%s", note)
    if spec.train.init_from:
        transfer.init_weights(model, spec.train.init_from, spec.model.model_dump(mode="json"))
        transfer.freeze(model, spec.train.freeze)
    if spec.train.sync_bn and session.world_size > 1:
        if not _every_rank_on_a_gpu(spec, session):  # a GPU worker fallen back to its CPU: SyncBatchNorm runs on GPUs only
            log.warning("train.sync_bn: a worker fell back to the CPU (resources.cpu_fallback), where PyTorch cannot "
                        "synchronise batch norm; plain batch norm on every rank, with rank 0's statistics shared before validation")
        else:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    transfer.check_trainable(model, spec.train.freeze)
    tables = sparse_tables(model)
    if session.world_size > 1:
        keep_out_of_ddp(model, tables)  # sparse tables: averaged by SparseGradSync, not by DDP
    model = session.prepare(model)
    # Without it every rank would go on from the shared initialisation seed: one torch stream
    # per rank, all alike, so every rank would draw the same dropout masks.
    seed_rank(spec.train.seed, session.rank)
    return model


def make_optimizers(model: nn.Module, spec: JobSpec, fused: bool | None = None) -> list[torch.optim.Optimizer]:
    """AdamW for dense weights; SparseAdam (or Adagrad) for embedding tables with sparse gradients
    (make_model has checked that some dense weight is trainable). On CUDA the dense AdamW is the
    fused kernel (one launch for all weights instead of a few per weight group); `fused=None`
    picks it by the weights' device."""
    t = spec.train
    sparse_ids = {id(p) for _, p in sparse_tables(model)}
    trainable = [p for p in model.parameters() if p.requires_grad]  # frozen parts get no optimizer state
    dense = [p for p in trainable if id(p) not in sparse_ids]
    sparse = [p for p in trainable if id(p) in sparse_ids]
    if fused is None:
        fused = bool(dense) and all(p.is_cuda for p in dense)
    opts = [torch.optim.AdamW(dense, lr=t.lr, weight_decay=t.weight_decay, fused=fused or None)]
    if sparse:
        cls = torch.optim.SparseAdam if t.sparse_optimizer == "adam" else torch.optim.Adagrad
        opts.append(cls(sparse, lr=t.sparse_lr or t.lr))
    return opts


def steps_per_epoch(train_rows: int, world_size: int, batch_size: int, accumulation: int) -> int:
    """The optimizer steps each rank takes per epoch (the schedule's unit): ranks get equal
    shares of the rows (the remainder is dropped); with more than one rank a short last
    micro-batch is dropped (every rank must step alike), with one it is kept; a short last
    group of micro-batches still steps."""
    micro = max(1, batch_size // accumulation)
    rows = train_rows // max(1, world_size)
    batches = rows // micro if world_size > 1 else -(-rows // micro)
    return max(1, -(-batches // accumulation))


def lr_lambda(spec: JobSpec, total_steps: int):
    t = spec.train

    def factor(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.lr_decay == "none" or total_steps <= t.warmup_steps:
            return 1.0
        progress = min(1.0, (step - t.warmup_steps) / max(1, total_steps - t.warmup_steps))
        return 0.5 * (1 + math.cos(math.pi * progress)) if t.lr_decay == "cosine" else 1.0 - progress

    return factor


def place_steps(opt: torch.optim.Optimizer) -> None:
    """Step counts where a fused (or capturable) group's kernel reads them: on its parameters'
    device, as float32. load_state_dict places them by the *saved* groups' settings, so a state
    saved by an unfused optimizer (a CPU run, a CPU-fallback worker) kept them on the CPU when
    resumed on a GPU, where this device's fused AdamW takes over."""
    for group in opt.param_groups:
        if not (group.get("fused") or group.get("capturable")):
            continue
        for p in group["params"]:
            state = opt.state.get(p)
            if state and torch.is_tensor(state.get("step")) and state["step"].device != p.device:
                state["step"] = state["step"].to(dtype=torch.float32, device=p.device)
