"""How close can any learner come to synthetic-ctr's Bayes AUC with N training rows?

    .venv/bin/python benchmarks/synthetic_ceiling.py --train-rows 1600000 8000000

The Bayes AUC (what `rayload data synth` prints) scores rows with the true click probability,
which knows every categorical ID's planted effect, also for IDs seen a handful of times. A learner
only sees its training rows. This script scores the same held-out rows with oracles that know the
generator's functional form and every numeric weight, and estimate each categorical ID's effect
from its training count n alone, as the Gaussian posterior mean (prior N(0, s^2), n rows of
Fisher information p(1 - p) each, estimation noise included); interactions are known exactly
where both IDs were seen at least 10 times (generous), and in a second, less generous line each
interaction's per-ID factors are shrunk the same way as the main effects (each as if its partner's
factors were known, so still an upper bound). No learner can expect to beat the
shrunk oracle by much, so it is the finite-data ceiling for a job with that many training rows.
It also shows what a choice of features costs inside that oracle (median imputation of missing
counts instead of the generator's zero; interactions left out). Numpy only: no training.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "platform"))

from rayload.data import synthetic as S  # noqa: E402

INFO = 0.19  # p(1 - p) at the generator's 25% positive rate


def _shrunk_factor(true: np.ndarray, n: np.ndarray, info_per_row: float, rng) -> np.ndarray:
    """Posterior means of standard-normal per-ID effects or factors (an ID never seen: 0) seen n
    times, each row worth INFO x `info_per_row` of Fisher information, estimation noise drawn."""
    info = n * INFO * info_per_row
    noise = rng.normal(0.0, 1.0, len(true)) / np.sqrt(np.maximum(info, 1e-12))
    return np.where(n > 0, info / (info + 1.0) * (true + noise), 0.0)


def ceiling(train_rows: int, test_rows: int, seed: int) -> dict[str, float]:
    params = S.SynthParams(rows=train_rows + test_rows, seed=seed)
    model = S._model(params)
    counts = [np.zeros(c + 1, dtype=np.int64) for c in model.cards]
    chunks = -(-(train_rows + test_rows) // S.CHUNK_ROWS)
    test = []
    for chunk in range(chunks):
        n = min(S.CHUNK_ROWS, train_rows + test_rows - chunk * S.CHUNK_ROWS)
        d = S._draw(params, model, np.random.SeedSequence([params.seed, chunk]), n)
        # the chunk's first rows up to train_rows train, the rest are test rows (whole chunks were
        # counted as test from the one holding the boundary: 1,572,864 training rows for 1,600,000)
        cut = min(n, max(0, train_rows - chunk * S.CHUNK_ROWS))
        for j, ranks in enumerate(d["ranks"]):  # training rows: only how often each ID was seen
            counts[j] += np.bincount(ranks[:cut], minlength=len(counts[j]))
        if cut < n:
            test.append({k: np.asarray(v)[..., cut:] for k, v in d.items()})
    d = {k: np.concatenate([t[k] for t in test], axis=-1) for k in test[0]}
    p = S._sigmoid(S._logit(model, d))
    rng = np.random.default_rng(seed + 1)
    shrunk, exact = np.zeros(len(p)), np.zeros(len(p))
    for j, (sigma, key, card, ranks) in enumerate(zip(model.cat_sigma, model.cat_keys, model.cards, d["ranks"])):
        scale = model.scales[1] * sigma
        unit, n = S._id_table(S._hash_normal, key, card), counts[j]
        shrunk += scale * _shrunk_factor(unit, n, scale**2, rng)[ranks]
        exact += np.where(n > 0, unit * scale, 0.0)[ranks]
    logs = S._logs(d)
    medians = np.array([np.median(np.log1p(x[v])) for x, v in zip(d["nums"], d["num_valid"])])[:, None]
    num = model.scales[0] * sum(w * lg for w, lg in zip(model.num_w, logs))
    num_median = model.scales[0] * sum(w * lg for w, lg in zip(model.num_w, np.where(d["num_valid"], logs, medians)))
    inter, inter_shrunk = np.zeros(len(p)), np.zeros(len(p))
    for (kind, a, b, gamma, key), (fa, fb) in zip(model.pairs, S._pair_factors(model, d, logs)):
        known = counts[a][d["ranks"][a]] >= 10
        if kind == "cc":
            known &= counts[b][d["ranks"][b]] >= 10
        inter += model.scales[2] * np.where(known, gamma * fa * fb, 0.0)
        # Each per-ID factor estimated like a main effect, as if its partner's factors were known:
        # a row carries Fisher information INFO * (scale * gamma * partner)^2 about it, partner
        # factors have mean square 1 (a numeric partner: its mean square log1p count).
        partner_sq = 1.0 if kind == "cc" else float(np.mean(logs[b] ** 2))
        fa_hat = _shrunk_factor(S._id_table(S._hash_normal, key, model.cards[a]), counts[a], (model.scales[2] * gamma) ** 2 * partner_sq, rng)
        if kind == "cc":
            fb_hat = _shrunk_factor(S._id_table(S._hash_normal, key ^ 1, model.cards[b]), counts[b], (model.scales[2] * gamma) ** 2, rng)
            inter_shrunk += model.scales[2] * gamma * fa_hat[d["ranks"][a]] * fb_hat[d["ranks"][b]]
        else:
            inter_shrunk += model.scales[2] * gamma * fa_hat[d["ranks"][a]] * fb
    scores = {"Bayes (true probability)": np.log(p / (1 - p)), "oracle: exact effects of every ID seen in training": num + exact + inter,
              "oracle: shrunk effects (the finite-data ceiling)": num + shrunk + inter,
              "  ... with the interactions' factors shrunk too": num + shrunk + inter_shrunk,
              "  ... with missing counts imputed by the median": num_median + shrunk + inter,
              "  ... without the interactions": num + shrunk}
    return {name: S.weighted_auc(s, p, 1 - p) for name, s in scores.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-rows", type=int, nargs="+", default=[1_600_000, 8_000_000])
    ap.add_argument("--test-rows", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for rows in args.train_rows:
        aucs = ceiling(rows, args.test_rows, args.seed)
        bayes = aucs["Bayes (true probability)"]
        print(f"synthetic-ctr seed {args.seed}, {rows:,} training rows, {args.test_rows:,} held-out rows:")
        for name, auc in aucs.items():
            print(f"  {name:<52} AUC {auc:.4f}  (Bayes - {bayes - auc:.4f})")


if __name__ == "__main__":
    main()
