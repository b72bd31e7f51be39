"""Drift counts out of the replicas and back together: each replica writes its counters to the
event store's `ab_drift` table every `drift.flush_s` (one row per experiment, arm and replica,
rewritten in place), and readers sum the rows of all replicas. A replica killed without
warning loses at most its last `flush_s` of counts: these are statistics, not events.

Each replica also exports the merged figures through Ray Serve's metrics API, which Ray's
Prometheus endpoint serves (with Ray's `ray_` prefix): `ray_rayload_feature_psi` and
`ray_rayload_feature_drift_flagged`,
tagged by experiment, arm and feature.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
import uuid

from . import drift
from .events import EventReader, engine_for, upsert_drift

log = logging.getLogger(__name__)


def merged_report(snapshots: dict[str, list[dict]], bins: dict[str, list], threshold: float, min_rows: int,
                  versions: dict[str, str]) -> list[dict]:
    """Per arm and feature, over all replicas: rows, PSI, OOV rate, flagged. `bins`: arm -> Bins
    of the arm's model now; `versions`: arm -> that model's version. Only replicas that served
    that version are merged: an experiment restarted under its name after an arm's checkpoint
    changed (a retrained or compressed model) leaves the old replicas' rows in the store, and
    their counts are in the old features.json's bins, which the current ones do not mean."""
    out = []
    for arm, arm_bins in bins.items():
        snaps = [s for s in snapshots.get(arm, []) if s["model_version"] == versions[arm]]
        if not snaps:
            continue
        merged = drift.merge(snaps)
        for row in drift.report(arm_bins, merged, threshold, min_rows):
            out.append({"arm": arm, "model_version": versions[arm], "replicas": len(snaps), **row})
    return out


def report_for(url: str, experiment: str, checkpoints: dict[str, str], cfg) -> list[dict]:
    """The merged drift report of an experiment, from the event store and the arms' features.json."""
    from ..features import FittedFeatures
    from ..paths import localize

    local = {arm: localize(path) for arm, path in checkpoints.items()}
    bins = {arm: drift.bins_for(FittedFeatures.load(os.path.join(path, "features.json"))) for arm, path in local.items()}
    versions = {arm: _version(path) for arm, path in local.items()}
    reader = EventReader(url)
    try:
        snapshots = reader.drift(experiment)
    finally:
        reader.close()
    return merged_report(snapshots, bins, cfg.threshold, cfg.min_rows, versions)


def _version(checkpoint: str) -> str:
    """scorer.model_version, hashed once per model.pt (GET /experiment asks on every call)."""
    st = os.stat(os.path.join(checkpoint, "model.pt"))
    return _version_cached(checkpoint, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=64)
def _version_cached(checkpoint: str, _mtime_ns: int, _size: int) -> str:
    from .scorer import model_version

    return model_version(checkpoint)


class DriftFlusher:
    """Background writer of one replica's drift counters (scorers with a DriftCounter)."""

    def __init__(self, url: str, experiment: str, scorers: dict, cfg: dict):
        self.url, self.experiment, self.cfg = url, experiment, cfg
        self.scorers = {arm: s for arm, s in scorers.items() if s.drift is not None}
        self.replica = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.written = {arm: -1 for arm in self.scorers}
        self.engine = engine_for(url)
        self._gauges = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rayload-drift", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.cfg["flush_s"]):
            try:
                self.flush()
            except Exception:  # statistics must never take serving down
                log.exception("drift flush failed")

    def flush(self) -> None:
        rows, versions = [], {}
        for arm, scorer in self.scorers.items():
            counter = scorer.drift
            version = counter.version  # read before the snapshot: counts observed meanwhile are written next time
            if version == self.written[arm]:
                continue
            snap = counter.snapshot()
            versions[arm] = version
            rows.append({"experiment": self.experiment, "arm": arm, "replica": self.replica, "model_version": scorer.version,
                         "rows": snap["rows"], "counts": json.dumps(snap["counts"]), "ts": time.time()})
        if rows:
            upsert_drift(self.engine, rows)
            self.written.update(versions)  # only once stored: a failed write is retried on the next tick and at close()
        if self.written and any(v >= 0 for v in self.written.values()):
            self._export()  # every tick: other replicas' counts move the merged figures too

    def _export(self) -> None:
        reader = EventReader(self.url)
        try:
            snapshots = reader.drift(self.experiment)
        finally:
            reader.close()
        bins = {arm: list(s.drift.bins.values()) for arm, s in self.scorers.items()}
        report = merged_report(snapshots, bins, self.cfg["threshold"], self.cfg["min_rows"],
                               {arm: s.version for arm, s in self.scorers.items()})
        gauges = self._metrics()
        if gauges is None:
            return
        for row in report:
            tags = {"experiment": self.experiment, "arm": row["arm"], "feature": row["feature"]}
            gauges[0].set(row["psi"], tags=tags)
            gauges[1].set(1.0 if row["flagged"] else 0.0, tags=tags)
            if "oov_rate" in row:  # categoricals: the share of values outside the training vocabulary
                gauges[2].set(row["oov_rate"], tags=tags)

    def _metrics(self):
        if self._gauges is None:
            try:
                from ray.serve.metrics import Gauge

                keys = ("experiment", "arm", "feature")
                self._gauges = (Gauge("rayload_feature_psi", "PSI of served feature values against the training data", tag_keys=keys),
                                Gauge("rayload_feature_drift_flagged", "1 when the feature's PSI is over the threshold", tag_keys=keys),
                                Gauge("rayload_feature_oov_rate", "Share of a categorical feature's served values outside the "
                                      "training vocabulary", tag_keys=keys))
            except Exception:  # outside a Serve replica (tests, tools): the table is still written
                log.debug("Serve metrics unavailable", exc_info=True)
                self._gauges = False
        return self._gauges or None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.flush()
        except Exception:
            log.exception("final drift flush failed")
        self.engine.dispose()
