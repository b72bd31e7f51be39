"""Which parts of synthetic-ctr's planted click model has a trained model learned?

    .venv/bin/python benchmarks/synthetic_parts.py CHECKPOINT [--rows 131072]

The generator's true logit is a sum of parts: the numeric counts (log1p, weighted), each
categorical ID's own effect, and four planted interactions (three categorical x categorical
products of per-ID factors, one categorical x numeric). This script draws fresh rows of the
checkpoint's data set (chunks past the job's own rows, so none was trained on), scores them with
the checkpoint (features.json transform, as serving does), and prints:

- the model's AUC against the true probability (weighted, without label noise) and the Bayes AUC;
- the least-squares fit of the model's logit on the true parts: a coefficient near 1 means the
  part is learned at full strength, near 0 that the model does not see it at all;
- what each part is worth: the Bayes AUC with that part taken out of the true logit.

Numpy and torch only; no Ray. Reads the data parameters from the checkpoint's manifest.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "platform"))


def true_parts(params, start_chunk: int, chunks: int):
    """Fresh rows as an Arrow table, their true probability and the scaled logit parts."""
    import pyarrow as pa

    from rayload.data import synthetic as S

    model = S._model(params)
    names = ["numeric", "categorical"] + [f"{kind} C{a + 1} x {'C' if kind == 'cc' else 'I'}{b + 1}" for kind, a, b, _, _ in model.pairs]
    parts, tables, probs = {n: [] for n in names}, [], []
    for chunk in range(start_chunk, start_chunk + chunks):
        d = S._draw(params, model, np.random.SeedSequence([params.seed, chunk]), S.CHUNK_ROWS)
        num, cat, _ = S._raw_scores(model, d)
        parts["numeric"].append(model.scales[0] * num)
        parts["categorical"].append(model.scales[1] * cat)
        for name, (_, _, _, gamma, _), (fa, fb) in zip(names[2:], model.pairs, S._pair_factors(model, d, S._logs(d))):
            parts[name].append(model.scales[2] * gamma * fa * fb)
        probs.append(S._sigmoid(S._logit(model, d)))
        tables.append(S._to_table(params, model, d, probs[-1]))
    return pa.concat_tables(tables), np.concatenate(probs), {n: np.concatenate(v) for n, v in parts.items()}


def model_logits(checkpoint: str, table) -> np.ndarray:
    import torch

    from rayload.train import checkpoint as ckpt
    from rayload.train.batch import Layout, collate

    loaded = ckpt.load(checkpoint)
    transformed, layout, out = loaded.features.transform_table(table), Layout.from_features(loaded.features), []
    with torch.no_grad():
        for i in range(0, transformed.num_rows, 8192):
            out.append(loaded.model(*collate(transformed.slice(i, 8192), layout).inputs()).float().numpy())
    return np.concatenate(out).astype(np.float64)


def main() -> None:
    from rayload.data import synthetic as S
    from rayload.data.builtin import _synth_params
    from rayload.spec import JobSpec

    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--rows", type=int, default=2 * 65_536, help="fresh rows to score (whole chunks of 65,536)")
    args = ap.parse_args()
    with open(os.path.join(args.checkpoint, "manifest.json")) as f:
        spec = JobSpec.model_validate(json.load(f)["spec"])
    if spec.data.source.kind != "synthetic-ctr":
        sys.exit(f"{args.checkpoint} was trained on {spec.data.source.kind!r}, not synthetic-ctr")
    params = _synth_params(spec.data.source)
    first = -(-params.rows // S.CHUNK_ROWS) + 1  # past every chunk the job drew its rows from
    table, p, parts = true_parts(params, first, max(1, args.rows // S.CHUNK_ROWS))
    z = model_logits(args.checkpoint, table)
    truth = np.log(p / (1 - p))
    bayes = S.weighted_auc(truth, p, 1 - p)
    print(f"{args.checkpoint}: {len(z):,} fresh rows (chunks from {first}) of synthetic-ctr seed {params.seed}, {params.rows:,} rows")
    print(f"  model AUC against the true probability {S.weighted_auc(z, p, 1 - p):.4f}; Bayes {bayes:.4f}")
    names = list(parts)
    design = np.column_stack([parts[n] for n in names] + [np.ones_like(z)])
    coef, *_ = np.linalg.lstsq(design, z, rcond=None)
    resid = z - design @ coef
    print(f"  model logit = sum of coefficient x true part + {coef[-1]:.3f} + residual (sd {resid.std():.3f}; "
          f"model logit sd {z.std():.3f}, true logit sd {truth.std():.3f})")
    print(f"  {'part':<22} {'coefficient':>11} {'part sd':>8} {'Bayes AUC without it':>21}")
    for name, c in zip(names, coef):
        print(f"  {name:<22} {c:>11.3f} {parts[name].std():>8.3f} {S.weighted_auc(truth - parts[name], p, 1 - p):>21.4f}")


if __name__ == "__main__":
    main()
