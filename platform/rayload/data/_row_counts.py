"""Row accounting of a preprocessing run: good and quarantined rows, their reasons and splits,
the bad-row limit, and the checks on the split sizes."""

from __future__ import annotations

import json
import logging

import pyarrow.parquet as pq

from ..errors import DataError
from .sources import Inputs
from .result import SPLIT_NAMES

log = logging.getLogger(__name__)


def counts_of(parts: list[dict], inputs: Inputs) -> dict:
    good, bad = sum(p["good"] for p in parts), sum(p["bad"] for p in parts)
    reasons: dict[str, int] = {}
    train_labels: dict[float, int] = {}
    for p in parts:
        for r, n in p["reasons"].items():
            reasons[r] = reasons.get(r, 0) + n
        for label, n in p["train_labels"].items():
            train_labels[label] = train_labels.get(label, 0) + n
    split_rows = {s: sum(p["split_rows"][s] for p in parts) for s in SPLIT_NAMES}
    if inputs.fmt == "parquet":
        expected = sum(pq.ParquetFile(p, filesystem=inputs.filesystem).metadata.num_rows for p in inputs.paths)
        if expected != good + bad:  # conservation is an invariant; breaking it is a bug, not bad data
            raise RuntimeError(f"row accounting broke: {expected} input rows, {good} good + {bad} quarantined")
    return {"input": good + bad, "good": good, "quarantined": bad, "reasons": reasons,
            "split_rows": split_rows, "train_labels": train_labels}


def check_bad_fraction(counts: dict, parts: list[dict], limit: float) -> None:
    if counts["input"] == 0:
        raise DataError("the source has no rows (data.source)")
    frac = counts["quarantined"] / counts["input"]
    if frac <= limit:
        return
    examples = [e for p in parts for e in p["examples"]][:3]
    # each example names its file: with many shards a line number alone pointed nowhere
    lines = "".join(f"\n  - {e['source'] + ': ' if e.get('source') else ''}{e['reason']}: {e['row']}" for e in examples)
    raise DataError(
        f"{counts['quarantined']} of {counts['input']} rows ({frac:.2%}) are bad, more than "
        f"data.max_bad_fraction={limit}; reasons: {counts['reasons']}{chr(10) + 'examples:' + lines if lines else ''}\n"
        "Fix the data or the declared schema, or raise data.max_bad_fraction."
    )


def check_split_rows(rows: dict[str, int], split) -> None:
    """A preprocessor fitted on no training rows (empty vocabularies, default statistics) is
    refused before any shard is written. An empty val or test split that was asked for is only
    logged: a hash split leaves one empty by chance on tiny data alone, and training refuses a
    missing val with its own error (a temporal split, whose cuts follow from the data, refuses
    both in `SplitPlan.with_cutoffs`)."""
    counts = ", ".join(f"{s} {rows[s]}" for s in SPLIT_NAMES)
    if rows["train"] == 0:
        raise DataError(
            f"the training split is empty (split.kind={split.kind}: {counts} good rows), so there is nothing to fit the "
            f"preprocessor on; use more rows, a larger split.train, another split.seed, or (kind: group) more groups")
    for name in ("val", "test"):
        asked = (split.kind == "kfold" or split.val > 0) if name == "val" else split.test > 0  # kfold: val is fold split.fold
        if rows[name] == 0 and asked:
            log.warning("the %s split is empty although one was asked for (split.kind=%s, train=%s, val=%s, test=%s: %s good rows)",
                        name, split.kind, split.train, split.val, split.test, counts)
    _warn_uneven(rows, split, counts)


def _warn_uneven(rows: dict[str, int], split, counts: str) -> None:
    """Splits that keep groups whole (kind: group, group k-fold, split.key) place groups by their
    hash, one draw per group: with a few large groups the row shares can be far from those asked
    (a Zipf user column gave val 0.3% of the rows for 10% asked), said here rather than found in
    the metrics."""
    total = sum(rows[s] for s in SPLIT_NAMES)
    grouped = split.kind == "group" or getattr(split, "group", None) is not None or bool(getattr(split, "key", None))
    if not grouped or total < 100:
        return
    if split.kind == "kfold":
        rest = 1.0 - split.test
        asked = {"train": rest * (split.k - 1) / split.k, "val": rest / split.k, "test": split.test}
    else:
        asked = {"train": split.train, "val": split.val, "test": split.test}
    for name, want in asked.items():
        got = rows[name] / total
        if want > 0 and abs(got - want) > max(0.05, 0.5 * want):
            log.warning("the %s split holds %.1f%% of the rows where %.1f%% was asked (%s good rows): the split keeps each group "
                        "(split.group / split.key) whole and places groups by a hash, one draw per group, so a few large groups "
                        "move the shares; use a key with more, smaller groups, or another split.seed", name, 100 * got, 100 * want, counts)


def with_moved(counts: dict, manifest: list[dict]) -> dict:
    """The counts with the rows the write pass quarantined (`_batch._without_far_rows`:
    scaled past what a model can score, known only once the preprocessor is fitted) moved from
    good to quarantined, under their reasons."""
    moved = [(r["split"], json.loads(r["moved"])) for r in manifest if r.get("moved")]
    if not moved:
        return counts
    reasons, split_rows = dict(counts["reasons"]), dict(counts["split_rows"])
    for split, by_reason in moved:
        for reason, n in by_reason.items():
            reasons[reason] = reasons.get(reason, 0) + n
            split_rows[split] -= n
    n = sum(sum(by_reason.values()) for _, by_reason in moved)
    log.warning("%d rows quarantined by the transform: a scaled numeric value too far outside the training rows to score (%s)",
                n, "; ".join(sorted({r for _, by in moved for r in by})[:3]))
    return dict(counts, good=counts["good"] - n, quarantined=counts["quarantined"] + n, reasons=reasons, split_rows=split_rows)
