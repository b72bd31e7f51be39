"""`rayload compress --out`: what may be replaced. A new folder or an earlier compressed copy;
never the checkpoint, a folder holding it, or a folder that is not a compressed checkpoint."""

import json
import os

import pytest

from rayload.compression import CompressResult, _check_remote_out, _write, compress
from rayload.errors import RayloadError


def _checkpoint(folder, compression=None):
    os.makedirs(folder)
    for name in ("model.pt", "features.json", "manifest.json"):
        with open(os.path.join(folder, name), "w") as f:
            f.write("{}")
    with open(os.path.join(folder, "model.json"), "w") as f:
        json.dump({"config": {}, **({"compression": compression} if compression else {})}, f)
    return str(folder)


def _result(checkpoint):
    return CompressResult("int8", checkpoint, None, 0.8, 0.8, 0.002, 1, 0, {"plan": {}})


def _write_to(checkpoint, target):
    return _write(checkpoint, target, {}, {"config": {}}, {}, _result(checkpoint), checkpoint)


@pytest.fixture()
def run(tmp_path):
    run = tmp_path / "run"
    return run, _checkpoint(run / "epoch_0002")


def test_an_out_folder_holding_the_checkpoint_is_refused_and_nothing_is_removed(run):
    folder, ck = run
    for out in (str(folder), f"{folder}/", ck, f"{ck}/", f"{folder}/../run"):
        with pytest.raises(RayloadError, match=r"--out .* (contains|is) the checkpoint being compressed"):
            _write_to(ck, out)
        with pytest.raises(RayloadError, match=r"--out .* the checkpoint being compressed"):
            compress(ck, "int8", out=out)  # refused before any work
    assert sorted(os.listdir(ck)) == ["features.json", "manifest.json", "model.json", "model.pt"]


def test_an_existing_folder_that_is_not_a_compressed_checkpoint_is_refused_with_a_trailing_slash_too(run, tmp_path):
    _, ck = run
    data = tmp_path / "data"
    data.mkdir()
    (data / "keep.csv").write_text("a,b\n")
    trained = _checkpoint(tmp_path / "other" / "epoch_0001")
    for out in (f"{data}/", str(data), trained):
        with pytest.raises(RayloadError, match=r"--out .* is not a compressed checkpoint"):
            _write_to(ck, out)
    assert (data / "keep.csv").read_text() == "a,b\n"
    assert os.path.exists(os.path.join(trained, "model.pt"))
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_a_new_folder_or_an_earlier_compressed_copy_is_written(run, tmp_path):
    _, ck = run
    out = tmp_path / "new"
    _write_to(ck, f"{out}/")  # a trailing slash names the same folder
    assert json.loads((out / "model.json").read_text())["compression"]["method"] == "int8"
    (out / "stale.txt").write_text("from the earlier copy")
    _write_to(ck, str(out))  # the same command again replaces the earlier copy whole
    assert sorted(os.listdir(out)) == ["features.json", "manifest.json", "model.json", "model.pt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    _write_to(ck, str(empty))
    assert (empty / "model.pt").exists()
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_a_remote_out_holding_the_checkpoint_is_refused():
    with pytest.raises(RayloadError, match="--out s3://b/run/ contains the checkpoint"):
        _check_remote_out("s3://b/run/", "s3://b/run/epoch_0002?endpoint_override=h")
    with pytest.raises(RayloadError, match="is the checkpoint"):
        _check_remote_out("s3://b/run/epoch_0002?x=1", "s3://b/run/epoch_0002")
    # beside it (epoch_0002-int8, epoch_00021): test_a_remote_out_may_replace_only_an_earlier_compressed_copy


def test_structured_pruning_removes_whole_neurons_bias_included_through_fine_tuning():
    """A pruned output neuron's weight row and its bias are both 0 (it used to output relu(bias)),
    also after the masked fine-tune's steps and once the masks are baked in."""
    import torch
    from torch import nn

    from rayload.pruning import prune as _prune, unmask as _unmask

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 1))
    _prune(model, 0.5, structured=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 6)).pow(2).mean().backward()
        opt.step()
    _unmask(model)
    for layer in (model[0], model[2]):
        cut = (layer.weight == 0).all(dim=1)
        assert int(cut.sum()) == layer.out_features // 2 and (layer.bias[cut] == 0).all() and (layer.bias[~cut] != 0).all()
        assert not hasattr(layer, "weight_mask") and not hasattr(layer, "bias_mask")


