import pytest
import torch

from rayload.models import MODELS, InputShape, build_model
from rayload.spec import ModelSpec

SHAPES = [InputShape(3, (10, 20), (7,)), InputShape(0, (5,), ()), InputShape(4, (), (6, 9))]


def inputs(shape: InputShape, n: int = 8):
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(n, shape.dense, generator=g)
    sparse = torch.stack([torch.randint(0, c, (n,), generator=g) for c in shape.sparse], 1) if shape.sparse else torch.zeros(n, 0, dtype=torch.long)
    values, offsets = [], []
    for c in shape.bags:
        lengths = torch.randint(1, 4, (n,), generator=g)
        values.append(torch.randint(0, c, (int(lengths.sum()),), generator=g))
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]]))
    return dense, sparse, values, offsets


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("shape", SHAPES, ids=["dense+ids+bag", "ids-only", "dense+bags"])
def test_forward_shape_and_backward(name, shape):
    model = build_model(ModelSpec(name=name, hidden=[16, 8], bottom=[8], embedding_dim=4, batch_norm=True).model_dump(), shape)
    out = model(*inputs(shape))
    assert out.shape == (8,) and torch.isfinite(out).all()
    out.sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)


def test_sparse_embeddings_give_sparse_gradients():
    shape = SHAPES[0]
    model = build_model(ModelSpec(name="deepfm", sparse_embeddings=True, hidden=[8]).model_dump(), shape)
    model(*inputs(shape)).sum().backward()
    table = model.embed.tables[0].weight
    assert table.grad.is_sparse


def test_unknown_model_name_is_refused():
    with pytest.raises(ValueError, match="unknown model 'xgb'; registered: mlp, wide_deep, deepfm, dlrm"):
        build_model({"name": "xgb"}, SHAPES[0])


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("shape", SHAPES, ids=["dense+ids+bag", "ids-only", "dense+bags"])
def test_aligned_inputs_compute_what_the_unpadded_model_computes(name, shape):
    """align pads every MLP input width to a multiple of 8 (tensor cores); the zero columns change
    no output, and a model.json without `align` (written before it existed) rebuilds unpadded."""
    cfg = ModelSpec(name=name, hidden=[16, 8], bottom=[8], embedding_dim=3, dropout=0.0).model_dump()
    padded = build_model(cfg, shape).eval()
    legacy = build_model({k: v for k, v in cfg.items() if k != "align"}, shape).eval()
    firsts = [m for m in padded.modules() if isinstance(m, torch.nn.Sequential)]
    assert firsts and all(seq[0].in_features % 8 == 0 for seq in firsts)
    legacy_state = legacy.state_dict()
    own = padded.state_dict()
    for key, value in legacy_state.items():
        if own[key].shape != value.shape:  # a padded first layer: the legacy weights in its leading columns
            assert own[key].shape[1] > value.shape[1] and own[key].shape[1] % 8 == 0
            own[key] = torch.zeros_like(own[key]).normal_()  # noise facing the zero columns must not matter
            own[key][:, : value.shape[1]] = value
        else:
            own[key] = value
    padded.load_state_dict(own)
    args = inputs(shape)
    assert torch.allclose(padded(*args), legacy(*args), atol=1e-6)
