"""A tiny model of every architecture, with non-trivial batch-norm statistics, and inputs that
fit it: for the int8 and pruning tests (no Ray, no data)."""

import torch
from torch import nn

from rayload.models import InputShape, build_model

SHAPE = InputShape(dense=3, sparse=(50, 9), bags=(20,))


def model(name: str = "deepfm", batch_norm: bool = True) -> nn.Module:
    torch.manual_seed(0)
    cfg = {"name": name, "embedding_dim": 16, "hidden": [64, 32], "bottom": [8], "dropout": 0.0, "batch_norm": batch_norm,
           "sparse_embeddings": False}
    m = build_model(cfg, SHAPE)
    m.train()
    with torch.no_grad():  # give batch norm non-trivial running statistics
        for _ in range(5):
            m(*inputs(256))
    return m.eval(), cfg


def inputs(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, 3, generator=g)
    sparse = torch.stack([torch.randint(0, 50, (n,), generator=g), torch.randint(0, 9, (n,), generator=g)], dim=1)
    values = torch.randint(0, 20, (2 * n,), generator=g)
    offsets = torch.arange(0, 2 * n, 2)
    return dense, sparse, [values], [offsets]
