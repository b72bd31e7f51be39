"""The simulated world of an experiment whose champion was retrained on logged events: its job
spec names the events file, and the world is that of the checkpoint it descends from."""

import json
import os
import shutil

import pytest

from rayload.ab_spec import ABSpec
from rayload.errors import RayloadError
from rayload.serve.simulate import SyntheticWorld
from rayload.serve.world import world_checkpoint, world_for

SYNTHETIC = {"kind": "synthetic-ctr", "rows": 1000, "seed": 3}


def _checkpoint(folder, source: dict, init_from=None) -> str:
    os.makedirs(folder)
    spec = {"name": "x", "data": {"source": source, "label": {"column": "label"}}, "train": {"init_from": init_from}}
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump({"spec": spec}, f)
    return str(folder)


@pytest.fixture()
def lineage(tmp_path):
    """original (synthetic-ctr) <- retrained on its events <- retrained again <- its int8 copy."""
    original = _checkpoint(tmp_path / "original", SYNTHETIC)
    first = _checkpoint(tmp_path / "r1", {"kind": "parquet", "path": str(tmp_path / "r1-events.parquet")}, init_from=original)
    second = _checkpoint(tmp_path / "r2", {"kind": "parquet", "path": str(tmp_path / "r2-events.parquet")}, init_from=first)
    int8 = str(tmp_path / "r2-int8")
    shutil.copytree(second, int8)  # a compressed copy keeps its source's manifest spec
    return original, first, second, int8


def test_a_retrained_champion_simulates_the_world_it_descends_from(lineage):
    original, _, second, int8 = lineage
    for champion in (original, second, int8):
        folder, job = world_checkpoint(champion, "synthetic-ctr")
        assert folder == original and job.data.source.kind == "synthetic-ctr"
    ab = ABSpec.model_validate({"name": "e", "arms": [{"name": "retrained", "weight": 0.5, "checkpoint": second},
                                                      {"name": "retrained-2", "weight": 0.5, "checkpoint": int8}],
                                "simulate": {"source": "synthetic-ctr", "seed": 1}})
    world = world_for(ab, {"checkpoints": {"retrained": second, "retrained-2": int8}, "champion": "retrained"})
    assert isinstance(world, SyntheticWorld)  # it raised "needs arms trained on synthetic-ctr, not parquet"


def test_a_champion_of_another_source_is_still_refused_and_a_lost_ancestor_is_named(lineage, tmp_path):
    _, first, second, _ = lineage
    folder, job = world_checkpoint(second, "movielens")  # no ancestor on movielens: the last one, which the caller refuses
    assert job.data.source.kind == "synthetic-ctr"
    shutil.rmtree(first)
    with pytest.raises(RayloadError, match=f"fine-tuned from {first} \\(train.init_from\\).*restore it"):
        world_checkpoint(second, "synthetic-ctr")


@pytest.mark.parametrize("split", [["split.kind=stratified", "split.train=0.8", "split.val=0"], []])
def test_the_movielens_world_replays_exactly_the_training_runs_test_rows(split):
    """A stratified split strata by the 0/1 label of the validated rows; the world split the raw
    table, by raw stars, and replayed 87 of the model's training rows as held-out traffic."""
    import os

    import numpy as np
    import pyarrow.parquet as pq

    from rayload.data.builtin import materialize
    from rayload.data.split import TEST, SplitPlan, assign, split_keys
    from rayload.data.validate import Schema, validate_table
    from rayload.paths import cache_root
    from rayload.serve.world import held_out_rows
    from rayload.spec import load_spec

    job = load_spec(os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "movielens_deepfm.yaml"), split)
    schema = Schema.from_spec(job.data)
    good, _ = validate_table(pq.read_table(materialize(job.data.source, cache_root())[0]), schema)  # as preprocessing splits
    plan = SplitPlan.from_spec(job.split, schema)
    if plan.needs_cutoffs:
        plan = plan.with_cutoffs([split_keys(good, plan)])
    test = good.filter(np.asarray(assign(good, plan)) == TEST).select(["userId", "movieId"]).to_pylist()
    replayed = [{"userId": str(r["userId"]), "movieId": str(r["movieId"])} for r in held_out_rows(job)]
    assert sorted(map(str, replayed)) == sorted(map(str, test)) and len(test) > 19_000
