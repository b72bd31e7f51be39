"""train.init_from / train.freeze: warm starts and frozen parts, on the in-process loop."""

import pytest
import torch
from _loop import MemorySession, features, job, table

from rayload.errors import RayloadError
from rayload.spec import JobSpec
from rayload.train.loop import run

CONTEXT = {"train_rows": 1024, "manifest": {}}


def _weights(checkpoint: str) -> dict:
    return torch.load(f"{checkpoint}/model.pt", weights_only=True)


def _source(tmp_path, **model) -> str:
    session = MemorySession(table(1024, 0), table(512, 1), str(tmp_path / "source"))
    spec = job(epochs=1)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update=model)})
    run(spec, features(), session, CONTEXT)
    return session.reports[-1][1]


def _tuned(tmp_path, source: str, name: str = "tuned", model: dict | None = None, **train) -> dict:
    spec = job(epochs=2, init_from=source, **train)
    if model:
        spec = spec.model_copy(update={"model": spec.model.model_copy(update=model)})
    session = MemorySession(table(1024, 2), table(512, 3), str(tmp_path / name))
    run(spec, features(), session, CONTEXT)
    return _weights(session.reports[-1][1])


def test_frozen_parts_stay_bit_identical_and_the_rest_trains(tmp_path):
    source = _source(tmp_path, batch_norm=True)
    before = _weights(source)
    after = _tuned(tmp_path, source, model={"batch_norm": True}, freeze=["embeddings", "deep"])
    frozen = [k for k in before if k.startswith(("embed.", "deep."))]
    assert any("running_mean" in k for k in frozen)  # batch-norm statistics of a frozen part stay too
    for k in frozen:
        assert torch.equal(before[k], after[k]), k
    moved = [k for k in before if k.startswith("first.") and not torch.equal(before[k], after[k])]
    assert moved, "the unfrozen first-order part did not train"


def test_full_fine_tune_starts_from_the_checkpoint(tmp_path):
    source = _source(tmp_path)
    before = _weights(source)
    warm = _tuned(tmp_path, source, "warm", lr=1e-9)  # steps this small keep the starting point visible
    fresh_session = MemorySession(table(1024, 2), table(512, 3), str(tmp_path / "fresh"))
    run(job(epochs=2, lr=1e-9), features(), fresh_session, CONTEXT)
    fresh = _weights(fresh_session.reports[-1][1])
    for key in ("embed.tables.0.weight", "deep.0.weight"):
        assert torch.allclose(warm[key], before[key], atol=1e-6), key
        assert not torch.allclose(fresh[key], before[key], atol=1e-4), key


def test_freeze_needs_init_from_and_a_part_the_model_has(tmp_path):
    with pytest.raises(ValueError, match="freeze=.*needs init_from"):
        job(freeze=["embeddings"])
    source = _source(tmp_path)
    spec = JobSpec.model_validate({**job().model_dump(), "model": {**job().model_dump()["model"], "name": "dlrm"},
                                   "train": {**job().model_dump()["train"], "init_from": source, "freeze": ["deep"]}})
    session = MemorySession(table(256, 0), table(256, 1), str(tmp_path / "x"))
    with pytest.raises(RayloadError):  # the deepfm checkpoint does not fit a dlrm first
        run(spec, features(), session, CONTEXT)


def test_a_part_the_model_lacks_is_named_with_the_parts_it_has(tmp_path):
    source = _source(tmp_path)
    spec = job(init_from=source, freeze=["bottom"])
    with pytest.raises(RayloadError, match=r"DeepFM has no 'bottom' part; its parts are \['embeddings', 'first_order', 'dense_vectors', 'deep'\]"):
        run(spec, features(), MemorySession(table(256, 0), table(256, 1), str(tmp_path / "y")), CONTEXT)


def test_dcn_cross_layers_freeze_while_its_deep_part_trains(tmp_path):
    source = _source(tmp_path, name="dcn", cross_layers=2)
    before = _weights(source)
    after = _tuned(tmp_path, source, model={"name": "dcn", "cross_layers": 2}, freeze=["embeddings", "cross"])
    frozen = [k for k in before if k.startswith(("embed.", "cross."))]
    assert any(k.startswith("cross.1.") for k in frozen)
    for k in frozen:
        assert torch.equal(before[k], after[k]), k
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("deep."))


def test_a_model_section_the_checkpoint_does_not_fit_is_refused_by_fit_before_ray_naming_the_fields(tmp_path):
    """The mismatch surfaced on the workers, after preprocessing, naming tensor keys only, and Ray
    Train retried it as a worker failure (forever with train.max_failures: -1)."""
    from rayload.train.trainer import fit

    source = _source(tmp_path)  # deepfm, hidden [16]
    spec = job(init_from=source)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"hidden": [32]})})
    with pytest.raises(RayloadError, match=r"model\.hidden: checkpoint \[16\] vs spec \[32\].*deep\.0\.bias: checkpoint \(16,\) vs model \(32,\)"):
        fit(spec)  # raises before ray.init and before the (MovieLens) data is read


