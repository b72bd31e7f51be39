"""The heartbeat of a search's driver: how a resume on another machine tells a driver that still
runs from one whose machine stopped.

A driver on this machine is checked by its pid. One on another machine (a run folder on shared
storage) cannot be, so the driving process rewrites `driver.beat` in the run folder every
BEAT_S seconds: its pid, host and a counter. A resume watches the counter for WATCH_S: a driver
that moves it is alive; one that does not has stopped. Nothing compares clocks across machines,
and the file is rewritten in place, not replaced, so NFS's close-to-open consistency shows each
new beat to a reader that opens the file again (a replaced file's name may stay cached)."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

log = logging.getLogger(__name__)

BEAT_FILE = "driver.beat"
BEAT_S = 5.0  # how often a driving process marks its run
WATCH_S = 4 * BEAT_S  # how long a resume watches for a beat: several beats, however the two processes interleave
STALE_S = 12 * BEAT_S  # status calls another machine's driver silent past this (by this machine's clock)
_WIDTH = 256  # the record is padded to one size, so a rewrite in place never leaves a longer old tail


class Beat:
    """Marks `run_dir` as driven by this process until stop(): a daemon thread rewrites the beat."""

    def __init__(self, run_dir: str, every: float | None = None):
        self.path = os.path.join(run_dir, BEAT_FILE)
        self.every = BEAT_S if every is None else every
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rayload-search-beat", daemon=True)

    def start(self) -> "Beat":
        self.beat()  # the first one before the caller goes on: the run is marked as soon as it is claimed
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.beat()

    def beat(self) -> None:
        self.count += 1
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "beat": self.count}).ljust(_WIDTH).encode()
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, record, 0)
            finally:
                os.close(fd)
        except OSError as exc:  # a full or vanished disk must not stop the search; the resume then sees no beat
            log.warning("cannot mark the search as driven in %s: %s", self.path, exc)


def read_beat(run_dir: str) -> dict | None:
    """The last beat written in `run_dir`, None when there is none (or it cannot be read)."""
    try:
        with open(os.path.join(run_dir, BEAT_FILE), "rb") as f:
            return json.loads(f.read(_WIDTH).decode())
    except (OSError, ValueError):
        return None


def still_beating(run_dir: str, pid: int | None, host: str | None, watch: float | None = None) -> bool | None:
    """Whether the driver `pid` on `host` still beats in `run_dir`: True as soon as its counter
    moves, False when it did not move for `watch` seconds, None when that driver left no beat
    (one of an older rayload, or one that could not write it): it cannot be told."""
    first = read_beat(run_dir)
    if first is None or (first.get("pid"), first.get("host")) != (pid, host):
        return None
    deadline = time.monotonic() + (WATCH_S if watch is None else watch)
    while time.monotonic() < deadline:
        time.sleep(0.25)
        if read_beat(run_dir) != first:
            return True
    return False


def silent_for(run_dir: str) -> float | None:
    """Seconds since the beat file last changed, by this machine's clock (status only: a resume
    never compares clocks); None without a beat file."""
    try:
        return max(0.0, time.time() - os.stat(os.path.join(run_dir, BEAT_FILE)).st_mtime)
    except OSError:
        return None
