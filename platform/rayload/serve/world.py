"""The simulated world of an A/B spec: held-out MovieLens ratings, or synthetic-ctr truth.

The held-out rows are the champion's job spec test split, computed by the same seeded split
code that prepared its training data, so no simulated request shows a training rating.

A champion fine-tuned on other data than the world's (a `rayload retrain` model, trained on
logged events, promoted) defines no world of its own: its job spec's `train.init_from` names
the checkpoint it descends from, and the world is that of the first ancestor trained on the
simulated source (the world the logged events came from)."""

from __future__ import annotations

import hashlib
import json
import os

import pyarrow.parquet as pq

from ..ab_spec import ABSpec
from ..errors import RayloadError


class SourceError(RayloadError, ValueError):
    """simulate.source does not fit the arms' data: a user error the CLI prints (a ValueError too,
    for the callers that catch one)."""


def world_for(ab: ABSpec, args: dict):
    from ..features import FittedFeatures
    from .simulate import MovieLensWorld, SyntheticWorld

    sim = ab.simulate
    checkpoint, job = world_checkpoint(args["checkpoints"][args["champion"]], sim.source)
    # The other arms' data too: no arm may have trained on what the world shows
    others = [_arm_job(path, sim.source) for name, path in args["checkpoints"].items() if name != args["champion"]]
    others = [other for other in others if other is not None]
    # Fine-tunes on logged events along each arm's lineage (rayload retrain): their rows were shown
    # by this world before, so a retrained arm must not be judged on them again
    retrained = [j for path in args["checkpoints"].values() for j in event_jobs(path, sim.source)]
    if sim.source == "synthetic-ctr":
        if job.data.source.kind != "synthetic-ctr":
            raise SourceError(f"simulate.source synthetic-ctr needs arms trained on synthetic-ctr, not {job.data.source.kind}; "
                              "set simulate.source in the A/B spec to the arms' source")
        params = _synth_params(job.data.source)
        if sim.drift_seed is not None and sim.drift_seed == params.seed:
            raise SourceError(f"simulate.drift_seed {sim.drift_seed} is the arms' data.source.seed: the redrawn ground truth would "
                              "be the one they were trained on; choose another drift_seed")
        # never more candidates than the router takes (serving.max_candidates): each request was a 422
        return SyntheticWorld(params, candidates=min(10, ab.serving.max_candidates), seed=sim.seed, drift_seed=sim.drift_seed,
                              start=_pool_start(params, others) + _pool_slot(retrained) * POOL_ROWS, pool_rows=POOL_ROWS)
    features = FittedFeatures.load(os.path.join(checkpoint, "features.json"))
    rows = held_out_rows(job)
    shown = _shown_pairs(retrained)  # (user, movie) pairs a retrained arm fine-tuned on: replayed, they would leak their labels
    rows = [r for r in rows if (str(r["userId"]), str(r["movieId"])) not in shown]
    for other in others:  # an arm split another way held other rows out: replay only what every arm held out
        if other.data.source.kind == "movielens" and (other.data, other.split) != (job.data, job.split):
            kept = {(str(r["userId"]), str(r["movieId"])) for r in held_out_rows(other)}
            rows = [r for r in rows if (str(r["userId"]), str(r["movieId"])) in kept]
    return MovieLensWorld(rows, args["feature_names"], features.label.column, features.label.threshold or 4.0, seed=sim.seed,
                          max_candidates=min(20, ab.serving.max_candidates))


POOL_ROWS = 20_000  # a synthetic world's candidate rows
POOL_SLOTS = 100_003  # where a world with retrained arms takes its pool: one of this many slots past the first


def _pool_slot(retrained: list) -> int:
    """Which pool a world shows: 0 (the first past the data) while no arm learned from logged
    events; else a slot drawn from the events files the arms fine-tuned on. The rows those events
    showed came from an earlier world's slot, so a retrained arm is judged on fresh rows. (A count
    of retrain rounds along the lineage did not do: a retrained challenger that lost left the next
    retrain, again fine-tuned from the champion, one round deep, judged on its own rows.)"""
    given = [getattr(job.data.source, "path", None) or job.name for job in retrained]
    paths = sorted({p for g in given for p in ([g] if isinstance(g, str) else g)})
    if not paths:
        return 0
    return 1 + int(hashlib.sha256("\n".join(paths).encode()).hexdigest(), 16) % POOL_SLOTS


