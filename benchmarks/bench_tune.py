"""Tuning benchmarks (issue 4). Every figure is a ratio measured side by side in one run.

    .venv/bin/python benchmarks/bench_tune.py overhead            # ideal / actual wall time, 50 trials at 2 concurrent
    .venv/bin/python benchmarks/bench_tune.py branin              # trials to target: random / TPE, 5+ seeds
    .venv/bin/python benchmarks/bench_tune.py movielens           # the same on the MovieLens DeepFM job
    .venv/bin/python benchmarks/bench_tune.py asha                # MovieLens time to target: without ASHA / with
    .venv/bin/python benchmarks/bench_tune.py asha-stream --target 0.8056   # the same, searching until the target

overhead: `rayload.tune_function` runs N trials whose body sleeps T seconds (no CPU, so
the two cores measure only the search machinery: Optuna ask/tell on SQLite, Tune's trial
scheduling, actor reuse). ideal = N x T / concurrency.

branin: trials until the best value is within 0.05 of Branin's minimum 0.397887, per seed,
for Optuna's RandomSampler and rayload's TPE configuration, each driven through rayload's
StudySearcher (the searcher Tune drives) one trial at a time in this process; a run that
does not reach the target by the cap counts as the cap (which understates the ratio).

movielens / asha: real searches with `rayload.tune` over jobs/movielens_deepfm.yaml.

asha gives both sides the same fixed list of N seeded random configurations. asha-stream is how
a search with a scheduler is run in practice: both sides draw from the same seeded random
sequence without a trial limit (num_samples far above what fits) and end when a trial reports
the target (`target` in the search spec) or when the time budget (`time_budget_s`) is spent.
The time to target is when the first epoch at or above the target was reported, from Tune's
per-trial result.json; the target is given on the command line, fixed before the run.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BRANIN_MIN = 0.397887


def branin(c: dict) -> float:
    x, y = c["x"], c["y"]
    return (y - 5.1 / (4 * math.pi**2) * x * x + 5 / math.pi * x - 6) ** 2 + 10 * (1 - 1 / (8 * math.pi)) * math.cos(x) + 10


def sleeper(seconds: float):
    def trial(config: dict) -> float:
        time.sleep(seconds)
        return config["x"]

    return trial


def bench_overhead(args) -> None:
    import ray

    import rayload

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ideal = args.trials * args.trial_s / 2
    for label in ("cold (first search in this process: imports of Tune, Optuna, matplotlib included)", "warm (a second search)"):
        start = time.perf_counter()
        res = rayload.tune_function(sleeper(args.trial_s), {"x": {"uniform": [0, 1]}}, strategy="random", num_samples=args.trials,
                                    max_concurrent=2, seed=0)
        wall = time.perf_counter() - start
        assert res.counts() == {"complete": args.trials}, res.counts()
        print(f"overhead, {label}: {args.trials} trials x {args.trial_s:.2f} s at 2 concurrent: ideal {ideal:.1f} s, "
              f"actual {wall:.1f} s (start-up, trials table and plots included) -> ideal/actual = {ideal / wall:.2f}; "
              f"{(wall - ideal) * 2 / args.trials:.3f} s overhead per trial", flush=True)


def trials_to_target(strategy: str, seed: int, cap: int) -> int:
    """Drive rayload's StudySearcher one trial at a time until Branin is within 0.05 of its minimum."""
    from rayload._study import StudySearcher, make_sampler
    from rayload._study_store import open_study
    from rayload.search_spec import Param

    space = {"x": Param(uniform=(-5, 10)), "y": Param(uniform=(0, 15))}
    # open_study takes a maker of the sampler (held trials -> sampler), as a resumed search reseeds it
    study = open_study(None, f"{strategy}-{seed}", "min",
                       lambda held: make_sampler(strategy, "tpe", space, seed, startup=10, concurrent=False, resumed_after=held),
                       create=True)
    searcher = StudySearcher(study, space, cap, "value", "min")
    for i in range(cap):
        config = searcher.suggest(str(i))
        value = branin(config["params"])
        searcher.on_trial_complete(str(i), {"value": value, "training_iteration": 1})
        if value <= BRANIN_MIN + 0.05:
            return i + 1
    return cap


