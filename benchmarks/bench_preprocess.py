"""Preprocessing throughput: Ray Data pipeline vs a single-process pyarrow run of the same code.

    .venv/bin/python benchmarks/bench_preprocess.py [--rows 2000000] [--repeats 2]

Both engines run the identical per-batch functions (parse, validate, split, fit statistics,
transform, write) over the same synthetic-ctr Parquet shards (13 numeric + 26 categorical
columns); "local" iterates the files in this process, "ray" runs them as Ray Data tasks on
every CPU. Runs alternate local/ray so drift on a shared machine hits both; the ratio of
medians is printed (rows/s of Ray divided by rows/s of local: > 1 means Ray is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "platform"))

from rayload._ray import ensure_ray  # noqa: E402
from rayload.data.pipeline import preprocess  # noqa: E402
from rayload.data.synthetic import SynthParams, write_synthetic  # noqa: E402
from rayload.spec import JobSpec  # noqa: E402


def job(path: str) -> JobSpec:
    return JobSpec.model_validate({
        "name": "bench",
        "data": {"source": {"kind": "parquet", "path": path},
                 "columns": [{"name": f"I{i}", "role": "numeric"} for i in range(1, 14)]
                 + [{"name": f"C{i}", "role": "categorical"} for i in range(1, 27)],
                 "label": {"column": "label"}},
        "split": {"kind": "random", "seed": 0, "key": ["I1", "C1", "C2", "C3"]},
        # Criteo practice: log then z-score counts; vocabularies for small columns, hashing for big ones.
        "features": {"numeric": {f"I{i}": {"impute": "median", "log": True} for i in range(1, 14)},
                     "categorical": {f"C{i}": {"encode": "vocab" if i <= 13 else "hash", "buckets": 100_000, "min_count": 2} for i in range(1, 27)}},
    })


def run(spec: JobSpec, engine: str, out: str) -> dict:
    start = time.perf_counter()
    res = preprocess(spec, out=out, engine=engine)
    total = time.perf_counter() - start
    assert not res.cached and res.counts["quarantined"] == 0
    return {"total": total, "fit": res.counts["seconds"]["fit"], "write": res.counts["seconds"]["transform_write"], "rows": res.counts["input"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--shard-rows", type=int, default=125_000)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="rayload-bench-")
    data = os.path.join(work, "data")
    t = time.perf_counter()
    write_synthetic(data, SynthParams(rows=args.rows, shard_rows=args.shard_rows, seed=0))
    print(f"generated {args.rows:,} rows in {time.perf_counter() - t:.1f}s ({os.cpu_count()} CPUs)")
    spec = job(data)
    ensure_ray()
    run(spec, "ray", os.path.join(work, "warmup"))  # start Ray workers outside the timing
    results = {"local": [], "ray": []}
    for i in range(args.repeats):
        for engine in ("local", "ray"):
            r = run(spec, engine, os.path.join(work, f"{engine}-{i}"))
            results[engine].append(r)
            print(f"  {engine:5s} run {i}: total {r['total']:.2f}s  fit {r['fit']:.2f}s  transform+write {r['write']:.2f}s")
    med = {e: {k: statistics.median(r[k] for r in rs) for k in ("total", "fit", "write")} for e, rs in results.items()}
    rows = results["ray"][0]["rows"]
    for key in ("total", "fit", "write"):
        ratio = med["local"][key] / med["ray"][key]
        print(f"{key:6s}: ray {rows / med['ray'][key]:>10,.0f} rows/s  local {rows / med['local'][key]:>10,.0f} rows/s  ratio ray/local = {ratio:.2f}")


if __name__ == "__main__":
    main()
