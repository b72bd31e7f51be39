import os

import pytest
import torch

from rayload.models import MODELS, InputShape, build_model
from rayload.spec import ModelSpec

SHAPES = [InputShape(3, (10, 20), (7,)), InputShape(0, (5, 4), ()), InputShape(4, (), (6, 9))]  # ids-only: two fields (DLRM needs a pair)


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
    with pytest.raises(ValueError, match="unknown model 'xgb'; registered: mlp, wide_deep, deepfm, dlrm, dcn"):
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
        if own[key].shape != value.shape:  # a padded layer: the legacy weights in its leading block
            assert any(a > b and a % 8 == 0 for a, b in zip(own[key].shape, value.shape))
            own[key] = torch.zeros_like(own[key]).normal_()  # noise facing the zero columns must not matter
            own[key][tuple(slice(0, n) for n in value.shape)] = value
        else:
            own[key] = value
    padded.load_state_dict(own)
    args = inputs(shape)
    assert torch.allclose(padded(*args), legacy(*args), atol=1e-6)


def test_cross_layer_computes_the_dcn_v2_formula_full_and_low_rank():
    from rayload.models.zoo import CrossLayer

    torch.manual_seed(0)
    x0, x = torch.randn(5, 12), torch.randn(5, 12)
    full = CrossLayer(12)
    assert torch.allclose(full(x0, x), x0 * (x @ full.up.weight.T + full.up.bias) + x, atol=1e-6)
    low = CrossLayer(12, rank=3)
    w = low.up.weight @ low.down.weight  # U V^T
    assert torch.allclose(low(x0, x), x0 * (x @ w.T + low.up.bias) + x, atol=1e-6)
    assert sum(p.numel() for p in low.parameters()) == 2 * 12 * 3 + 12


def test_dcn_learns_a_pairwise_interaction_that_the_mlp_input_alone_does_not_hold():
    """The label is the sign of a product of two fields' hidden factors: no ID alone carries
    any signal, so only crossing the two fields explains it. One cross layer and a linear
    output (no hidden layer) must find it; the same model without the cross layer cannot."""
    g = torch.Generator().manual_seed(0)
    shape = InputShape(0, (20, 20, 20), ())
    fa, fb = torch.randn(20, generator=g), torch.randn(20, generator=g)
    sparse = torch.randint(0, 20, (4096, 3), generator=g)
    label = (fa[sparse[:, 0]] * fb[sparse[:, 1]] > 0).float()

    def fit(name: str) -> float:
        torch.manual_seed(0)
        model = build_model(ModelSpec(name=name, hidden=[], embedding_dim=4, dropout=0.0, cross_layers=1).model_dump(), shape)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        for _ in range(300):
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(torch.zeros(4096, 0), sparse, [], []), label)
            loss.backward()
            opt.step()
        with torch.no_grad():
            return ((model(torch.zeros(4096, 0), sparse, [], []) > 0).float() == label).float().mean().item()

    assert fit("dcn") > 0.95
    assert fit("mlp") < 0.7  # a linear model of the concatenated embeddings: no interaction


def test_embedding_l2_counts_each_row_a_bag_uses_not_the_bags_mean():
    """The penalty was |pooled mean|^2 for a bag: two rows that cancel (r and -r) got no penalty
    and no gradient, and a bag of n unrelated rows about 1/n of theirs."""
    from rayload.models._inputs import FieldEmbeddings

    fe = FieldEmbeddings(InputShape(0, (10,), (10,)), 4).train()
    with torch.no_grad():
        fe.bags[0].weight[1] = torch.tensor([1.0, 2, 3, 4])
        fe.bags[0].weight[2] = -fe.bags[0].weight[1]
        fe.tables[0].weight[3] = torch.tensor([0.0, 0, 0, 2])
    fe(torch.tensor([[3], [3]]), [torch.tensor([1, 2, 1])], [torch.tensor([0, 2])])  # row 0: bag {1, 2}; row 1: bag {1}
    assert fe.last_sq.item() == pytest.approx((2 * 4 + 3 * 30) / 2)  # two single-ID rows of |.|^2 = 4, three bag rows of 30
    fe.last_sq.backward()
    grad = fe.bags[0].weight.grad.to_dense() if fe.bags[0].weight.grad.is_sparse else fe.bags[0].weight.grad
    assert torch.allclose(grad[1], 2 * 2 * fe.bags[0].weight[1] / 2) and torch.allclose(grad[2], 2 * fe.bags[0].weight[2] / 2)
    fe.eval()
    fe(torch.tensor([[3]]), [torch.tensor([1])], [torch.tensor([0])])
    assert fe.last_sq is None  # outside training


def test_settings_another_model_reads_are_said_when_training_and_a_rank_that_saves_nothing_too(caplog):
    """model.cross_rank on deepfm (or bottom on dcn) changed nothing without a word; a cross_rank of at
    least half the cross width built more weights than the full matrix it is meant to shrink."""
    import logging

    from rayload._spec_checks import warn_ignored_model_settings
    from rayload.spec import load_spec

    job = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "jobs", "movielens_deepfm.yaml")
    with caplog.at_level(logging.WARNING):
        notes = warn_ignored_model_settings(load_spec(job, ["model.cross_rank=4", "model.bottom=[7]"]))
    assert notes == ["model.bottom is read only by model dlrm; model deepfm ignores it",
                     "model.cross_rank is read only by model dcn; model deepfm ignores it"]
    assert warn_ignored_model_settings(load_spec(job, ["model.name=dcn", "model.cross_rank=4"])) == []
    assert warn_ignored_model_settings(load_spec(job)) == []
    # written at its default (retraining copies a champion's whole model.json): nothing to say
    assert warn_ignored_model_settings(load_spec(job, ["model.bottom=[64]", "model.cross_layers=2", "model.cross_rank=0"])) == []
    from rayload.models.zoo import rank_saves_nothing

    shape = InputShape(3, (6, 5), (7,))
    assert rank_saves_nothing(build_model(ModelSpec(name="dcn", cross_rank=1000).model_dump(), shape), 1000).startswith(
        "model.cross_rank 1000 is at least half the cross layers' input width 56")
    assert rank_saves_nothing(build_model(ModelSpec(name="dcn", cross_rank=4).model_dump(), shape), 4) is None
    assert rank_saves_nothing(build_model(ModelSpec(name="deepfm").model_dump(), shape), 1000) is None
