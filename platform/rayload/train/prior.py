"""`train.embedding_prior`: a Gaussian prior on every embedding row, per ID.

`embedding_l2` penalises each occurrence of an ID alike, so over an epoch an ID seen n times is
pulled toward 0 n times as hard as an ID seen once: frequent IDs are over-shrunk and rare ones
hardly at all, and the rare IDs' rows overfit within an epoch or two. The prior weighs each row
a batch uses by 1 / (its ID's count in the training split), so over an epoch every ID gets the
same pull, as a prior does: an ID's row moves away from 0 only as far as its data outweigh it.

The counts are taken once, in the driver, from the preprocessed training split (the rows the
workers train on, after rebalancing), and travel to the workers with the loop's context. They
are kept beside the shards (`id_counts.npz`, tagged with the shards' cache key), so later runs
on the same prepared data skip the counting pass.
"""

from __future__ import annotations

import io
import logging
import uuid

import numpy as np
import pyarrow.compute as pc

from ..errors import DataError, RayloadError

log = logging.getLogger(__name__)
COUNTS_FILE = "id_counts.npz"


def embedded_columns(features) -> dict[str, int]:
    """Every column with an embedding table, in the model's table order (single-ID columns,
    then bags), mapped to its number of rows."""
    return {**features.sparse_columns, **features.bag_columns}


def id_counts(features, train) -> dict[str, np.ndarray]:
    """How often every ID of every embedded column occurs in the training split `train`
    (`PreprocessResult.batches("train")`: local shards or a Ray Dataset; only the ID columns are
    read); index = the ID."""
    columns = embedded_columns(features)
    counts = {name: np.zeros(size, dtype=np.int64) for name, size in columns.items()}
    if not counts:
        return counts
    for table in train.select_columns(list(columns)).iter_batches(batch_size=65_536, batch_format="pyarrow"):
        for name, size in columns.items():
            col = table.column(name)
            if name in features.bag_columns:
                col = pc.list_flatten(col)
            ids = col.to_numpy(zero_copy_only=False)
            outside = ids[(ids < 0) | (ids >= size)]
            if len(outside):
                raise DataError(f"column {name}: ID {int(outside[0])} outside its embedding table of {size} rows; "
                                "the shards do not match features.json")
            counts[name] += np.bincount(ids, minlength=size)
    # int32 halves what travels to every worker, where no count is too large for it
    return {name: c.astype(np.int32) if c.max(initial=0) < 2**31 else c for name, c in counts.items()}


def training_counts(pre) -> dict[str, np.ndarray]:
    """`id_counts` of a PreprocessResult's training split, read from `id_counts.npz` beside its
    shards when that file was written for the same shards (cache key) and table sizes, counted
    and written there otherwise. A folder that cannot be written (read-only storage) only costs
    the counting pass on every run."""
    from ..data._batch import filesystem

    fs, base = filesystem(pre.out_dir)
    path = f"{base}/{COUNTS_FILE}"
    sizes = embedded_columns(pre.features)
    try:
        with fs.open_input_file(path) as f:
            with np.load(io.BytesIO(f.read())) as stored:
                key, names = str(stored["key"]), [str(n) for n in stored["names"]]
                counts = {name: stored[f"c{i}"] for i, name in enumerate(names)}
        if key == pre.cache_key and {name: len(c) for name, c in counts.items()} == sizes:
            return counts
        log.info("%s belongs to other shards or tables; counting again", path)
    except FileNotFoundError:
        pass
    except Exception as exc:  # a damaged file: counted again and replaced
        log.warning("could not read %s (%r); counting again", path, exc)
    counts = id_counts(pre.features, pre.batches("train"))
    buf = io.BytesIO()
    # arrays under generated names: a column may be called anything, savez's own arguments included
    np.savez(buf, key=np.array(pre.cache_key), names=np.array(list(counts), dtype=str),
             **{f"c{i}": c for i, c in enumerate(counts.values())})
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"  # whole or absent for a concurrent reader
    try:
        with fs.open_output_stream(tmp) as f:
            f.write(buf.getvalue())
        fs.move(tmp, path)
    except Exception as exc:  # OSError, or a filesystem without move: the counts are still good
        log.warning("could not keep the ID counts in %s (%r); they are counted on every run", path, exc)
        try:
            fs.delete_file(tmp)
        except Exception:
            pass  # never written, or already moved
    return counts


def attach(embeddings: list, features, counts: dict[str, np.ndarray] | None, device) -> None:
    """Give every embedding layer (the model's FieldEmbeddings) the inverse counts its forward
    pass weighs rows by."""
    import torch

    if counts is None:
        raise RayloadError("train.embedding_prior is set but the loop got no ID counts (context['id_counts'], "
                            "from train.trainer.loop_context)")
    columns = embedded_columns(features)
    missing = [name for name in columns if name not in counts or len(counts[name]) != columns[name]]
    if missing:
        raise RayloadError(f"train.embedding_prior: no ID counts matching features.json for {missing}")
    inverse = [torch.from_numpy(1.0 / np.maximum(counts[name], 1)).float().to(device) for name in columns]
    for module in embeddings:
        module.inv_counts = inverse
