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


def test_the_synthetic_pool_starts_past_every_arms_data_from_the_same_generator(tmp_path):
    """The pool started past the champion's rows alone: a challenger trained on 3,000 rows of the
    same generator (seed 3) against a 1,000-row champion held 2,000 of the rows shown."""
    small = _checkpoint(tmp_path / "small", SYNTHETIC)
    large = _checkpoint(tmp_path / "large", {**SYNTHETIC, "rows": 3000})
    other = _checkpoint(tmp_path / "other", {**SYNTHETIC, "rows": 9000, "seed": 4})  # another generator: no overlap
    for challenger, start in ((large, 3000), (other, 1000)):
        ab = ABSpec.model_validate({"name": "e", "arms": [{"name": "a", "weight": 0.5, "checkpoint": small},
                                                          {"name": "b", "weight": 0.5, "checkpoint": challenger}],
                                    "simulate": {"source": "synthetic-ctr"}})
        world = world_for(ab, {"checkpoints": {"a": small, "b": challenger}, "champion": "a"})
        ref = SyntheticWorld(_params(SYNTHETIC), pool_rows=world.pool_rows, start=start)
        assert world.rows == ref.rows and (world.truth == ref.truth).all()


def _params(source):
    from rayload.data.builtin import _synth_params
    from rayload.spec import SyntheticSource

    return _synth_params(SyntheticSource.model_validate(source))


def test_the_movielens_world_replays_only_what_every_arm_held_out(tmp_path):
    """A challenger split with another seed trained on some of the champion's test rows."""
    import yaml

    from _loop import features
    from rayload.serve.world import held_out_rows
    from rayload.spec import JobSpec

    raw = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "movielens_deepfm.yaml")))
    arms, jobs = {}, {}
    for name, seed in (("a", 0), ("b", 1)):
        (tmp_path / name).mkdir()
        jobs[name] = JobSpec.model_validate({**raw, "split": {**raw["split"], "seed": seed}})
        (tmp_path / name / "manifest.json").write_text(json.dumps({"spec": jobs[name].model_dump(mode="json")}))
        arms[name] = str(tmp_path / name)
    features().save(str(tmp_path / "a" / "features.json"))  # the champion's label settings
    ab = ABSpec.model_validate({"name": "e", "arms": [{"name": n, "weight": 0.5, "checkpoint": c} for n, c in arms.items()],
                                "simulate": {"source": "movielens"}})
    world = world_for(ab, {"checkpoints": arms, "champion": "a", "feature_names": ["userId"]})
    key = lambda r: (str(r["userId"]), str(r["movieId"]))  # noqa: E731
    both = {key(r) for r in held_out_rows(jobs["a"])} & {key(r) for r in held_out_rows(jobs["b"])}
    replayed = {key(r) for rows in world.by_user.values() for r in rows}
    assert replayed == both and 0 < len(both) < 10_000  # ~4% of the ratings, none either arm trained on


def test_each_round_of_retraining_moves_the_synthetic_pool_past_the_rows_shown_before(lineage, tmp_path):
    """A retrained arm fine-tuned on the exposures of the world's pool, and the next experiment
    showed it the same pool rows (and their clicks) again. Moving the pool by the lineage's depth
    did not do: a retrained challenger that lost left the next retrain (again fine-tuned from the
    champion, on the losing round's events) one round deep, judged on the rows it learned from."""
    original, first, second, _ = lineage
    again = _checkpoint(tmp_path / "r1b", {"kind": "parquet", "path": str(tmp_path / "r1b-events.parquet")}, init_from=original)
    starts = {}
    for name, challenger in (("round 0", original), ("round 1", first), ("round 2", second), ("round 1 again", again)):
        ab = ABSpec.model_validate({"name": "e", "arms": [{"name": "a", "weight": 0.5, "checkpoint": original},
                                                          {"name": "b", "weight": 0.5, "checkpoint": challenger}],
                                    "simulate": {"source": "synthetic-ctr"}})
        world = world_for(ab, {"checkpoints": {"a": original, "b": challenger}, "champion": "a"})
        ref = SyntheticWorld(_params(SYNTHETIC), pool_rows=world.pool_rows, start=world.start)
        assert world.rows == ref.rows and (world.truth == ref.truth).all()
        starts[name] = world.start
        assert world_for(ab, {"checkpoints": {"a": original, "b": challenger}, "champion": "a"}).start == starts[name]
    assert starts["round 0"] == 1000  # no retrained arm: the first pool past the data
    pools = sorted(starts.values())
    assert all(b - a >= 20_000 for a, b in zip(pools, pools[1:]))  # four disjoint pools


def test_a_drift_seed_equal_to_the_generators_seed_is_refused(lineage):
    """It rebuilt the planted model exactly: a drift rehearsal without drift."""
    original = lineage[0]
    ab = ABSpec.model_validate({"name": "e", "arms": [{"name": "a", "weight": 0.5, "checkpoint": original},
                                                      {"name": "b", "weight": 0.5, "checkpoint": original}],
                                "simulate": {"source": "synthetic-ctr", "drift_seed": 3}})
    with pytest.raises(RayloadError, match=r"simulate.drift_seed 3 is the arms' data.source.seed"):
        world_for(ab, {"checkpoints": {"a": original, "b": original}, "champion": "a"})


def test_the_movielens_world_drops_the_pairs_a_retrained_arm_fine_tuned_on(tmp_path):
    """A retrained arm's events are held-out users' shown movies with their clicks: replayed,
    the next experiment showed it the labels it was fine-tuned on."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from _loop import features
    from rayload.serve.world import held_out_rows
    from rayload.spec import JobSpec

    raw = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "movielens_deepfm.yaml")))
    job = JobSpec.model_validate(raw)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "manifest.json").write_text(json.dumps({"spec": job.model_dump(mode="json")}))
    features().save(str(tmp_path / "a" / "features.json"))  # the champion's label settings
    key = lambda r: (str(r["userId"]), str(r["movieId"]))  # noqa: E731
    held = held_out_rows(job)
    logged = held[:500]  # the exposures the retrain learned from, as its events file holds them
    pq.write_table(pa.table({"userId": [str(r["userId"]) for r in logged], "movieId": [str(r["movieId"]) for r in logged],
                             "rating": [1.0] * len(logged)}), str(tmp_path / "events.parquet"))
    retrained = {**raw, "data": {"source": {"kind": "parquet", "path": str(tmp_path / "events.parquet")},
                                 "columns": [{"name": "userId", "role": "categorical"}, {"name": "movieId", "role": "categorical"}],
                                 "label": {"column": "rating", "task": "binary"}},
                 "train": {**raw.get("train", {}), "init_from": str(tmp_path / "a")}}
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "manifest.json").write_text(json.dumps({"spec": JobSpec.model_validate(retrained).model_dump(mode="json")}))
    arms = {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}
    ab = ABSpec.model_validate({"name": "e", "arms": [{"name": n, "weight": 0.5, "checkpoint": c} for n, c in arms.items()],
                                "simulate": {"source": "movielens"}})
    world = world_for(ab, {"checkpoints": arms, "champion": "a", "feature_names": ["userId"]})
    replayed = {key(r) for rows in world.by_user.values() for r in rows}
    assert replayed == {key(r) for r in held} - {key(r) for r in logged} and len(replayed) > 19_000
