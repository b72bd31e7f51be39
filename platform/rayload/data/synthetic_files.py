"""The synthetic-ctr data set on disk: Parquet shards of `shard_rows` rows and synthetic.json (the
parameters, the cardinalities and the truth's Bayes AUC), and the weighted AUC that scores it.
The rows themselves come from synthetic.py."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from .synthetic import CHUNK_ROWS, SynthParams, SynthResult, _model, cardinalities, generate_table_with_truth

log = logging.getLogger(__name__)


def weighted_auc(scores: np.ndarray, pos_weight: np.ndarray, neg_weight: np.ndarray) -> float:
    """Exact weighted ROC AUC in O(n log n); tied scores count half (midrank). With weights
    (p, 1 - p) this is the Bayes AUC without the sampling noise of drawn labels."""
    s, wp, wn = (np.asarray(a, dtype=np.float64).ravel() for a in (scores, pos_weight, neg_weight))
    if not len(s) == len(wp) == len(wn) > 0:
        raise ValueError(f"scores/pos_weight/neg_weight need equal non-zero lengths, got {len(s)}/{len(wp)}/{len(wn)}")
    if np.isnan(s).any() or (wp < 0).any() or (wn < 0).any():
        raise ValueError("scores must not be NaN and weights must be >= 0")
    order = np.argsort(s, kind="stable")
    s, wp, wn = s[order], wp[order], wn[order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])  # first index of each tie group
    pos, neg = np.add.reduceat(wp, starts), np.add.reduceat(wn, starts)
    total_pos, total_neg = float(pos.sum()), float(neg.sum())
    if total_pos <= 0 or total_neg <= 0:
        raise ValueError(f"AUC needs positive and negative weight, got {total_pos} and {total_neg}")
    below = np.cumsum(neg) - neg
    return float(np.sum(pos * (below + 0.5 * neg)) / (total_pos * total_neg))


def _filesystem(out_dir: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem for URIs (s3://, gs://, file://...), else the local disk."""
    return pafs.FileSystem.from_uri(out_dir) if "://" in out_dir else (pafs.LocalFileSystem(), os.path.abspath(out_dir))


def write_synthetic(out_dir: str, params: SynthParams) -> SynthResult:
    """Write part-NNNNN.parquet shards of shard_rows rows plus synthetic.json (params and truth)."""
    from ..errors import RayloadError

    _model(params)  # a model without signal is refused before anything in the folder is touched
    base = out_dir.rstrip("/")
    try:
        fs, root = _filesystem(out_dir)  # an unknown scheme (bogus://, s4://) or a missing driver was a traceback
        fs.create_dir(root, recursive=True)
        if fs.get_file_info(root).type != pafs.FileType.Directory:
            raise NotADirectoryError(20, "not a folder")
    except (OSError, pa.ArrowException) as exc:  # a file there, no permission, an unknown scheme, no credentials: was a traceback
        raise RayloadError(f"cannot write the synthetic data to {out_dir}: {getattr(exc, 'strerror', None) or exc}") from None
    # Shards of an earlier run into this folder go first: left there, a reader of the folder took
    # them with the new ones, two generations that synthetic.json does not describe. Its
    # synthetic.json before them: a rerun stopped part-way left the old truth beside new shards.
    if fs.get_file_info(f"{root}/synthetic.json").type == pafs.FileType.File:
        fs.delete_file(f"{root}/synthetic.json")
    for info in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True)):
        if info.type == pafs.FileType.File and re.fullmatch(r"part-\d{5,}\.parquet", info.base_name):
            fs.delete_file(info.path)
    files, probs, positives = [], [], 0
    for k, start in enumerate(range(0, params.rows, params.shard_rows)):
        table, p = generate_table_with_truth(params, start, min(start + params.shard_rows, params.rows))
        pq.write_table(table, f"{root}/part-{k:05d}.parquet", filesystem=fs, compression="zstd")
        files.append(f"{base}/part-{k:05d}.parquet")
        probs.append(p)
        positives += int(np.asarray(table.column("label")).sum())
        log.info("wrote %s (%d rows)", files[-1], table.num_rows)
    p_all = np.concatenate(probs)
    result = SynthResult(out_dir=out_dir, files=files, rows=params.rows, positive_rate=positives / params.rows,
                         bayes_auc=weighted_auc(p_all, p_all, 1.0 - p_all), params=params)
    meta = {"params": dataclasses.asdict(params), "cardinalities": list(cardinalities(params)),
            "rows": result.rows, "positive_rate": result.positive_rate, "bayes_auc": result.bayes_auc,
            "files": [f.rsplit("/", 1)[-1] for f in files], "chunk_rows": CHUNK_ROWS}
    with fs.open_output_stream(f"{root}/synthetic.json.tmp") as f:  # whole or absent: a complete generation ends with it
        f.write(json.dumps(meta, indent=2).encode())
    fs.move(f"{root}/synthetic.json.tmp", f"{root}/synthetic.json")
    log.info("synthetic data: %d rows, positive_rate=%.4f, bayes_auc=%.4f",
             result.rows, result.positive_rate, result.bayes_auc)
    return result
