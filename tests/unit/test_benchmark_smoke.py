"""The benchmark parts that start no Ray run end to end with tiny options: `make bench` and the
commands recorded in benchmarks/RESULTS.md broke when an API they use changed (bench_tune.py
branin passed a sampler where open_study now takes a maker of one, and died at its first trial).
Nothing here is timed."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_branin_sample_efficiency_benchmark_runs_and_prints_its_ratio():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_tune.py"), "branin", "--seeds", "1", "--cap", "30"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert any(line.strip().startswith("TPE:") for line in lines) and any(line.strip().startswith("random / TPE = ") for line in lines)
