"""Where rayload keeps its files when a spec does not say."""

from __future__ import annotations

import os


def runs_root() -> str:
    """Root of run folders and caches: $RAYLOAD_HOME, else ./runs (relative to the job's cwd)."""
    return os.path.abspath(os.environ.get("RAYLOAD_HOME", "runs"))


def cache_root() -> str:
    return os.path.join(runs_root(), "cache")