@pytest.mark.parametrize("name, frozen", [("mlp", ["embeddings", "deep"]), ("deepfm", ["embeddings", "first_order", "dense_vectors", "deep"])])
def test_a_freeze_that_leaves_nothing_dense_to_train_is_refused_before_any_data(tmp_path, name, frozen):
    from rayload.train.transfer import check_before_training

    source = _source(tmp_path, name=name)
    spec = job(init_from=source, freeze=frozen)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"name": name})})
    with pytest.raises(RayloadError, match=r"leaves no dense parameters to train"):
        check_before_training(spec)
    check_before_training(job(init_from=source, freeze=["embeddings"]).model_copy(update={"model": spec.model}))  # fits: no error


def test_an_empty_part_is_no_part_to_freeze():
    """DeepFM on data without numeric columns has an empty dense_vectors parameter: freezing it
    was accepted and froze nothing."""
    from rayload.models import InputShape, build_model
    from rayload.spec import ModelSpec
    from rayload.train.transfer import freeze

    model = build_model(ModelSpec.model_validate({"name": "deepfm"}).model_dump(), InputShape(0, (5, 3), ()))
    with pytest.raises(RayloadError, match=r"DeepFM has no 'dense_vectors' part; its parts are \['embeddings', 'first_order', 'deep'\]"):
        freeze(model, ["dense_vectors"])


@pytest.mark.parametrize("space, reaches_data", [({"train.lr": {"loguniform": [1e-4, 1e-2]}}, False),
                                                 ({"model.hidden": {"choice": [[16], [8]]}}, True),
                                                 ({"model.hidden": {"choice": [[32], [8]]}}, False),
                                                 ({"model.dropout": {"uniform": [0.0, 0.5]}}, False),
                                                 ({"model.hidden": {"choice": [[64], [16]]}, "model.embedding_dim": {"int": [2, 8]}}, True),
                                                 ({"model": {"choice": [{"name": "deepfm", "embedding_dim": 4, "hidden": [16],
                                                                         "dropout": 0.0}]}}, True)])
def test_a_search_is_refused_when_no_searched_model_takes_the_init_from_checkpoint(tmp_path, monkeypatch, space, reaches_data):
    """The base's default model.hidden refused a search whose every hidden choice fitted the
    checkpoint; a search of model.dropout alone then skipped the check, and every trial failed."""
    from rayload import tuning
    from rayload.data import pipeline
    from rayload.search_spec import SearchSpec

    class Reached(Exception):
        pass

    def reached(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(pipeline, "preprocess", reached)
    source = _source(tmp_path)  # hidden [16]; the base asks for [64]
    raw = job(init_from=source).model_dump(mode="json")
    raw["model"]["hidden"] = [64]
    spec = SearchSpec.model_validate({"name": "s", "base": "b.yaml", "space": space})
    with pytest.raises(Reached if reaches_data else RayloadError):
        tuning._preprocess_variants(spec, raw, (), None)


def test_the_search_check_tries_own_values_the_search_can_draw_from_every_checkpoint_it_may_start_from(tmp_path, monkeypatch):
    """Review of the check: the checkpoint's own value was tried even when the range's step can
    never draw it; a searched train.init_from added none; a missing checkpoint was a traceback."""
    from rayload import tuning
    from rayload.data import pipeline
    from rayload.search_spec import SearchSpec

    class Reached(Exception):
        pass

    def reached(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(pipeline, "preprocess", reached)
    source = _source(tmp_path)  # embedding_dim 4, hidden [16]

    def check(space: dict, init_from: str | None = source):
        raw = job(init_from=init_from).model_dump(mode="json") if init_from else job().model_dump(mode="json")
        tuning._preprocess_variants(SearchSpec.model_validate({"name": "s", "base": "b.yaml", "space": space}), raw, (), None)

    with pytest.raises(RayloadError, match=r"model\.embedding_dim: checkpoint 4 vs spec"):  # draws 2 and 5 only
        check({"model.embedding_dim": {"int": [2, 5], "step": 3}})
    with pytest.raises(Reached):  # no init_from in the base: the searched one's own dimension, 4, fits
        check({"train.init_from": {"choice": [source]}, "model.embedding_dim": {"int": [2, 6]}}, init_from=None)
    with pytest.raises(RayloadError, match=r"train.init_from=.* is not a checkpoint"):
        check({"model.embedding_dim": {"int": [2, 6]}}, init_from=str(tmp_path / "nope"))