def bench_branin(args) -> None:
    seeds = range(args.seeds)
    random_n = [trials_to_target("random", s, args.cap) for s in seeds]
    tpe_n = [trials_to_target("bayes", s, args.cap) for s in seeds]
    print(f"branin trials to within 0.05 of {BRANIN_MIN} ({args.seeds} seeds, cap {args.cap}):")
    print(f"  random: {random_n} mean {statistics.mean(random_n):.1f}")
    print(f"  TPE:    {tpe_n} mean {statistics.mean(tpe_n):.1f}")
    print(f"  random / TPE = {statistics.mean(random_n) / statistics.mean(tpe_n):.2f}")


def movielens_space() -> dict:
    """The space the shipped random search uses (tune/movielens_random.yaml), read from it so the
    benchmark searches what users search. Until 2026-11-27 this script kept its own copy, which
    still searched train.embedding_l2 after the job had moved to train.embedding_prior."""
    import yaml

    with open(os.path.join(ROOT, "tune", "movielens_random.yaml")) as f:
        return yaml.safe_load(f)["space"]


def movielens_search(name: str, strategy: str, seed: int, trials: int, epochs: int, asha: dict | None, concurrent: int,
                     fixed: dict | None = None, target: float | None = None, budget_s: float | None = None):
    import rayload
    from rayload.search_spec import SearchSpec

    spec = SearchSpec.model_validate({
        "name": name, "base": os.path.join(ROOT, "jobs", "movielens_deepfm.yaml"), "space": movielens_space(),
        "strategy": strategy, "num_samples": trials, "seed": seed, "max_concurrent": concurrent,
        "fixed": {"train.epochs": epochs, "train.early_stopping": None, **(fixed or {})}, "scheduler": asha,
        "target": target, "time_budget_s": budget_s, **({"startup_trials": 4} if strategy == "bayes" else {}),
    })
    start = time.perf_counter()
    res = rayload.tune(spec)
    return res, time.perf_counter() - start


def load_study(res):
    """The Optuna study a search's TuneResult stored its trials in."""
    import optuna

    from rayload.tuning import read_state

    return optuna.load_study(study_name=read_state(res.run_dir)["study"], storage=res.storage)


def best_so_far(res) -> list[tuple[float, float]]:
    """(finish time since the search began, best value so far) in the order trials finished."""
    study = load_study(res)
    done = sorted((t for t in study.trials if t.datetime_complete), key=lambda t: t.datetime_complete)
    if not done:
        return []
    t0, best, out = min(t.datetime_start for t in study.trials if t.datetime_start), -1.0, []
    for t in done:
        value = t.user_attrs.get("rayload", {}).get("best_value", t.value if t.value is not None else -1.0)
        best = max(best, value)
        out.append(((t.datetime_complete - t0).total_seconds(), best))
    return out


def bench_movielens(args) -> None:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    runs = {}
    for seed in range(args.seeds):
        for strategy in ("random", "bayes"):
            res, wall = movielens_search(f"bench-{strategy}-{seed}", strategy, seed, args.trials, args.epochs, None, 2)
            runs[(strategy, seed)] = best_so_far(res)
            print(f"  {strategy} seed {seed}: best {runs[(strategy, seed)][-1][1]:.4f} in {wall:.0f} s", flush=True)
    target = max(curve[-1][1] for curve in runs.values()) - 0.002
    count = {s: [next((i + 1 for i, (_, b) in enumerate(runs[(s, seed)]) if b >= target), args.trials + 1) for seed in range(args.seeds)]
             for s in ("random", "bayes")}
    print(f"movielens DeepFM val AUC target {target:.4f} (best of any strategy - 0.002), {args.trials} trials x {args.epochs} epochs, "
          f"{args.seeds} seeds; not reached counts as {args.trials + 1}:")
    print(f"  random: {count['random']} mean {statistics.mean(count['random']):.1f}")
    print(f"  TPE:    {count['bayes']} mean {statistics.mean(count['bayes']):.1f}")
    print(f"  random / TPE = {statistics.mean(count['random']) / statistics.mean(count['bayes']):.2f}")


def epoch_reports(res) -> list[tuple[float, float]]:
    """(unix time, metric) of every epoch any trial reported, from Tune's per-trial result.json:
    the moment a value was known, not when its trial ended (a trial that runs to max_epochs
    must not get credit only at its end). The time is the trial's `reported_at` (rayload's
    one-worker trials report it, to the microsecond), else Tune's whole-second `timestamp`."""
    import glob
    import json

    out = []
    for path in glob.glob(os.path.join(res.run_dir, "tune", "**", "result.json"), recursive=True):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                if res.metric in row:
                    out.append((row.get("reported_at", row["timestamp"]), row[res.metric]))
    return sorted(out)


