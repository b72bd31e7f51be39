"""int8 building blocks without Ray: symmetric per-row quantization, batch-norm folding, the
int8 model rebuilt from plain tensors, and its scores against fp32's, for a row alone and in a
large batch."""

import copy
import io

import numpy as np
import pytest
import torch
from torch import nn

from _tiny_model import SHAPE, inputs, model
from rayload.models import InputShape, build_model
from rayload.models import quantized as q

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


# ---------------------------------------------------------------- int8 scores: a row alone and in a batch

ROWS = 128  # scored one at a time


def _alone(net, x) -> torch.Tensor:
    dense, sparse, values, _ = x
    one = [torch.zeros(1, dtype=torch.long)]
    return torch.cat([net(dense[i:i + 1], sparse[i:i + 1], [values[0][2 * i:2 * i + 2]], one) for i in range(ROWS)])


def _within_tolerance(p: torch.Tensor, other: torch.Tensor) -> None:
    diff = (p - other).abs().numpy()
    assert diff.mean() < 0.01 and np.quantile(diff, 0.99) < 0.03, (diff.mean(), diff.max())


@pytest.mark.parametrize("name", ["mlp", "dcn", "deepfm"])
def test_int8_scores_of_a_row_alone_and_in_a_large_batch_stay_within_the_stated_tolerance(name):
    """int8 scores depend slightly on the batch (activations are quantized per batch), so "served
    equals offline" holds within 1e-6 for fp32 and within the stated int8 tolerance for int8: a row
    scored alone (a served request) and in a large batch (offline evaluation) stay within it of each
    other and of fp32 (README, "Compression": below 0.01 on average, below 0.03 for 99% of rows)."""
    fp32, cfg = model(name)
    state, plan = q.quantize(copy.deepcopy(fp32))
    int8 = q.build(build_model(cfg, SHAPE), state, plan)
    x = inputs(4096, seed=7)
    with torch.no_grad():
        batched, alone, reference = int8(*x)[:ROWS], _alone(int8, x), fp32(*x)[:ROWS]
        assert torch.allclose(_alone(fp32, x), reference, atol=1e-5)  # fp32: the batch changes nothing
    for p in (alone, batched):
        _within_tolerance(torch.sigmoid(p), torch.sigmoid(reference))
    _within_tolerance(torch.sigmoid(alone), torch.sigmoid(batched))


def test_narrow_int8_tables_keep_a_scale_per_row():
    """Tables below dim 8 shared one scale: a tail ID's small row was rounded to the step of the
    frequent IDs' large rows (many became all zeros) and a dim-4 DeepFM moved by 0.07."""
    from rayload.models.inference import synthetic_inputs

    shape = InputShape(3, (1000, 500), (800,))
    torch.manual_seed(0)
    cfg = {"name": "deepfm", "embedding_dim": 4, "hidden": [64, 32], "dropout": 0.0, "batch_norm": False, "sparse_embeddings": False}
    m = build_model(cfg, shape).eval()
    with torch.no_grad():
        for t in [*m.embed.tables, *m.embed.bags]:
            t.weight.mul_(5)
            t.weight[:10].mul_(60)  # frequent IDs' rows ~60x the tail's
    state, plan = q.quantize(copy.deepcopy(m))
    assert all(state[f"{name}.scale"].numel() == state[f"{name}.q"].shape[0] for name in plan["embedding"] + plan["bag"])
    int8 = q.build(build_model(cfg, shape), state, plan)
    x = synthetic_inputs(shape, 2000, seed=4)
    with torch.no_grad():
        gap = (torch.sigmoid(int8(*x)) - torch.sigmoid(m(*x))).abs()
    assert gap.max() < 0.01, gap.max()