def test_a_remote_out_may_replace_only_an_earlier_compressed_copy():
    """Uploaded over whatever was there: another run's trained checkpoint at --out was written
    over and left mixed (its train_state.pt beside an unrelated int8 model)."""
    from helpers import s3_bucket
    from rayload.paths import join_uri, read_text, upload_folder

    with s3_bucket() as base, __import__("tempfile").TemporaryDirectory() as tmp:
        trained = _checkpoint(os.path.join(tmp, "trained"))
        copy = _checkpoint(os.path.join(tmp, "copy"), {"method": "prune"})
        upload_folder(trained, join_uri(base, "other", "epoch_0001"))
        upload_folder(copy, join_uri(base, "run", "epoch_0002-int8"))
        with pytest.raises(RayloadError, match="exists and is not a compressed checkpoint"):
            _check_remote_out(join_uri(base, "other", "epoch_0001"), join_uri(base, "run", "epoch_0002"))
        _check_remote_out(join_uri(base, "run", "epoch_0002-int8"), join_uri(base, "run", "epoch_0002"))  # an earlier copy
        _check_remote_out(join_uri(base, "run", "new"), join_uri(base, "run", "epoch_0002"))  # nothing there
        _check_remote_out(join_uri(base, "run", "epoch_00021"), join_uri(base, "run", "epoch_0002"))  # a name, not a folder, apart
        assert json.loads(read_text(join_uri(base, "other", "epoch_0001", "model.json"))) == {"config": {}}


def test_an_interrupted_local_write_leaves_no_temporary_folder_and_keeps_the_earlier_copy(run, tmp_path, monkeypatch):
    """A Ctrl-C (or a full disk) inside the write left <out>.tmp-PID beside the run for good, and
    one between removing the earlier copy and moving the new one in left neither."""
    from rayload import compression

    _, ck = run
    out = tmp_path / "out"
    _write_to(ck, str(out))
    (out / "marker").write_text("earlier")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(compression.torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _write_to(ck, str(out))
    monkeypatch.undo()
    real, calls = os.replace, []

    def second_replace_fails(a, b):
        calls.append((a, b))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(a, b)

    monkeypatch.setattr(compression.os, "replace", second_replace_fails)
    with pytest.raises(KeyboardInterrupt):
        _write_to(ck, str(out))
    monkeypatch.undo()
    assert (out / "marker").read_text() == "earlier"  # the earlier copy, in place
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p or ".old-" in p]


def test_the_refusal_advice_fits_the_method_and_the_sdk_takes_a_spec_file(tmp_path):
    from rayload.compression import GateRefused

    int8 = str(GateRefused(CompressResult("int8", "c", None, 0.8, 0.7, 0.002, 1, 0, {})))
    prune = str(GateRefused(CompressResult("prune", "c", None, 0.8, 0.7, 0.002, 1, 0, {})))
    assert "--amount" not in int8 and "Raise --max-auc-drop, or try --method prune" in int8
    assert "Use a smaller --amount, add --finetune-epochs" in prune
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with pytest.raises(RayloadError, match="does not exist"):  # past the spec file (it was AttributeError: 'str' ... 'train')
        compress(str(tmp_path / "none"), "int8", spec=os.path.join(root, "jobs", "movielens_deepfm.yaml"))


def test_a_drop_of_exactly_max_auc_drop_passes_the_gate():
    """0.51 - 0.508 is 0.0020000000000000018 in floats: a drop of exactly the 0.002 allowed (one
    flipped pair of 500) was refused, against "refuses a drop of more than max_auc_drop"."""
    for before, after in [(0.51, 0.508), (0.75, 0.748), (0.9, 0.898), (0.8125, 0.8105)]:
        assert CompressResult("int8", "c", None, before, after, 0.002, 1, 0, {}).passed
    assert not CompressResult("int8", "c", None, 0.51, 0.5079, 0.002, 1, 0, {}).passed


@pytest.mark.parametrize("text, what", [("{}", "no model config"), ('{"config": {"name": "mlp"}}', "no input shape"), ("[", "\\(Expecting value")])
def test_a_damaged_model_json_is_named(tmp_path, text, what):
    """compress on a checkpoint whose model.json lacked its config raised KeyError: 'config'."""
    from rayload.errors import RayloadError
    from rayload.train import checkpoint as ckpt

    (tmp_path / "model.json").write_text(text)
    with pytest.raises(RayloadError, match=rf"model\.json is damaged .*{what}"):
        ckpt.load(str(tmp_path))