def fixed_values(pairs: list[str]) -> dict:
    """--fixed KEY=VALUE pairs (values parsed as YAML) for the search spec's `fixed` section."""
    import yaml

    return {k: yaml.safe_load(v) for k, _, v in (pair.partition("=") for pair in pairs)}


def bench_asha(args) -> None:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    asha = {"kind": "asha", "grace_period": args.grace, "reduction_factor": 3, "max_epochs": args.epochs}
    runs = {}
    for seed in range(args.seeds):
        # The seeded random sampler proposes the same configurations in the same order on both sides.
        # Which side goes first alternates with the seed, as in asha-stream: the first search of a
        # pair also warms the data cache and the machine (runs before 2026-11-27 always ran "without" first).
        sides = (("without", None), ("with", asha))
        for side, sched in (sides if seed % 2 == 0 else sides[::-1]):
            start = time.time()
            res, wall = movielens_search(f"bench-{side}-{seed}", "random", seed, args.trials, args.epochs, sched, args.concurrent,
                                         fixed_values(args.fixed))
            runs[(side, seed)] = ([(t - start, v) for t, v in epoch_reports(res)], wall, res.counts())
            best = max(v for _, v in runs[(side, seed)][0])
            print(f"  seed {seed} {side} ASHA: search {wall:.0f} s, best val AUC {best:.4f}, trials {res.counts()}", flush=True)
    target = max(v for reports, _, _ in runs.values() for _, v in reports) - 0.002
    print(f"asha: {args.trials} random trials x up to {args.epochs} epochs, {args.concurrent} at a time, grace period {args.grace}, "
          f"reduction factor 3, {args.seeds} seeds, fixed {fixed_values(args.fixed)}; target val AUC {target:.4f} (best of any run - 0.002)")
    reach = {}
    for (side, seed), (reports, wall, _) in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        reach[(side, seed)] = next((t for t, v in reports if v >= target), None)
        shown = f"{reach[(side, seed)]:.0f} s" if reach[(side, seed)] is not None else "never"
        print(f"  seed {seed} {side:>7} ASHA: target reached at {shown} of a {wall:.0f} s search")
    walls = {side: statistics.mean(runs[(side, seed)][1] for seed in range(args.seeds)) for side in ("without", "with")}
    print(f"  whole search without / with = {walls['without']:.0f} s / {walls['with']:.0f} s = {walls['without'] / walls['with']:.2f}")
    censored = False
    for side in ("without", "with"):
        missed = [seed for seed in range(args.seeds) if reach[(side, seed)] is None]
        if missed:  # counted at its whole search's end: a bound, printed as such (as asha-stream does)
            print(f"  {side} ASHA never reached the target with seeds {missed}: counted at the end of its search (censored)")
            censored = True
    means = {side: statistics.mean(reach[(side, seed)] if reach[(side, seed)] is not None else runs[(side, seed)][1]
                                   for seed in range(args.seeds)) for side in ("without", "with")}
    print(f"  mean time to target without / with = {means['without']:.0f} s / {means['with']:.0f} s = "
          f"{means['without'] / means['with']:.2f}{' (censored: a side that missed the target counts its whole search)' if censored else ''}")


def first_trial_start(res) -> float:
    """Unix time the search's first trial was asked for (Optuna's datetime_start, ms precision):
    everything before it (Ray Tune's start-up, the driver preparing the data) is the same on
    both sides and does not depend on the scheduler."""
    return min(t.datetime_start.timestamp() for t in load_study(res).trials if t.datetime_start)


