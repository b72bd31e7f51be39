"""retrain's training rows: the A/B run's exposures in a sliding window of recent time,
labelled by an outcome within the attribution window (retraining.py's step 1)."""

from __future__ import annotations

import json
import logging
import os
import re

import pyarrow as pa

from .errors import DataError, RayloadError
from .paths import localize

log = logging.getLogger("rayload.retraining")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str, field: str) -> float | None:
    """'7d', '12h', '30m', '45s', '2w' to seconds; 'all' to None (no limit)."""
    if text == "all":
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text or "")
    if not m:
        raise RayloadError(f"{field} must look like 30s, 15m, 12h, 7d or 2w (or 'all'), got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


DEFAULT_ATTRIBUTION = "30m"


def experiment_attribution(args: dict) -> str:
    """--attribution by default: the experiment's own `analysis.attribution_s` (how long after
    an exposure its outcome may still arrive) where the A/B spec sets one above 0, so the
    retrained model learns the outcome the next experiment judges it by; else 30 minutes."""
    own = (args.get("spec", {}).get("analysis") or {}).get("attribution_s")
    if not own:
        return DEFAULT_ATTRIBUTION
    return f"{int(own)}s" if float(own).is_integer() else f"{float(own):f}s"


def windows(window: str, attribution: str) -> tuple[float | None, float | None]:
    """--window and --attribution in seconds (None: 'all'), refused when no exposure could get a
    label: a zero duration, or a window no longer than the attribution (a labelled exposure is
    older than the attribution, and the window would hold none; more traffic would not help)."""
    window_s, attribution_s = parse_duration(window, "--window"), parse_duration(attribution, "--attribution")
    if window_s == 0 or attribution_s == 0:
        raise RayloadError(f"--window and --attribution must be durations above 0 (or 'all'); got --window {window} "
                           f"--attribution {attribution}")
    if window_s is not None and attribution_s is not None and window_s <= attribution_s:
        raise RayloadError(f"--window {window} must be longer than --attribution {attribution}: only exposures older than "
                           "the attribution window have a final label, and the window would hold none")
    return window_s, attribution_s


def training_rows(args: dict, champion: str, window_s: float | None, attribution_s: float | None, now: float,
                  unlogged: list[int] | None = None) -> pa.Table:
    """The labelled rows: one per exposure in the window whose label is known, of the experiment's
    current generation. `unlogged` gets the count of exposures left out for lack of features."""
    from .ab_spec import ABSpec
    from .features import FittedFeatures
    from .data.json_values import python_array, read_values
    from .serve.events import EventReader

    spec = ABSpec.model_validate(args["spec"])
    reader = EventReader(args["events_url"], must_exist=True)
    since, generation = None if window_s is None else now - window_s, args.get("generation")
    try:
        frame = reader.training_frame(args["experiment"], since=since, until=now, event=spec.analysis.event, generation=generation)
        skipped = reader.unlogged_count(args["experiment"], since, now, generation)
    finally:
        reader.close()
    if skipped:
        log.warning("%d exposure(s) of %s in the window were logged without their features (events.log_features off) and are "
                    "left out of the retrain", skipped, args["experiment"])
    if unlogged is not None:
        unlogged.append(skipped)
    frame, labels = _labelled(frame, attribution_s, now)
    features = FittedFeatures.load(os.path.join(localize(champion), "features.json"))
    rows = [json.loads(text) for text in frame["features"]]
    # as serving read them: mixed types (python_array), a bag's JSON arrays as its joined text
    columns = {c["name"]: python_array(read_values([r.get(c["name"]) for r in rows], c)[0]) for c in input_columns(features)}
    columns[features.label.column] = pa.array(labels, pa.float64())
    columns["request_id"] = pa.array(list(frame["request_id"]), pa.string())
    return pa.table(columns)


def _labelled(frame, attribution_s: float | None, now: float):
    """(the exposures whose attribution window has fully elapsed, their labels: 1.0 when an
    outcome came within the window). A younger exposure is left out even when its outcome has
    already arrived: keeping those and dropping the ones still waiting would make the recent
    rows all positive. With no attribution limit ('all') every exposure counts."""
    delay = frame["outcome_ts"] - frame["ts"]
    within = delay.notna() & ((delay <= attribution_s) if attribution_s is not None else True)
    known = (now - frame["ts"]) >= (attribution_s or 0.0)
    return frame[known], within[known].astype("float64").to_numpy()


def input_columns(features) -> list[dict]:
    """The raw columns a request carries, as serving reads them (`request_columns`: no id or
    timestamp column that no derived feature is computed from, so a logged exposure lacks them,
    and declaring them here, where they are required, would quarantine every row), less the
    derived columns."""
    from .data.validate import request_columns

    return [c for c in request_columns(features.columns, features.derived_sources) if c["name"] not in features.derived]


def check_rows(rows: int, positives: int, run: str) -> None:
    if rows < 50 or positives == 0 or positives == rows:
        raise DataError(f"A/B run {run} has {rows} labelled exposures ({positives} with an outcome) in the window: too few, or one "
                        "class only, to retrain on; widen --window, wait for more traffic, or check that events.log_features is on")
