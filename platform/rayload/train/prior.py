"""`train.embedding_prior`: a Gaussian prior on every embedding row, per ID.

`embedding_l2` penalises each occurrence of an ID alike, so over an epoch an ID seen n times is
pulled toward 0 n times as hard as an ID seen once: frequent IDs are over-shrunk and rare ones
hardly at all, and the rare IDs' rows overfit within an epoch or two. The prior weighs each row
a batch uses by 1 / (its ID's count in the training split), so over an epoch every ID gets the
same pull, as a prior does: an ID's row moves away from 0 only as far as its data outweigh it.

The counts are taken once, in the driver, from the preprocessed training split (the rows the
workers train on, after rebalancing), and travel to the workers with the loop's context.
"""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc

from ..errors import DataError, RayloadError


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
