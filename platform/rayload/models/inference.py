"""The serving forward: a model traced and frozen with TorchScript, checked against eager first.

At serving batch sizes (1 to a few dozen rows) a recommendation model's eager forward is mostly
Python: every nn.Module call and every ATen op is dispatched from the interpreter, and the
matrix products themselves are a minority of the time. A traced, frozen graph runs the same ATen
ops in the same order from C++ (`torch.jit.freeze` inlines the weights as constants), so its
scores equal eager's while the dispatch cost goes: on the A/B benchmark's small DeepFM, 241 ->
116 us at 16 rows, bit-identical outputs; on the int8 benchmark's DeepFM, see
benchmarks/RESULTS.md ("int8 compression").

Trace, not script: the registered models (models/zoo.py, models/quantized.py) have no
data-dependent control flow at inference, only branches on their configuration, which a trace
records once. What a trace cannot see, a check has to: `for_serving` runs the traced graph and
the eager model on synthetic batches of several sizes (one row, odd sizes, empty and long bags,
IDs across each table) and keeps the graph only if every logit agrees within TOLERANCE;
otherwise, or if tracing fails, it serves the eager model and says why (`ServingForward.mode`).
Offline evaluation (evaluate.py) runs the eager model: the check at load is what keeps a served
score equal to the offline prediction for the same row. Exactly so for fp32 models: an int8
model quantizes its activations per batch (models/quantized.py), so its score of a row moves a
little with the rows it is batched with (up to about 4e-3 in logit measured), and a served int8
score equals the offline one within the int8 tolerance (README, "Compression"), not TOLERANCE.

torch 2.13 marks torch.jit deprecated in favour of torch.compile, which would compile per batch
shape inside the replica (and needs a C++ toolchain there); the trace still runs, and the day it
no longer does, every model is served eager by the fallback above.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ._inputs import InputShape

log = logging.getLogger(__name__)
TOLERANCE = 1e-6  # largest |traced - eager| logit on the same batch; probabilities then differ by at most a quarter of it
CHECK_SIZES = (1, 2, 7, 33)  # rows per synthetic check batch; the trace itself uses 5


@dataclass
class ServingForward:
    """`fn(dense, sparse, bag_values, bag_offsets)` -> logits, and how it runs: "torchscript" or
    "eager: <reason>"."""

    fn: Callable
    mode: str

    def __call__(self, dense, sparse, bag_values, bag_offsets):
        return self.fn(dense, sparse, bag_values, bag_offsets)


class _Flat(nn.Module):
    """The model with its bags as flat tensor arguments: a trace takes tensors, and an empty
    list (a model without bags) has no type to trace."""

    def __init__(self, model: nn.Module, bags: int):
        super().__init__()
        self.model, self.bags = model, bags

    def forward(self, dense, sparse, *bags):
        return self.model(dense, sparse, list(bags[:self.bags]), list(bags[self.bags:]))


def synthetic_inputs(shape: InputShape, rows: int, seed: int = 0, empty_bags: bool = False) -> tuple:
    """A batch shaped as train.batch.collate makes it: dense [rows, shape.dense] float32, IDs
    [rows, len(shape.sparse)] int64 (each column within its table), and per bag column flat
    int64 values with int64 offsets (bag lengths 0-4, or all 0 with `empty_bags`)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, shape.dense, generator=g)
    ids = (torch.stack([torch.randint(0, n, (rows,), generator=g) for n in shape.sparse], 1) if shape.sparse
           else torch.zeros(rows, 0, dtype=torch.int64))
    values, offsets = [], []
    for n in shape.bags:
        lengths = torch.zeros(rows, dtype=torch.int64) if empty_bags else torch.randint(0, 5, (rows,), generator=g)
        offsets.append(torch.cumsum(lengths, 0) - lengths)
        values.append(torch.randint(0, n, (int(lengths.sum()),), generator=g))
    return x, ids, values, offsets


def for_serving(model: nn.Module, shape: InputShape, enabled: bool = True) -> ServingForward:
    """The forward a scorer should call (`shape`: the model's inputs, InputShape.from_features):
    the frozen trace when it matches eager on every check batch, else the eager model (eval
    mode, no autograd either way)."""
    model = model.eval()

    def eager(d, s, v, o):
        with torch.inference_mode():
            return model(d, s, v, o)

    if not enabled:
        return ServingForward(eager, "eager: torchscript off")
    try:
        flat = _Flat(model, len(shape.bags)).eval()
        example = synthetic_inputs(shape, 5, seed=1)
        with torch.no_grad(), warnings.catch_warnings():
            # TracerWarning: branches on the configuration (recorded once, as intended); DeprecationWarning:
            # torch.jit is deprecated in favour of torch.compile (see the module docstring)
            warnings.simplefilter("ignore")
            # optimize_numerics=False: folding batch norm into the linear layer before it changed the
            # rounding (1 ulp: a regression model's large outputs failed the check at random)
            graph = torch.jit.freeze(torch.jit.trace(flat, _flatten(example), check_trace=False), optimize_numerics=False)
    except Exception as exc:  # noqa: BLE001 - any failure to trace means: serve eager
        log.warning("serving the eager model: tracing failed (%s: %s)", type(exc).__name__, exc)
        return ServingForward(eager, f"eager: tracing failed ({type(exc).__name__})")
    checks = [synthetic_inputs(shape, n, seed=10 + n) for n in CHECK_SIZES]
    if shape.bags:
        checks.append(synthetic_inputs(shape, 3, seed=99, empty_bags=True))
    worst = 0.0
    try:
        with torch.no_grad():
            for batch in checks:
                gap = float((graph(*_flatten(batch)) - model(*batch)).abs().max())
                if math.isnan(gap):  # kept as is: max(0.0, nan) is 0.0, and a NaN trace was served
                    worst = gap
                    break
                worst = max(worst, gap)
    except Exception as exc:  # noqa: BLE001 - e.g. a size the trace recorded as a constant
        log.warning("serving the eager model: the traced graph fails on a check batch (%s: %s)", type(exc).__name__, exc)
        return ServingForward(eager, f"eager: trace fails on a check batch ({type(exc).__name__})")
    if not worst <= TOLERANCE:  # also catches NaN
        log.warning("serving the eager model: the traced graph differs from it by %.3g (> %g)", worst, TOLERANCE)
        return ServingForward(eager, f"eager: trace differs by {worst:.3g}")

    def traced(d, s, v, o):
        with torch.no_grad():
            return graph(d, s, *v, *o)

    return ServingForward(traced, "torchscript")


def _flatten(batch: tuple) -> tuple:
    dense, sparse, values, offsets = batch
    return (dense, sparse, *values, *offsets)
