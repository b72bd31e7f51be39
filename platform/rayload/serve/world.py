"""The simulated world of an A/B spec: held-out MovieLens ratings, or synthetic-ctr truth.

The held-out rows are the champion's job spec test split, computed by the same seeded split
code that prepared its training data, so no simulated request shows a training rating."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq

from ..ab_spec import ABSpec


def world_for(ab: ABSpec, args: dict):
    from ..features import FittedFeatures
    from .simulate import MovieLensWorld, SyntheticWorld

    sim = ab.simulate
    from ..paths import localize

    checkpoint = localize(args["checkpoints"][args["champion"]])
    manifest = json.load(open(os.path.join(checkpoint, "manifest.json")))
    from ..spec import JobSpec

    job = JobSpec.model_validate(manifest["spec"])
    if sim.source == "synthetic-ctr":
        from ..data.builtin import _synth_params

        if job.data.source.kind != "synthetic-ctr":
            raise ValueError(f"simulate.source synthetic-ctr needs arms trained on synthetic-ctr, not {job.data.source.kind}")
        return SyntheticWorld(_synth_params(job.data.source), seed=sim.seed, drift_seed=sim.drift_seed)
    features = FittedFeatures.load(os.path.join(checkpoint, "features.json"))
    rows = held_out_rows(job)
    return MovieLensWorld(rows, args["feature_names"], features.label.column, features.label.threshold or 4.0, seed=sim.seed)


def held_out_rows(job) -> list[dict]:
    """The test split's raw rows (feature columns and the raw label)."""
    from ..data.builtin import materialize
    from ..data.validate import Schema
    from ..data.split import TEST, SplitPlan, assign
    from ..paths import cache_root

    if job.data.source.kind != "movielens":
        raise ValueError(f"simulate.source movielens replays the movielens source, not {job.data.source.kind}")
    table = pq.read_table(materialize(job.data.source, cache_root())[0])
    plan = SplitPlan.from_spec(job.split, Schema.from_spec(job.data))
    if plan.needs_cutoffs:
        from ..data.split import split_keys

        plan = plan.with_cutoffs([split_keys(table, plan)])
    return table.filter(assign(table, plan) == TEST).to_pylist()