def bench_asha_stream(args) -> None:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    asha = {"kind": "asha", "grace_period": args.grace, "reduction_factor": 3, "max_epochs": args.epochs}
    reach, setup = {}, {}
    for seed in range(args.seeds):
        # Which side goes first alternates with the seed: the first search of a pair also warms
        # the data cache and the machine, and that must not favour one side.
        sides = (("without", None), ("with", asha))
        for side, sched in (sides if seed % 2 == 0 else sides[::-1]):
            start = time.time()
            res, wall = movielens_search(f"bench-stream-{side}-{seed}", "random", seed, 10_000, args.epochs, sched, args.concurrent,
                                         fixed_values(args.fixed), args.target, args.budget)
            reports = [(t - start, v) for t, v in epoch_reports(res)]
            setup[(side, seed)] = first_trial_start(res) - start
            reach[(side, seed)] = next((t for t, v in reports if v >= args.target), None)
            shown = f"{reach[(side, seed)]:.0f} s" if reach[(side, seed)] is not None else f"not within {args.budget:.0f} s"
            print(f"  seed {seed} {side:>7} ASHA: target reached at {shown} (first trial started at {setup[(side, seed)]:.1f} s); "
                  f"search {wall:.0f} s, best {max((v for _, v in reports), default=float('nan')):.4f}, trials {res.counts()}, "
                  f"ended: {res.ended}", flush=True)
    print(f"asha-stream: random configurations until val AUC {args.target} or {args.budget:.0f} s, up to {args.epochs} epochs, "
          f"{args.concurrent} at a time, grace period {args.grace}, reduction factor 3, {args.seeds} seeds, fixed {fixed_values(args.fixed)}")
    print("  ('from the first trial' subtracts the search's start-up, which the scheduler does not touch)")
    for seed in range(args.seeds):
        without, with_ = reach[("without", seed)], reach[("with", seed)]
        ratio = f"{without / with_:.2f}" if without is not None and with_ is not None else "-"
        print(f"  seed {seed}: time to target without / with ASHA: {without if without is None else round(without)} s / "
              f"{with_ if with_ is None else round(with_)} s = {ratio}; start-up {setup[('without', seed)]:.1f} s / "
              f"{setup[('with', seed)]:.1f} s")
    both = [s for s in range(args.seeds) if reach[("without", s)] is not None and reach[("with", s)] is not None]
    if both:
        means = {side: statistics.mean(reach[(side, s)] for s in both) for side in ("without", "with")}
        trials = {side: statistics.mean(reach[(side, s)] - setup[(side, s)] for s in both) for side in ("without", "with")}
        print(f"  mean over the {len(both)} seed(s) where both reached it, from the search's start: {means['without']:.1f} s / "
              f"{means['with']:.1f} s = {means['without'] / means['with']:.2f} (target >= 3)")
        print(f"  ... from the first trial's start: {trials['without']:.1f} s / {trials['with']:.1f} s = "
              f"{trials['without'] / trials['with']:.2f}; mean start-up {statistics.mean(setup.values()):.1f} s")
    # A side that did not reach the target within the budget took longer than the budget: censored at it.
    censored = {side: statistics.mean(reach[(side, s)] if reach[(side, s)] is not None else args.budget for s in range(args.seeds))
                for side in ("without", "with")}
    print(f"  mean over all seeds, a miss counted as the budget (understates the side that missed): "
          f"{censored['without']:.0f} s / {censored['with']:.0f} s = {censored['without'] / censored['with']:.2f}")


def main() -> None:
    sys.path.insert(0, os.path.join(ROOT, "platform"))
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="what", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--trials", type=int, default=50)
    o.add_argument("--trial-s", type=float, default=1.0)
    b = sub.add_parser("branin")
    b.add_argument("--seeds", type=int, default=10)
    b.add_argument("--cap", type=int, default=4000)
    m = sub.add_parser("movielens")
    m.add_argument("--seeds", type=int, default=5)
    m.add_argument("--trials", type=int, default=10)
    m.add_argument("--epochs", type=int, default=4)
    asha_common = argparse.ArgumentParser(add_help=False)  # what both ASHA comparisons take
    asha_common.add_argument("--epochs", type=int, default=9)
    asha_common.add_argument("--seeds", type=int, default=3)
    asha_common.add_argument("--concurrent", type=int, default=2)
    asha_common.add_argument("--grace", type=int, default=1, help="ASHA grace period (epochs)")
    asha_common.add_argument("--fixed", action="append", default=[], metavar="KEY=VALUE",
                             help="job-spec value fixed in every trial of both sides (repeatable), e.g. train.lr_decay=none")
    a = sub.add_parser("asha", parents=[asha_common])
    a.add_argument("--trials", type=int, default=18)
    st = sub.add_parser("asha-stream", parents=[asha_common])
    st.add_argument("--target", type=float, required=True, help="val AUC to reach, fixed before the run")
    st.add_argument("--budget", type=float, default=360, help="seconds each search may run")
    args = p.parse_args()
    {"overhead": bench_overhead, "branin": bench_branin, "movielens": bench_movielens, "asha": bench_asha,
     "asha-stream": bench_asha_stream}[args.what](args)


if __name__ == "__main__":
    main()
