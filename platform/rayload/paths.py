"""Where rayload keeps its files when a spec does not say."""

from __future__ import annotations

import contextlib
import fcntl
import os


def runs_root() -> str:
    """Root of run folders and caches: $RAYLOAD_HOME, else ./runs (relative to the job's cwd)."""
    return os.path.abspath(os.environ.get("RAYLOAD_HOME", "runs"))


def cache_root() -> str:
    """Materialised built-in sources and preprocessed shards: $RAYLOAD_CACHE, else
    $RAYLOAD_HOME/cache. Several run folders (users, jobs) on one machine can share one cache:
    entries are keyed by content and written under `cache_lock`."""
    cache = os.environ.get("RAYLOAD_CACHE")
    return os.path.abspath(cache) if cache else os.path.join(runs_root(), "cache")


@contextlib.contextmanager
def cache_lock(entry: str):
    """Hold an exclusive lock on a local cache entry (an flock on `entry`.lock) while it is
    checked and written: a second process that wants the same entry waits, then finds it
    finished instead of writing the same files under the first one. Remote entries (a URL) are
    not locked: the last writer wins there, and a reader only trusts an entry whose _SUCCESS
    marker names its key."""
    if "://" in entry:
        yield
        return
    os.makedirs(os.path.dirname(os.path.abspath(entry)), exist_ok=True)
    with open(f"{entry}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
