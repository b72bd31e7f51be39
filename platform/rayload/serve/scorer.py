"""One model, ready to score raw request rows: the checkpoint's model plus its features.json,
applied with the very code that prepared the training data (FittedFeatures.transform_rows,
train.batch.collate), so a served score equals the offline prediction for the same row."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np


@dataclass
class Scorer:
    arm: str
    checkpoint: str
    version: str
    model: object
    features: object
    layout: object
    binary: bool
    params: int
    drift: object = None  # serve.drift.DriftCounter of the rows this model scored, when monitoring is on
    transform_key: str = ""  # sha256 of features.json: models with equal keys transform rows identically
    forward: object = None  # models.inference.ServingForward: the traced graph, or the eager model (see its `mode`)

    @classmethod
    def load(cls, arm: str, checkpoint: str, drift: bool = False, torchscript: bool = True) -> "Scorer":
        """`torchscript`: serve the model's frozen trace where it matches the eager model
        (models/inference.py: about 2x less time per forward at serving batch sizes)."""
        import torch

        from ..models import InputShape
        from ..models.inference import for_serving
        from ..train import checkpoint as ckpt
        from ..train.batch import Layout

        torch.set_num_threads(1)  # one replica per core: intra-op threads only contend
        local = ckpt.localize(checkpoint)  # a URI (shared storage) is downloaded to this node first
        loaded = ckpt.load(local)
        params = sum(t.numel() for t in loaded.model.state_dict().values() if isinstance(t, torch.Tensor))
        counter = None
        if drift:
            from .drift import DriftCounter

            counter = DriftCounter(loaded.features)
        f = loaded.features
        forward = for_serving(loaded.model, InputShape.from_features(f), enabled=torchscript)
        return cls(arm, checkpoint, model_version(local), loaded.model, f, Layout.from_features(f), f.label.task == "binary",
                   params, counter, hashlib.sha256(f.to_json().encode()).hexdigest(), forward)

    @property
    def feature_names(self) -> set[str]:
        return {c["name"] for c in self.features.columns if c["role"] not in ("label",)}

    def score(self, rows: list[dict], sizes: list[int] | None = None) -> np.ndarray:
        """Scores (probabilities for binary tasks) for raw feature dicts; DataError names a bad row."""
        return self.score_table(self.features.transform_rows(rows), rows, sizes)

    def score_table(self, table, rows: list[dict], sizes: list[int] | None = None) -> np.ndarray:
        """Scores for rows already transformed by `features.transform_rows` (this model's or one
        with the same `transform_key`); `rows` are the raw dicts, for the drift counts, and
        `sizes` the rows of each request they came from (None: one each; see DriftCounter.observe)."""
        import torch

        from ..train.batch import collate

        batch = collate(table, self.layout)
        with torch.no_grad():
            out = self.forward(*batch.inputs()).float()
            out = torch.sigmoid(out) if self.binary else out
        scores = out.numpy().astype(np.float64)
        if self.drift is not None:  # the requests this model answered are the traffic it saw (not those it failed)
            ok = np.isfinite(scores)
            if ok.all():
                self.drift.observe(rows, table, sizes)
            elif (answered := _answered(rows, table, sizes, ok))[0]:
                self.drift.observe(*answered)
        return scores


def _answered(rows: list[dict], table, sizes: list[int] | None, ok: np.ndarray):
    """The rows (and their transform and request sizes) of the requests whose every score is a
    finite number: a request with a NaN score gets a 500 (`batch_scoring`), and its rows are no
    traffic the model answered."""
    sizes = sizes or [1] * len(rows)
    starts = np.cumsum([0, *sizes])
    kept = [i for i in range(len(sizes)) if ok[starts[i]:starts[i + 1]].all()]
    idx = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in kept]).astype(np.int64) if kept else np.zeros(0, np.int64)
    return [rows[j] for j in idx], table.take(idx), [sizes[i] for i in kept]


MAX_VERSION = 128  # the event store's model_version columns (serve/events.py)


def model_version(checkpoint: str) -> str:
    """`<run>/<checkpoint>@<first 10 hex of model.pt's sha256>`: names the run and pins the weights.
    Folder names too long for the store's column keep their start and end around "...": the
    hash still pins the weights."""
    digest = hashlib.sha256()
    with open(os.path.join(checkpoint, "model.pt"), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    name = "/".join(os.path.normpath(checkpoint).split(os.sep)[-2:])
    room = MAX_VERSION - 11  # "@" and 10 hex digits
    if len(name) > room:
        name = name[:room // 2 - 2] + "..." + name[-(room - room // 2 - 1):]
    return f"{name}@{digest.hexdigest()[:10]}"
