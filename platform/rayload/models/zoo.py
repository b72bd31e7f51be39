"""The registered CTR models. Each maps (dense, sparse, bag values, bag offsets) to logits [B]."""

from __future__ import annotations

import torch
from torch import nn

from ._inputs import FieldEmbeddings, InputShape, aligned, cat_padded, mlp


class _Base(nn.Module):
    def __init__(self, shape: InputShape, cfg: dict):
        super().__init__()
        self.shape, self.cfg = shape, cfg
        self.embed = FieldEmbeddings(shape, cfg["embedding_dim"], cfg["sparse_embeddings"])
        # Checkpoints whose model.json predates `align` were built unpadded: 1 rebuilds them as saved.
        self.align = int(cfg.get("align", 1))

    def _deep(self, inputs: int) -> nn.Sequential:
        self.deep_in = aligned(inputs, self.align)
        return mlp([self.deep_in, *self.cfg["hidden"]], self.cfg["dropout"], self.cfg["batch_norm"])


class MLP(_Base):
    """Concatenated embeddings and dense features through an MLP."""

    def __init__(self, shape: InputShape, cfg: dict):
        super().__init__(shape, cfg)
        self.deep = self._deep(shape.fields * cfg["embedding_dim"] + shape.dense)

    def forward(self, dense, sparse, bag_values, bag_offsets):
        emb = self.embed(sparse, bag_values, bag_offsets)
        return self.deep(cat_padded([emb.flatten(1), dense], self.deep_in)).squeeze(-1)


class _FirstOrder(nn.Module):
    """A weight per ID and per dense feature: the linear ("wide") part."""

    def __init__(self, shape: InputShape, sparse_grad: bool):
        super().__init__()
        self.ids = FieldEmbeddings(shape, 1, sparse_grad)
        self.dense = nn.Linear(shape.dense, 1) if shape.dense else None
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, dense, sparse, bag_values, bag_offsets):
        out = self.ids(sparse, bag_values, bag_offsets).sum(dim=(1, 2)) + self.bias
        return out + self.dense(dense).squeeze(-1) if self.dense is not None else out


class WideDeep(_Base):
    def __init__(self, shape: InputShape, cfg: dict):
        super().__init__(shape, cfg)
        self.wide = _FirstOrder(shape, cfg["sparse_embeddings"])
        self.deep = self._deep(shape.fields * cfg["embedding_dim"] + shape.dense)

    def forward(self, dense, sparse, bag_values, bag_offsets):
        emb = self.embed(sparse, bag_values, bag_offsets)
        deep = self.deep(cat_padded([emb.flatten(1), dense], self.deep_in)).squeeze(-1)
        return self.wide(dense, sparse, bag_values, bag_offsets) + deep


class DeepFM(_Base):
    """First order + factorization machine over all fields (dense ones as scaled vectors) + MLP."""

    def __init__(self, shape: InputShape, cfg: dict):
        super().__init__(shape, cfg)
        dim = cfg["embedding_dim"]
        self.first = _FirstOrder(shape, cfg["sparse_embeddings"])
        self.dense_vectors = nn.Parameter(torch.randn(shape.dense, dim) * 0.01)
        self.deep = self._deep((shape.fields + shape.dense) * dim)

    def forward(self, dense, sparse, bag_values, bag_offsets):
        emb = self.embed(sparse, bag_values, bag_offsets)
        fields = torch.cat([emb, dense.unsqueeze(-1) * self.dense_vectors], dim=1)
        fm = 0.5 * (fields.sum(dim=1).pow(2) - fields.pow(2).sum(dim=1)).sum(dim=1)
        deep = self.deep(cat_padded([fields.flatten(1)], self.deep_in)).squeeze(-1)
        return self.first(dense, sparse, bag_values, bag_offsets) + fm + deep


