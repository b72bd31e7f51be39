"""Demo wall time (issue 6): `rayload demo` on a fresh runs folder, as `make demo` runs it.

    .venv/bin/python benchmarks/bench_demo.py [--port 8799]

Prints the wall time of the whole lifecycle (data, baseline, 8-trial search, A/B test,
decision, report) against the 5-minute target as a ratio, each stage's share, and the
ratio of an immediate re-run (every stage unchanged, so skipped) to the first run, both
measured in this run. A fresh RAYLOAD_HOME means nothing is cached: MovieLens is
materialised and preprocessed from scratch.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

TARGET_S = 300.0
RAYLOAD = os.path.join(os.path.dirname(sys.executable), "rayload")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def demo(home: str, port: int) -> float:
    start = time.perf_counter()
    r = subprocess.run([RAYLOAD, "demo", "--port", str(port)], cwd=ROOT, env=dict(os.environ, RAYLOAD_HOME=home, COLUMNS="160"),
                       capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if r.returncode != 0:
        sys.exit(f"rayload demo failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    summary = r.stdout.split("summary")[-1]
    print(summary.strip()[:1500])
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8799)
    args = parser.parse_args()
    home = tempfile.mkdtemp(prefix="rayload-bench-demo-")
    first = demo(home, args.port)
    with open(os.path.join(home, "demo", "manifest.json")) as f:
        stages = json.load(f)["stages"]
    again = demo(home, args.port)
    print(f"\ndemo wall time: {first:.1f} s; target {TARGET_S:.0f} s; ratio wall/target = {first / TARGET_S:.2f} "
          f"({'met' if first <= TARGET_S else 'NOT met'})")
    total = sum(s["seconds"] for s in stages)
    for s in stages:
        print(f"  {s['name']:<10} {s['seconds']:7.1f} s  {s['seconds'] / first:6.1%} of the wall time")
    print(f"  outside stages (start-up, Ray, report): {first - total:.1f} s")
    print(f"re-run with every stage unchanged: {again:.1f} s; ratio re-run/first = {again / first:.2f}")


if __name__ == "__main__":
    main()
