"""Drift counts out of the replicas and back together: each replica writes its counters to the
event store's `ab_drift` table every `drift.flush_s` (one row per experiment, arm, replica and
period, rewritten in place while the period lasts), and readers sum the rows of all replicas
over the recent window. A replica killed without warning loses at most its last `flush_s` of
counts: these are statistics, not events.

The window: `drift.window_s` (default a day) is counted in PERIODS periods of window_s / PERIODS
each; a reader merges the periods written within window_s of the latest (the current one's),
so a shift shows at its full size once it fills the window, and a flag clears once the shifted
traffic has left it, instead of being diluted by (and then stuck behind) everything served
since the replica started. Rows older than two windows are deleted by the replicas' flushers.
`window_s: null` counts everything since each replica started, in one row per replica.

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
from .events import EventReader, engine_for, prune_drift, upsert_drift

log = logging.getLogger(__name__)

PERIODS = 24  # a window is counted in this many periods


def period_s(window_s: float | None) -> float | None:
    return window_s / PERIODS if window_s else None


def merged_report(snapshots: dict[str, list[dict]], bins: dict[str, list], threshold: float, min_rows: int,
                  versions: dict[str, str], window_s: float | None = None) -> list[dict]:
    """Per arm and feature, over all replicas: rows, PSI, OOV rate, flagged. `bins`: arm -> Bins
    of the arm's model now; `versions`: arm -> that model's version. Only replicas that served
    that version are merged: an experiment restarted under its name after an arm's checkpoint
    changed (a retrained or compressed model) leaves the old replicas' rows in the store, and
    their counts are in the old features.json's bins, which the current ones do not mean.
    `window_s`: only the periods written within window_s of the arm's latest (a row's `ts`):
    a live experiment's last window, and a stopped one's last window of traffic, whatever the
    reader's clock says."""
    out = []
    for arm, arm_bins in bins.items():
        snaps = [s for s in snapshots.get(arm, []) if s["model_version"] == versions[arm]]
        if not snaps:
            continue
        if window_s:
            since = max(s["ts"] for s in snaps) - window_s
            snaps = [s for s in snaps if s["ts"] >= since]
        merged = drift.merge(snaps)
        replicas = len({s["replica"].partition("/")[0] for s in snaps})  # a replica's periods are one replica
        for row in drift.report(arm_bins, merged, threshold, min_rows):
            out.append({"arm": arm, "model_version": versions[arm], "replicas": replicas, **row})
    return out


def window_of(cfg) -> float | None:
    """The window a report merges (`cfg`: the spec's Drift section or its dict)."""
    return cfg.get("window_s") if isinstance(cfg, dict) else cfg.window_s


