"""`rayload compress`: structured pruning of batch-norm models removes neurons for real, default
output names do not collide, and a path that is no checkpoint is named, not a traceback."""

import copy
import os

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from rayload.compression import _beside, compress, default_suffix
from rayload.pruning import prune as _prune, unmask as _unmask
from rayload.errors import RayloadError
from rayload.models import build_model
from _tiny_model import SHAPE, inputs, model


def _post_activation(module: nn.Module, forward):
    seen = {}
    handle = module.register_forward_hook(lambda mod, i, o: seen.__setitem__("out", o))
    with torch.no_grad():
        forward()
    handle.remove()
    return seen["out"]


@pytest.mark.parametrize("name", ["mlp", "dcn"])
def test_structured_pruning_of_a_batch_norm_model_leaves_cut_neurons_silent_and_loads_as_built(name):
    """A cut neuron's Linear row and bias were zeroed but its batch norm still output
    relu(beta - gamma * mu / sigma): a constant the next layer read. Gamma and beta are masked
    too; the architecture (and so model.json) is unchanged."""
    m, cfg = model(name, batch_norm=True)
    pruned = copy.deepcopy(m)
    _prune(pruned, 0.5, structured=True)
    _unmask(pruned)
    linear, relu = pruned.deep[0], pruned.deep[2]
    cut = (linear.weight == 0).all(dim=1)
    assert int(cut.sum()) == linear.out_features // 2
    out = _post_activation(relu, lambda: pruned(*inputs(256)))
    assert (out[:, cut] == 0).all() and (out[:, ~cut] != 0).any()
    state = pruned.state_dict()
    assert set(state) == set(m.state_dict()) and not any(k.endswith(("_orig", "_mask")) for k in state)
    fresh = build_model(cfg, SHAPE)
    fresh.load_state_dict(state)
    x = inputs(64)
    with torch.no_grad():
        assert torch.equal(fresh.eval()(*x), pruned(*x))


def test_neurons_are_ranked_by_their_weights_as_the_batch_norm_scales_them():
    """Neuron 0 has the largest raw weight row but a batch norm that scales it down 1000-fold:
    it passes on least, so it is the one cut (its raw norm would have kept it)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1)).eval()
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor([[9.0, 9, 9], [1, 1, 1], [2, 2, 2], [3, 3, 3]]))
        net[1].weight.copy_(torch.tensor([0.001, 1.0, 1.0, 1.0]))
    _prune(net, 0.25, structured=True)
    _unmask(net)
    assert (net[0].weight == 0).all(dim=1).tolist() == [True, False, False, False]
    assert net[1].weight[0] == 0 and net[1].bias[0] == 0


def test_cut_neurons_stay_silent_through_a_fine_tune_in_training_mode():
    m, _ = model("mlp", batch_norm=True)
    _prune(m, 0.5, structured=True)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.05)
    m.train()
    for step in range(3):
        loss = m(*inputs(64, seed=step)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    m.eval()
    _unmask(m)
    cut = (m.deep[0].weight == 0).all(dim=1)
    assert (m.deep[0].bias[cut] == 0).all() and (m.deep[1].weight[cut] == 0).all() and (m.deep[1].bias[cut] == 0).all()


def test_default_outputs_of_different_settings_have_different_names():
    """Structured and unstructured pruning at one --amount both wrote CHECKPOINT-prune50, and
    so did 0.5 and 0.504: each replaced the other."""
    settings = [("int8", 0.5, False), ("prune", 0.5, False), ("prune", 0.5, True), ("prune", 0.504, False), ("prune", 0.505, False),
                ("prune", 0.5000001, False)]
    names = [_beside("/runs/t/epoch_0001", default_suffix(*s)) for s in settings]
    assert len(set(names)) == len(names)
    assert names[:4] == ["/runs/t/epoch_0001-int8", "/runs/t/epoch_0001-prune50", "/runs/t/epoch_0001-prune50-structured",
                         "/runs/t/epoch_0001-prune50.4"]
    assert _beside("s3://b/run/epoch_0003?endpoint_override=h", default_suffix("prune", 0.3, True)) == \
        "s3://b/run/epoch_0003-prune30-structured?endpoint_override=h"


def test_a_missing_folder_or_one_that_is_no_checkpoint_is_named_with_what_a_checkpoint_holds(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.csv").write_text("x\n1\n")
    for path, state in ((tmp_path / "nowhere", "does not exist"), (data, r"is not a checkpoint folder \(no model.pt, model.json")):
        with pytest.raises(RayloadError, match=f"the checkpoint to compress, {path}, {state}.*holds model.pt, model.json and features.json"):
            compress(str(path), "int8")
    assert not (tmp_path / "nowhere").exists() and os.listdir(data) == ["a.csv"]  # nothing written


def test_the_cli_prints_the_error_without_a_traceback(tmp_path):
    from rayload import _cli_life  # noqa: F401  (registers `compress`, as cli.main does)
    from rayload.cli import app

    result = CliRunner().invoke(app, ["compress", str(tmp_path / "nowhere")])
    assert result.exit_code != 0 and "does not exist" in result.output and "Traceback" not in result.output
    assert not isinstance(result.exception, FileNotFoundError)
