"""int8 scores depend slightly on the batch (activations are quantized per batch), so "served
equals offline" holds within 1e-6 for fp32 and within the stated int8 tolerance for int8: a row
scored alone (a served request) and in a large batch (offline evaluation) stay within it of each
other and of fp32 (README, "Compression": below 0.01 on average, below 0.03 for 99% of rows)."""

import copy

import numpy as np
import pytest
import torch

from rayload.models import build_model
from rayload.models import quantized as q
from test_quantized import SHAPE, inputs, model

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