def event_jobs(checkpoint: str, source: str, limit: int = 100) -> list:
    """The job specs along `checkpoint`'s `train.init_from` lineage trained on other data than
    `source` (fine-tunes on logged events), from the checkpoint up to the ancestor that defines
    the world; [] when any link cannot be read (world_checkpoint names such a champion)."""
    from ..paths import localize
    from ..spec import JobSpec

    out, seen = [], set()
    while checkpoint and checkpoint not in seen and len(seen) < limit:
        seen.add(checkpoint)
        try:
            with open(os.path.join(localize(checkpoint), "manifest.json")) as f:
                job = JobSpec.model_validate(json.load(f)["spec"])
        except (OSError, ValueError, KeyError):
            return out
        if job.data.source.kind == source:
            return out
        out.append(job)
        checkpoint = job.train.init_from
    return out


def _shown_pairs(jobs) -> set[tuple[str, str]]:
    """(userId, movieId) of the rows logged events trained these jobs on (their parquet files)."""
    pairs = set()
    for job in jobs:
        src = job.data.source
        paths = getattr(src, "path", None)
        for path in ([paths] if isinstance(paths, str) else paths or []):
            try:
                table = pq.read_table(path, columns=["userId", "movieId"])
            except (OSError, ValueError, KeyError):  # no such columns (not MovieLens) or the file is gone: nothing to drop
                continue
            pairs |= set(zip(map(str, table.column("userId").to_pylist()), map(str, table.column("movieId").to_pylist())))
    return pairs


def _arm_job(checkpoint: str, source: str):
    """A challenger's job spec as it defines its data (None, with a warning, when it records none)."""
    import logging

    try:
        return world_checkpoint(checkpoint, source)[1]
    except (OSError, ValueError, KeyError) as exc:
        logging.getLogger(__name__).warning("the simulated world cannot account for the data of %s (%s): its training rows "
                                            "may be among those shown", checkpoint, exc)
        return None


def _synth_params(source):
    from ..data.builtin import _synth_params as params

    return params(source)


def _pool_start(params, others) -> int:
    """The first generator row the world may show: past the champion's data and past every arm's
    trained on the same generator (its row count does not change the planted model, so a
    challenger trained on more rows of it holds the pool rows the champion never saw)."""
    # Which rows come out depends on the seed alone: an arm of the same seed trained on the same
    # rows whatever its other settings (a missing_rate of 0.06 instead of 0.05 started the pool
    # at the champion's end, 95% of it rows the challenger had trained on)
    same = [_synth_params(o.data.source) for o in others if o.data.source.kind == "synthetic-ctr"]
    return max([params.rows] + [p.rows for p in same if p.seed == params.seed])


def world_checkpoint(checkpoint: str, source: str, limit: int = 100):
    """(local folder, job spec) of the checkpoint whose job defines the world of `source`: the
    champion's own, or the first ancestor along `train.init_from` trained on `source` (see the
    module doc). Without such an ancestor, the last one read (the caller names its source)."""
    from ..errors import RayloadError
    from ..paths import localize
    from ..spec import JobSpec

    seen = []
    while True:
        try:
            folder = localize(checkpoint)
            with open(os.path.join(folder, "manifest.json")) as f:
                job = JobSpec.model_validate(json.load(f)["spec"])
        except (OSError, ValueError, KeyError) as exc:
            if not seen:
                raise
            raise RayloadError(f"simulate.source {source}: the champion {seen[0]} was fine-tuned from {checkpoint} (train.init_from), "
                               f"whose job spec defines the simulated world, and it cannot be read ({exc}); restore it") from exc
        parent = job.train.init_from
        if job.data.source.kind == source or not parent or parent in seen or len(seen) >= limit:
            return folder, job
        seen.append(checkpoint)
        checkpoint = parent


def held_out_rows(job) -> list[dict]:
    """The test split's raw rows (feature columns and the raw label), split exactly as the
    training run split them: on the validated rows (a stratified split strata by the 0/1 label,
    not by the raw stars; split on the raw table it sent 87 training rows to the simulator)."""
    import numpy as np
    import pyarrow as pa

    from ..data.builtin import materialize
    from ..data.validate import Schema, check_table
    from ..data.split import TEST, SplitPlan, assign
    from ..paths import cache_root

    if job.data.source.kind != "movielens":
        raise SourceError(f"simulate.source movielens replays the movielens source, not {job.data.source.kind}; set "
                          "simulate.source in the A/B spec to the arms' source (simulate: {source: synthetic-ctr})")
    table = pq.read_table(materialize(job.data.source, cache_root())[0])
    schema = Schema.from_spec(job.data)
    checked, good, _ = check_table(table, schema, "movielens")
    valid, raw = checked.filter(pa.array(good)), table.filter(pa.array(good))
    plan = SplitPlan.from_spec(job.split, schema)
    if plan.needs_cutoffs:
        from ..data.split import split_keys

        plan = plan.with_cutoffs([split_keys(valid, plan)])
    return raw.filter(pa.array(np.asarray(assign(valid, plan)) == TEST)).to_pylist()
