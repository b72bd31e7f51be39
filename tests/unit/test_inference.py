"""The serving forward (models/inference.py): every registered model, fp32 and int8, served as a
frozen trace that gives the eager model's logits on batches the trace never saw; a model the
trace gets wrong, or cannot trace, is served eager."""

import copy

import pytest
import torch
from torch import nn

from rayload.models import InputShape, build_model
from rayload.models import quantized as q
from rayload.models.inference import for_serving, synthetic_inputs

SHAPE = InputShape(dense=3, sparse=(50, 9), bags=(20, 7))
NAMES = ["deepfm", "dlrm", "wide_deep", "mlp", "dcn"]


def model(name: str, shape: InputShape = SHAPE) -> nn.Module:
    torch.manual_seed(0)
    cfg = {"name": name, "embedding_dim": 16, "hidden": [64, 32], "bottom": [8], "dropout": 0.2, "batch_norm": True,
           "sparse_embeddings": False}
    m = build_model(cfg, shape)
    with torch.no_grad():  # non-trivial batch-norm statistics
        m.train()
        for seed in range(3):
            m(*synthetic_inputs(shape, 128, seed=seed))
    return m.eval()


def serve(m: nn.Module, shape: InputShape = SHAPE, **kw):
    return for_serving(m, shape, **kw)


def unseen_batches(shape: InputShape = SHAPE):
    """Sizes and bag lengths other than the trace's and the load check's."""
    out = [synthetic_inputs(shape, n, seed=500 + n) for n in (1, 3, 64, 257)]
    if shape.bags:  # long bags: lengths the synthetic batches never have
        d, s, _, _ = out[1]
        values = [torch.randint(0, n, (40,)) for n in shape.bags]
        out.append((d, s, values, [torch.tensor([0, 1, 39]) for _ in shape.bags]))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_fp32_models_serve_traced_and_equal_eager(name):
    """Bit for bit, batch norm included: freezing folded it into the linear layer before it (1 ulp
    off, which failed the load check at random for a regression model's large outputs)."""
    m = model(name)
    forward = serve(m)
    assert forward.mode == "torchscript"
    with torch.no_grad():
        for batch in unseen_batches():
            assert torch.equal(forward(*batch), m(*batch))
        big = copy.deepcopy(m)  # outputs near 1000: an ulp is 6e-5, past the check's 1e-6
        last = [p for p in big.parameters() if p.dim() == 1][-1]
        last.add_(1000.0)
        assert serve(big).mode == "torchscript"


@pytest.mark.parametrize("name", NAMES)
def test_int8_models_serve_traced_and_equal_their_eager_forward(name):
    fp32 = model(name)
    state, plan = q.quantize(copy.deepcopy(fp32))
    int8 = q.build(build_model(dict(name=name, embedding_dim=16, hidden=[64, 32], bottom=[8], dropout=0.2, batch_norm=True,
                                    sparse_embeddings=False), SHAPE), state, plan)
    assert plan["linear"] and plan["embedding"] and plan["bag"]
    forward = serve(int8)
    assert forward.mode == "torchscript"
    with torch.no_grad():
        for batch in unseen_batches():
            torch.testing.assert_close(forward(*batch), int8(*batch), rtol=0, atol=1e-6)


def test_models_without_dense_features_or_bags_trace():
    shape = InputShape(dense=0, sparse=(30,), bags=())
    m = model("deepfm", shape)
    forward = serve(m, shape)
    assert forward.mode == "torchscript"
    with torch.no_grad():
        for batch in unseen_batches(shape):
            torch.testing.assert_close(forward(*batch), m(*batch), rtol=0, atol=1e-6)


class _SizeFrozen(nn.Module):
    """Reads a batch's size with len(), which a trace records as a constant (the defect the int8
    lookups had): the traced graph is right only for the example's size."""

    def __init__(self, broadcast: bool = False):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))
        self.broadcast = broadcast

    def forward(self, dense, sparse, bag_values, bag_offsets):
        if self.broadcast:  # silently wrong: the trace scales every batch by the example's size
            return dense @ self.w * len(dense)
        return dense @ self.w + torch.arange(len(dense), dtype=torch.float32)  # fails on other sizes


class _NaNTrace(nn.Module):
    """len() is a constant in the trace (the example's 5 rows): 0 / (len - 5) is NaN in the traced
    graph on every batch, 0 (or -0) in the eager model on every other size."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, dense, sparse, bag_values, bag_offsets):
        return dense @ self.w + torch.zeros(()) / (len(dense) - 5)


def test_a_trace_that_gives_nan_is_not_served():
    """max(0.0, nan) is 0.0: a traced graph giving NaN on every check batch passed the check."""
    m = _NaNTrace().eval()
    forward = serve(m, InputShape(dense=3, sparse=(), bags=()))
    assert forward.mode.startswith("eager: trace differs by nan")
    batch = synthetic_inputs(InputShape(dense=3, sparse=(), bags=()), 4, seed=0)
    with torch.no_grad():
        assert torch.isfinite(forward(*batch)).all()


class _Untraceable(nn.Module):
    def forward(self, dense, sparse, bag_values, bag_offsets):
        return {"logits": dense.sum(1)}  # a dict of outputs: not what the scorer takes, and not traceable as is


@pytest.mark.parametrize("broadcast, mode", [(True, "eager: trace differs"), (False, "eager: trace fails on a check batch")])
def test_a_trace_that_is_wrong_on_other_batches_is_not_served(broadcast, mode):
    m = _SizeFrozen(broadcast).eval()
    forward = serve(m, InputShape(dense=3, sparse=(), bags=()))
    assert forward.mode.startswith(mode)
    batch = synthetic_inputs(InputShape(dense=3, sparse=(), bags=()), 11, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(forward(*batch), m(*batch))


def test_a_model_that_cannot_be_traced_is_served_eager():
    forward = serve(_Untraceable().eval(), InputShape(dense=3, sparse=(), bags=()))
    assert forward.mode.startswith("eager: tracing failed")


def test_torchscript_off_serves_eager():
    m = model("mlp")
    forward = serve(m, enabled=False)
    assert forward.mode == "eager: torchscript off"
    batch = unseen_batches()[0]
    with torch.no_grad():
        assert torch.equal(forward(*batch), m(*batch))