class DLRM(_Base):
    """Bottom MLP for dense features, pairwise dot interactions of all vectors, top MLP."""

    def __init__(self, shape: InputShape, cfg: dict):
        super().__init__(shape, cfg)
        dim = cfg["embedding_dim"]
        self.bottom_in = aligned(shape.dense, self.align)
        self.bottom = mlp([self.bottom_in, *cfg["bottom"], dim], 0.0, cfg["batch_norm"], out=None) if shape.dense else None
        n = shape.fields + (1 if self.bottom is not None else 0)
        if n < 2:  # no pair to interact: the top MLP had no input, every score was the same and nothing trained
            raise ValueError(f"model.name: dlrm interacts pairs of vectors (one per ID column, one for all dense features), and "
                             f"these features give {n}; add features or use another model (mlp, deepfm, wide_deep, dcn)")
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("pairs", torch.stack([rows, cols]), persistent=False)
        self.top = self._deep(len(rows) + (dim if self.bottom is not None else 0))

    def forward(self, dense, sparse, bag_values, bag_offsets):
        vectors = [self.embed(sparse, bag_values, bag_offsets)]
        if self.bottom is not None:
            bottom = self.bottom(cat_padded([dense], self.bottom_in))
            vectors.insert(0, bottom.unsqueeze(1))
        z = torch.cat(vectors, dim=1)
        dots = torch.bmm(z, z.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(cat_padded([bottom, dots] if self.bottom is not None else [dots], self.deep_in)).squeeze(-1)


class CrossLayer(nn.Module):
    """One DCN-v2 cross layer: x_next = x0 * (W x + b) + x. Each layer adds one degree of
    explicit feature crossing: over x0 = the concatenated field vectors, the first layer's
    output holds x0_i * sum_j W_ij x0_j, a bilinear form per pair of fields (a 16 x 16 block of
    W for two 16-dim embeddings) that it can zero for pairs that do not interact, where a dot
    product (DLRM, FM) makes every ID vector serve all its pairings at once. rank > 0 factors W
    as U V^T (DCN-v2's low-rank variant: 2 d r weights instead of d^2)."""

    def __init__(self, width: int, rank: int = 0):
        super().__init__()
        self.down = nn.Linear(width, rank, bias=False) if rank else None
        self.up = nn.Linear(rank or width, width)

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.up(self.down(x) if self.down is not None else x) + x


def rank_saves_nothing(model: nn.Module, rank: int) -> str | None:
    """Why a DCN's cross_rank is no low rank, or None: U and V hold 2 d r weights, at r >= d / 2
    as many as the full matrix's d^2, or more (said once where a job trains, with its real width)."""
    width = getattr(model, "cross_in", None)
    if not isinstance(model, DCN) or width is None or 2 * rank < width:
        return None
    return (f"model.cross_rank {rank} is at least half the cross layers' input width {width}: the low-rank layers hold "
            f"{2 * width * rank} weights each, a full one {width ** 2} (cross_rank 0)")


class DCN(_Base):
    """DCN-v2 (Wang et al., 2021), stacked: cross layers over the concatenated embeddings and
    dense features, then the deep MLP. Zero-padded input columns stay zero through every cross
    layer (x0 is zero there), so the alignment padding changes nothing."""

    def __init__(self, shape: InputShape, cfg: dict):
        super().__init__(shape, cfg)
        self.cross_in = aligned(shape.fields * cfg["embedding_dim"] + shape.dense, self.align)
        self.cross = nn.ModuleList(CrossLayer(self.cross_in, int(cfg.get("cross_rank", 0)))
                                   for _ in range(int(cfg.get("cross_layers", 2))))
        self.deep = self._deep(self.cross_in)

    def forward(self, dense, sparse, bag_values, bag_offsets):
        emb = self.embed(sparse, bag_values, bag_offsets)
        x0 = x = cat_padded([emb.flatten(1), dense], self.cross_in)
        for layer in self.cross:
            x = layer(x0, x)
        return self.deep(x).squeeze(-1)
