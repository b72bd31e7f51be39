"""int8 building blocks without Ray: symmetric per-row quantization, batch-norm folding, the
int8 model rebuilt from plain tensors, and its scores against fp32's."""

import copy
import io

import pytest
import torch
from torch import nn

from rayload.models import InputShape, build_model
from rayload.models import quantized as q

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


def test_per_row_quantization_round_trips_within_half_a_step():
    w = torch.randn(40, 16) * torch.logspace(-3, 1, 40).unsqueeze(1)
    codes, scale = q.quantize_rows(w)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127
    err = (codes.float() * scale.unsqueeze(1) - w).abs()
    assert torch.all(err <= scale.unsqueeze(1) / 2 + 1e-7)


def test_folding_batch_norm_into_linear_changes_no_output():
    m, _ = model()
    x = inputs(64)
    before = m(*x)
    folded = copy.deepcopy(m)
    names = q.fold_batch_norms(folded)
    assert names and not any(isinstance(mod, nn.BatchNorm1d) for mod in folded.modules())
    assert torch.allclose(folded(*x), before, atol=1e-5)


@pytest.mark.parametrize("name", ["deepfm", "dlrm", "wide_deep", "mlp", "dcn"])
def test_int8_model_rebuilt_from_plain_tensors_scores_close_to_fp32(name):
    m, cfg = model(name)
    state, plan = q.quantize(copy.deepcopy(m))
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)  # the checkpoint contract: no pickled objects
    int8 = q.build(build_model(cfg, SHAPE), loaded, plan)
    x = inputs(512, seed=7)
    with torch.no_grad():
        p32, p8 = torch.sigmoid(m(*x)), torch.sigmoid(int8(*x))
    assert (p32 - p8).abs().max() < 0.02 and (p32 - p8).abs().mean() < 0.003
    assert plan["linear"] and plan["embedding"] and plan["bag"]
    kinds = {type(mod).__name__ for mod in int8.modules()}
    assert {"Int8Linear", "Int8Embedding", "Int8EmbeddingBag"} <= kinds
    # Tables whose int8 rows would not be smaller (first-order weights, dim 1) stay fp32; no wider one does.
    fp32_tables = [mod for mod in int8.modules() if isinstance(mod, (torch.nn.Embedding, torch.nn.EmbeddingBag))]
    assert all(t.embedding_dim < q.MIN_INT8_EMBEDDING_DIM for t in fp32_tables)
    assert bool(fp32_tables) == (name in ("deepfm", "wide_deep"))  # the models with first-order weights


def test_a_state_that_does_not_fit_the_architecture_is_refused():
    m, cfg = model()
    state, plan = q.quantize(copy.deepcopy(m))
    state.pop(next(k for k in state if k.startswith("dense_vectors")))
    with pytest.raises(ValueError, match="does not fit"):
        q.build(build_model(cfg, SHAPE), state, plan)


@pytest.mark.parametrize("dim,per_row", [(16, True), (1, False)])
def test_int8_lookups_equal_the_dequantized_table_for_ids_and_uneven_bags(dim, per_row):
    torch.manual_seed(3)
    codes, scale = q.quantize_rows(torch.randn(100, dim) * 0.05, per_row=per_row)
    table = codes.float() * (scale.unsqueeze(1) if per_row else scale)
    ids = torch.randint(0, 100, (64, 2))[:, 1]  # a strided column, as FieldEmbeddings passes it
    assert torch.allclose(q.Int8Embedding(codes, scale)(ids), table[ids], atol=1e-7)
    values, offsets = torch.randint(0, 100, (10,)), torch.tensor([0, 1, 4, 6])
    expected = nn.functional.embedding_bag(values, table, offsets, mode="mean")
    assert torch.allclose(q.Int8EmbeddingBag(codes, scale)(values, offsets), expected, atol=1e-7)
