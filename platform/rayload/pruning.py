"""Magnitude pruning for `rayload compress --method prune` (compression.py gates and writes
the result): which weights are cut, the short fine-tune with the masks on, and baking the masks in."""

from __future__ import annotations

import torch
from torch import nn


def _linears(model: nn.Module, structured: bool) -> list[nn.Linear]:
    # Embedding tables are not pruned: a zeroed ID row is a different model, not a smaller one.
    # Structured pruning removes whole output neurons, so an output layer (1 unit) is left alone.
    return [m for m in model.modules() if isinstance(m, nn.Linear) and not (structured and m.out_features == 1)]


def prune(model: nn.Module, amount: float, structured: bool):
    """Magnitude pruning: global L1 over all linear weights (unstructured), or the output neurons
    with the smallest L2 norm in each linear layer (structured). Masks stay on for fine-tuning."""
    import torch.nn.utils.prune as tp

    layers = _linears(model, structured)
    if structured:
        norms = _batch_norms_after(model)
        for layer in layers:
            _prune_neurons(layer, norms.get(layer), amount)
    else:
        tp.global_unstructured([(m, "weight") for m in layers], pruning_method=tp.L1Unstructured, amount=amount)
    return model, {"amount": amount, "structured": structured}


def _batch_norms_after(model: nn.Module) -> dict[nn.Linear, nn.BatchNorm1d]:
    """Each Linear followed by an affine BatchNorm1d of its outputs in a Sequential (models.mlp's
    Linear-BatchNorm-ReLU blocks), with that batch norm."""
    pairs = {}
    for seq in model.modules():
        if isinstance(seq, nn.Sequential):
            for lin, bn in zip(list(seq)[:-1], list(seq)[1:]):
                if isinstance(lin, nn.Linear) and isinstance(bn, nn.BatchNorm1d) and bn.affine and bn.num_features == lin.out_features:
                    pairs[lin] = bn
    return pairs


def _prune_neurons(layer: nn.Linear, norm: nn.BatchNorm1d | None, amount: float) -> None:
    """Cut the `amount` of the layer's output neurons whose effective weight rows have the smallest
    L2 norm: the row scaled by the batch norm after it (gamma / sqrt(running_var + eps), the
    weights once folded, as int8 serving folds them), since that scale, not the raw row, says how
    much the neuron passes on. A cut neuron outputs nothing: its weight row and bias are masked,
    and so are the batch norm's gamma and beta, or it would output relu(beta - gamma * mu / sigma),
    a constant the next layer still reads. The architecture stays as it was: the checkpoint loads
    like its source, with zeros where neurons were cut."""
    import torch.nn.utils.prune as tp

    with torch.no_grad():
        importance = layer.weight.detach().float().norm(p=2, dim=1)
        if norm is not None and norm.running_var is not None:
            importance = importance * (norm.weight.detach().float().abs() / torch.sqrt(norm.running_var.float() + norm.eps))
    cut = round(amount * layer.out_features)  # as ln_structured counts a fraction
    mask = torch.ones(layer.out_features)
    if cut:
        mask[torch.topk(importance, cut, largest=False).indices] = 0.0
    tp.custom_from_mask(layer, "weight", mask=mask.unsqueeze(1).expand_as(layer.weight).to(layer.weight.dtype).clone())
    if layer.bias is not None:  # a removed neuron outputs nothing, not relu(bias)
        tp.custom_from_mask(layer, "bias", mask=mask.to(layer.bias.dtype))
    if norm is not None:
        tp.custom_from_mask(norm, "weight", mask=mask.to(norm.weight.dtype))
        tp.custom_from_mask(norm, "bias", mask=mask.to(norm.bias.dtype))


def unmask(model: nn.Module) -> None:
    """Bake the masks into the weights (linear layers and the batch norms masked with them)."""
    import torch.nn.utils.prune as tp

    for m in model.modules():
        for name in ("weight", "bias"):
            if hasattr(m, f"{name}_mask") and hasattr(m, f"{name}_orig"):
                tp.remove(m, name)


def sparsity(model: nn.Module) -> float:
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    return float(sum(int((w == 0).sum()) for w in weights) / max(sum(w.numel() for w in weights), 1))


def finetune(model: nn.Module, dataset, layout, epochs: int, lr: float, batch_size: int, weight_decay: float,
             class_weights: tuple[float, float] | None = None, grad_clip: float | None = None) -> None:
    """A short fine-tune of the dense layers with the pruning masks applied (cut weights stay 0),
    at the job's learning rate, weight decay, gradient clipping and the class weights the model
    was trained with (the training loop's loss); the embedding tables stay fixed. Batches of
    batch_size rows across shard files, as the trainer reads them; a one-row batch (the split's
    tail) is skipped for a batch-norm model, which cannot normalise a single row in training."""
    from .train.batch import collate
    from .train.loop import binary_loss

    for m in model.modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            m.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
    model.train()
    norms = any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules())
    for _ in range(epochs):
        for table in _train_batches(dataset, batch_size):
            if norms and table.num_rows < 2:
                continue
            batch = collate(table, layout)
            loss = binary_loss(model(*batch.inputs()).float(), batch.label, class_weights)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip:
                nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], grad_clip)
            opt.step()
    model.eval()


def _train_batches(dataset, batch_size: int):
    """Local shards in exact batches across files (file by file, every shard's tail was a short
    batch of its own); a Ray Dataset batches across its blocks itself."""
    from .data.result import LocalShards

    if isinstance(dataset, LocalShards):
        return dataset.exact_batches(batch_size)
    return dataset.iter_batches(batch_size=batch_size, batch_format="pyarrow")