def report_for(url: str, experiment: str, checkpoints: dict[str, str], cfg) -> list[dict]:
    """The merged drift report of an experiment, from the event store and the arms' features.json."""
    from ..features import FittedFeatures
    from ..paths import localize

    local = {arm: localize(path) for arm, path in checkpoints.items()}
    bins = {arm: drift.bins_for(FittedFeatures.load(os.path.join(path, "features.json"))) for arm, path in local.items()}
    versions = {arm: _version(path) for arm, path in local.items()}
    reader = EventReader(url, must_exist=True)
    try:
        snapshots = reader.drift(experiment)
    finally:
        reader.close()
    return merged_report(snapshots, bins, cfg.threshold, cfg.min_rows, versions, window_of(cfg))


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

    def __init__(self, url: str, experiment: str, scorers: dict, cfg: dict, clock=time.time):
        self.url, self.experiment, self.cfg, self.clock = url, experiment, cfg, clock
        self.scorers = {arm: s for arm, s in scorers.items() if s.drift is not None}
        self.period_s = period_s(cfg.get("window_s"))
        for scorer in self.scorers.values():  # fresh counters (nothing served yet): by period from now on
            scorer.drift.count_by(self.period_s)
        self.replica = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.pruned = 0.0
        self.written = {arm: -1 for arm in self.scorers}
        self.engine = engine_for(url)
        self._gauges = None
        self._exported: set[tuple[str, str]] = set()  # (arm, feature) pairs the gauges were set for
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rayload-drift", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.cfg["flush_s"]):
            try:
                self.flush()
            except Exception:  # statistics must never take serving down
                log.exception("drift flush failed")

    def _row(self, arm: str, scorer, period: int, snap: dict, now: float) -> dict:
        end = scorer.drift.period_end(period)
        return {"experiment": self.experiment, "arm": arm, "replica": self.replica if end is None else f"{self.replica}/{period}",
                "model_version": scorer.version, "rows": snap["rows"], "counts": json.dumps(snap["counts"]),
                "ts": now if end is None else min(now, end)}  # a period's row is dated by its last count, at most its end

    def flush(self) -> None:
        rows, versions, closed = [], {}, {}
        now = self.clock()
        for arm, scorer in self.scorers.items():
            counter = scorer.drift
            version = counter.version  # read before the snapshot: counts observed meanwhile are written next time
            closed[arm] = list(counter.closed)  # periods that ended: their final counts
            rows += [self._row(arm, scorer, period, snap, now) for period, snap in closed[arm]]
            if version == self.written[arm]:
                continue
            period, snap = counter.period, counter.snapshot()
            versions[arm] = version
            if snap["rows"]:
                rows.append(self._row(arm, scorer, period, snap, now))
        if rows:
            upsert_drift(self.engine, rows)
            self.written.update(versions)  # only once stored: a failed write is retried on the next tick and at close()
            for arm, done in closed.items():
                del self.scorers[arm].drift.closed[:len(done)]  # `observe` only appends
        if self.period_s and now - self.pruned >= self.period_s:
            prune_drift(self.engine, self.experiment, now - 2 * self.period_s * PERIODS)
            self.pruned = now
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
                               {arm: s.version for arm, s in self.scorers.items()}, window_of(self.cfg))
        gauges = self._metrics()
        if gauges is None:
            return
        seen = set()
        for row in report:
            tags = {"experiment": self.experiment, "arm": row["arm"], "feature": metric_tag(row["feature"])}
            seen.add((row["arm"], row["feature"]))
            gauges[0].set(row["psi"], tags=tags)
            gauges[1].set(1.0 if row["flagged"] else 0.0, tags=tags)
            # judged: past min_rows values and requests (a PSI of 8 on 20 rows is noise, not drift)
            gauges[3].set(1.0 if row.get("judged") else 0.0, tags=tags)
            if "oov_rate" in row:  # categoricals: the share of values outside the training vocabulary
                gauges[2].set(row["oov_rate"], tags=tags)
        for arm, feature in self._exported - seen:  # no rows left in the window: not flagged, not judged (not the last values)
            tags = {"experiment": self.experiment, "arm": arm, "feature": metric_tag(feature)}
            gauges[1].set(0.0, tags=tags)
            gauges[3].set(0.0, tags=tags)
        self._exported = seen

    def _metrics(self):
        if self._gauges is None:
            try:
                from ray.serve.metrics import Gauge

                keys = ("experiment", "arm", "feature")
                self._gauges = (Gauge("rayload_feature_psi", "PSI of served feature values against the training data", tag_keys=keys),
                                Gauge("rayload_feature_drift_flagged", "1 when the feature's PSI is over the threshold", tag_keys=keys),
                                Gauge("rayload_feature_oov_rate", "Share of a categorical feature's served values outside the "
                                      "training vocabulary", tag_keys=keys),
                                Gauge("rayload_feature_drift_judged", "1 when the feature's PSI rests on drift.min_rows values "
                                      "and requests (below, it is not judged)", tag_keys=keys))
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


def metric_tag(value: str) -> str:
    """A tag value Ray's metrics take: they refuse any non-ASCII text (UnicodeEncodeError), and a
    column named 'âge' stopped every flush's export. Non-ASCII characters are written as Python
    escapes ('\\xe2ge'), which keeps different names apart."""
    return value if value.isascii() else value.encode("ascii", "backslashreplace").decode("ascii")
