"""Sparse embedding gradients averaged across ranks by rayload, not by DDP.

Why not DDP's own path: DDP hands a sparse gradient to c10d's gloo `AsyncSparseAllreduceWork`,
which runs on a gloo worker thread while autograd carries on. On torch 2.13 (CPU, 2 gloo
workers) that corrupted the heap in about 1 run of 6 (glibc "malloc(): unaligned tcache chunk
detected"; the core dump's aborting thread was inside AsyncSparseAllreduceWork::allreduce ->
coalesce; benchmarks/RESULTS.md). So the sparse tables are left out of DDP
(`_set_params_and_buffers_to_ignore_for_model`) and synchronised here, on the training thread,
once per optimizer step (after the last micro-batch, so `no_sync` accumulation stays local):

1. every rank coalesces each table's gradient (duplicate rows summed locally);
2. three all_gathers for all tables together: the row counts, the row indices (int64), the
   values (flattened, the gradient's dtype), each padded to the largest rank's length
   because all_gather needs equal shapes;
3. every rank concatenates the parts in rank order, divides by the world size (DDP averages)
   and coalesces, so every rank applies the identical gradient and the tables stay equal.

The result is what DDP's sparse all-reduce computes; the traffic is the same order (each rank
receives every rank's touched rows). Blocking collectives on the training thread cost a
little overlap with the backward pass; the dense part still overlaps through DDP's buckets.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); the
# supported range (torch>=2.5) includes releases with only the old name (2.11 on a lent H200).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def sparse_tables(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, weight) of every trainable embedding table that produces sparse gradients."""
    names = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}
    return [(n, p) for n, p in model.named_parameters() if id(p) in names and p.requires_grad]


def keep_out_of_ddp(model: nn.Module, tables: list[tuple[str, nn.Parameter]] | None = None) -> list[nn.Parameter]:
    """Mark the sparse tables (`sparse_tables(model)` unless given) so a DDP wrap made later
    leaves them alone; returns them."""
    tables = sparse_tables(model) if tables is None else tables
    if tables:
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [n for n, _ in tables])
    return [p for _, p in tables]


class SparseGradSync:
    """Average the sparse gradients of `params` over the default process group, in place."""

    def __init__(self, params: list[nn.Parameter], world_size: int):
        self.params, self.world_size = params, world_size
        # DDP broadcasts rank 0's weights at the wrap, but not of the parameters it ignores: the
        # seeded initialisation already makes the tables equal; one broadcast makes sure.
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, 0)

    def __call__(self) -> None:
        if not self.params:
            return
        grads = [self._local(p) for p in self.params]
        device = self.params[0].device
        counts = torch.tensor([g.indices().shape[1] for g in grads], dtype=torch.int64, device=device)
        all_counts = self._gather(counts).tolist()  # [world][tables]
        dims = [int(p.shape[1]) for p in self.params]
        indices = torch.cat([g.indices()[0] for g in grads])
        values = torch.cat([g.values().reshape(-1) for g in grads])
        all_indices = self._gather(indices, max(sum(rank) for rank in all_counts))
        all_values = self._gather(values, max(sum(n * d for n, d in zip(rank, dims)) for rank in all_counts))
        parts_i: list[list[torch.Tensor]] = [[] for _ in self.params]
        parts_v: list[list[torch.Tensor]] = [[] for _ in self.params]
        for r in range(self.world_size):
            row, val = 0, 0
            for t, dim in enumerate(dims):
                n = all_counts[r][t]
                parts_i[t].append(all_indices[r, row:row + n])
                parts_v[t].append(all_values[r, val:val + n * dim].view(n, dim))
                row, val = row + n, val + n * dim
        for t, p in enumerate(self.params):
            if not any(rank[t] for rank in all_counts):
                p.grad = None  # no rank touched the table: the optimizer skips it, as in one process
                continue
            idx, val = torch.cat(parts_i[t]).unsqueeze(0), torch.cat(parts_v[t]) / self.world_size
            p.grad = torch.sparse_coo_tensor(idx, val, p.shape, dtype=val.dtype, device=device, check_invariants=False).coalesce()

    @staticmethod
    def _local(p: nn.Parameter) -> torch.Tensor:
        g = p.grad
        if g is None:  # this rank's micro-batches never reached the table: it contributes no rows
            return torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.int64, device=p.device),
                                           torch.zeros((0, p.shape[1]), dtype=p.dtype, device=p.device), p.shape,
                                           check_invariants=False)
        if not g.is_sparse:
            raise TypeError(f"expected a sparse gradient for an embedding table of shape {tuple(p.shape)}, got a dense one")
        return g.coalesce()

    def _gather(self, tensor: torch.Tensor, length: int | None = None) -> torch.Tensor:
        """all_gather of a 1-D tensor, zero-padded to `length`; returns (world, length)."""
        length = tensor.shape[0] if length is None else length
        padded = torch.zeros(length, dtype=tensor.dtype, device=tensor.device)
        padded[: tensor.shape[0]] = tensor
        out = torch.empty(self.world_size * length, dtype=tensor.dtype, device=tensor.device)
        _ALL_GATHER(out, padded)  # gloo wants the flat (world * length) output
        return out.view(self.world_size, length)


@torch.no_grad()
def clip_grad_norm_(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over dense and sparse gradients together: the total norm
    counts a sparse gradient's rows once each (coalesced: duplicate rows summed, as the
    optimizer applies them), and every gradient is scaled by the same factor, so the bound
    holds for the whole model. Returns the total norm before clipping.

    Call it on the gradients the optimizers will apply: after SparseGradSync averaged the
    tables' over the ranks (every rank then computes the same factor) and after a GradScaler
    unscaled them."""
    grads = []
    for p in params:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            p.grad = p.grad.coalesce()
            grads.append(p.grad.values())  # a view: scaling it scales the sparse gradient
        else:
            grads.append(p.grad)
    if not grads:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]))
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(factor.to(g.dtype))
    return total
