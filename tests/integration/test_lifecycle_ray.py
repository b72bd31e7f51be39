"""The lifecycle on one local Ray: compression behind its gate, a compressed model served
against its original over real HTTP, drift statistics merged over two replicas, and the loop
of continuous training: the world drifts, the champion's CTR falls, a model retrained from the
logged events wins the next A/B experiment."""

import json
import os
import time

import httpx
import numpy as np
import pytest
import torch

from rayload.ab_spec import ab_from_dict, load_ab_spec
from rayload.compression import GateRefused, compress
from rayload.data.builtin import _synth_params
from rayload.errors import RayloadError
from rayload.serve import control
from rayload.serve.simulate import SyntheticWorld, simulate
from rayload.serve.world import POOL_ROWS
from rayload.spec import JobSpec
from rayload.train import checkpoint as ckpt

pytestmark = pytest.mark.integration
PORT = 8767
URL = f"http://127.0.0.1:{PORT}"
SOURCE = {"kind": "synthetic-ctr", "rows": 30000, "numeric": 3, "categorical": 3, "cardinalities": [20, 60, 200], "seed": 0}


def job(**train) -> JobSpec:
    return JobSpec.model_validate({"name": "life", "data": {"source": SOURCE},
                                   "model": {"name": "deepfm", "embedding_dim": 8, "hidden": [32]},
                                   "train": {"epochs": 2, "batch_size": 512, "lr": 0.01, "run_name": "life-champion", **train}})


@pytest.fixture(scope="module")
def champion(ray_local, tmp_path_factory):
    from rayload.train.trainer import fit

    folder = tmp_path_factory.mktemp("life")
    old = os.environ.get("RAYLOAD_HOME")
    os.environ["RAYLOAD_HOME"] = str(folder / "runs")
    result = fit(job(), evaluate_test=False)
    yield {"checkpoint": result.checkpoint, "pre": result.preprocessed, "folder": folder}
    from ray import serve

    serve.shutdown()
    if old is None:
        os.environ.pop("RAYLOAD_HOME", None)
    else:
        os.environ["RAYLOAD_HOME"] = old


def _scores(checkpoint: str, pre) -> np.ndarray:
    from rayload.evaluate import predict
    from rayload.train.batch import Layout

    loaded = ckpt.load(checkpoint)
    return predict(loaded.model, pre.dataset("val"), Layout.from_features(loaded.features), batch_size=256)[1]


def test_int8_scores_stay_within_tolerance_of_fp32_and_the_checkpoint_is_smaller(champion):
    result = compress(champion["checkpoint"], "int8")
    assert result.passed and os.path.isdir(result.checkpoint) and result.auc_drop <= 0.002
    # The stated tolerance (README): on batches of 256 rows, |p_int8 - p_fp32| is below 0.01 on
    # average and below 0.03 for 99% of rows; activations are quantized per batch, so a larger
    # batch with wider extremes is coarser.
    diff = np.abs(_scores(result.checkpoint, champion["pre"]) - _scores(champion["checkpoint"], champion["pre"]))
    assert diff.mean() < 0.01 and np.quantile(diff, 0.99) < 0.03, (diff.mean(), np.quantile(diff, [0.5, 0.9, 0.99, 1.0]))
    weights = torch.load(os.path.join(result.checkpoint, "model.pt"), weights_only=True)  # plain tensors only
    assert any(v.dtype == torch.int8 for v in weights.values())
    assert result.bytes_after < result.bytes_before  # a tiny model: per-tensor file overhead dominates (ratio: bench_compress.py)
    assert not os.path.exists(os.path.join(result.checkpoint, "train_state.pt"))
    with pytest.raises(RayloadError, match="already compressed"):
        compress(result.checkpoint, "int8")


def test_the_gate_refuses_an_over_pruned_model_and_writes_nothing(champion):
    target = str(champion["folder"] / "overpruned")
    with pytest.raises(GateRefused) as refused:
        compress(champion["checkpoint"], "prune", amount=0.99, out=target)
    r = refused.value.result
    assert r.auc_drop > 0.002 and f"{r.auc_before:.5f}" in str(refused.value) and f"{r.auc_after:.5f}" in str(refused.value)
    assert not os.path.exists(target)


def test_a_compressed_model_scoring_nan_is_refused_naming_it(champion, monkeypatch):
    """A fine-tune that diverged (NaN weights) failed with a bare ValueError from auc()."""
    import torch

    from rayload import pruning
    from rayload.errors import DataError

    def diverged(model, *args, **kwargs):
        with torch.no_grad():
            next(p for p in model.parameters() if p.dim() == 2).fill_(float("nan"))

    monkeypatch.setattr(pruning, "finetune", diverged)
    target = str(champion["folder"] / "diverged")
    with pytest.raises(DataError, match=r"the prune model scored \d+ of the \d+ validation rows NaN or infinite.*fewer --finetune-epochs"):
        compress(champion["checkpoint"], "prune", amount=0.1, finetune_epochs=1, out=target)
    assert not os.path.exists(target)


def test_pruning_with_fine_tune_keeps_the_cut_weights_at_zero(champion):
    result = compress(champion["checkpoint"], "prune", amount=0.4, finetune_epochs=1, max_auc_drop=0.05)
    assert result.settings["sparsity"] >= 0.39
    from rayload.pruning import sparsity

    assert sparsity(ckpt.load(result.checkpoint).model) == pytest.approx(result.settings["sparsity"])


def _traffic(n: int, start: int, shift: str | None = None) -> list[dict]:
    from rayload.data.synthetic import generate_table

    params = _synth_params(job().data.source)
    import dataclasses

    rows = generate_table(dataclasses.replace(params, rows=start + n), start, start + n).drop(["label"]).to_pylist()
    if shift:
        for r in rows:
            r[shift] = None if r[shift] is None else r[shift] * 40 + 1000
    return rows


def test_compressed_model_serves_against_its_original_with_drift_merged_over_replicas(champion):
    int8 = compress(champion["checkpoint"], "int8").checkpoint
    spec = ab_from_dict({"name": "life-int8", "arms": [{"name": "fp32", "weight": 0.5, "checkpoint": champion["checkpoint"]},
                                                     {"name": "int8", "weight": 0.5, "checkpoint": int8}],
                         "serving": {"port": PORT, "replicas": 2}, "ramp": {"auto": False},
                         "drift": {"flush_s": 0.3, "min_rows": 300}})
    dep = control.start(spec)
    try:
        with httpx.Client(timeout=30) as client:
            answers = _post_all(client, "u", _traffic(600, 40_000))
            assert {a.json()["arm"] for a in answers} == {"fp32", "int8"}
            drift = _wait_drift(client, lambda d: sum(x["rows"] for x in d if x["feature"] == "I1") == 600)
        assert {d["arm"] for d in drift} == {"fp32", "int8"} and not any(d["flagged"] for d in drift), drift
        assert max(d["replicas"] for d in drift) == 2  # both replicas' counts are in the sums
        with httpx.Client(timeout=30) as client:
            assert all(a.status_code == 200 for a in _post_all(client, "s", _traffic(800, 50_000, shift="I1")))
            drift = _wait_drift(client, lambda d: sum(x["rows"] for x in d if x["feature"] == "I1") == 1400)
        flagged = {(d["arm"], d["feature"]) for d in drift if d["flagged"]}
        assert flagged == {("fp32", "I1"), ("int8", "I1")}, drift
        status = control.analysis_for(dep.run_dir)  # what `rayload ab status` prints, from the store
        assert {(d["arm"], d["feature"]) for d in status.drift if d["flagged"]} == flagged
        from rayload.serve.report import render

        assert 'id="drift"' in render(status) and "DRIFT" in render(status)
        metrics = _prometheus(lambda text: len(_i1_psi(text)) >= 2 and all(v > 0.2 for v in _i1_psi(text))
                              and set(_i1_psi(text, "drift_judged")) == {1.0})
        assert len(_i1_psi(metrics)) >= 2 and all(v > 0.2 for v in _i1_psi(metrics)), metrics[-2000:]  # both arms
        assert set(_i1_psi(metrics, "drift_judged")) == {1.0}, metrics[-2000:]  # each PSI rests on enough rows
        # the categoricals' out-of-vocabulary rates, exported in the same tick as the PSI
        oov = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("ray_rayload_feature_oov_rate{")]
        assert oov and all(0.0 <= v <= 1.0 for v in oov), metrics[-2000:]
    finally:
        control.stop(dep.run_dir)


def _i1_psi(text: str, gauge: str = "psi") -> list[float]:
    """The exported values of feature I1's `gauge` (PSI by default; one series per arm and replica)."""
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(f"ray_rayload_feature_{gauge}{{") and 'feature="I1"' in line]


def _prometheus(done, timeout: float = 45.0) -> str:
    """The text Ray's metrics agent serves to Prometheus, once `done(text)` (replicas report
    their metrics every few seconds)."""
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port
    deadline, text = time.time() + timeout, ""
    while time.time() < deadline:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        if done(text):
            break
        time.sleep(1)
    return text


def _post_all(client, prefix: str, rows: list[dict]) -> list:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda ir: client.post(f"{URL}/predict", json={"unit_id": f"{prefix}{ir[0]}", "features": ir[1]}),
                             enumerate(rows)))


def _wait_drift(client, done, timeout: float = 30.0) -> list[dict]:
    deadline = time.time() + timeout
    while True:
        drift = client.get(f"{URL}/experiment").json()["drift"]
        if done(drift) or time.time() > deadline:
            return drift
        time.sleep(0.3)


def test_after_the_world_drifts_a_model_retrained_from_the_logged_events_wins_the_next_experiment(champion):
    from rayload.retraining import retrain

    params = _synth_params(job().data.source)
    int8 = compress(champion["checkpoint"], "int8").checkpoint
    spec = ab_from_dict({"name": "life-drift", "champion": "champion",
                         "arms": [{"name": "champion", "weight": 0.5, "checkpoint": champion["checkpoint"]},
                                  {"name": "int8", "weight": 0.5, "checkpoint": int8}],
                         "serving": {"port": PORT}, "ramp": {"auto": False}, "analysis": {"min_units": 300, "tau": 0.05},
                         # the decision under test is the sequential test's; p99 on 2 shared cores is not
                         "guardrails": {"max_p99_ms": 5000}})
    dep = control.start(spec)
    try:
        before = simulate(URL, SyntheticWorld(params, seed=1), users=5000, requests=300)
        drifted_at = time.time()
        after = simulate(URL, SyntheticWorld(params, seed=2, drift_seed=7), users=5000, requests=1500)
        assert before.ok == 300 and after.ok == 1500
        ctr_before, ctr_after = before.clicks / before.ok, after.clicks / after.ok
        assert ctr_after < ctr_before - 0.1, (ctr_before, ctr_after)  # the champion's CTR falls with the world
        time.sleep(1.1)  # every exposure is older than the attribution window: all labels are known
        now = time.time()  # retrain's own clock given: the window then ends where it was measured
        window = f"{now - drifted_at + 0.05:.3f}s"  # the events since the drift (a sliding window)
        # ~1,050 training rows: batches of 64 give the fine-tune ~70 steps (batches of 512 gave 12, too
        # few to move the warm-started model off the champion, and the gate then compared two near-equal AUCs)
        result = retrain(job(epochs=4, batch_size=64), dep.run_dir, window=window, attribution="1s", challenger_weight=0.5,
                         name="life-next", now=now)
    finally:
        control.stop(dep.run_dir)
    assert 1500 <= result.rows < 1560  # the drifted exposures, hardly any from before
    assert result.passed and result.auc_new > result.auc_champion, (result.auc_new, result.auc_champion, result.gain_ci)
    # The gate refuses a model that does not gain enough: both AUCs reported, no next experiment written.
    refused = retrain(job(epochs=1), dep.run_dir, window="all", attribution="1s", min_auc_gain=1.0, name="life-refused")
    assert not refused.passed and refused.ab_spec is None and 0 < refused.auc_champion < 1 and 0 < refused.auc_new < 1
    assert not os.path.exists(os.path.join(refused.run_dir, "ab.yaml")) and refused.run_dir != result.run_dir
    assert json.load(open(os.path.join(refused.run_dir, "retrain.json")))["passed"] is False
    nxt = load_ab_spec(result.ab_spec)
    assert [(a.name, a.weight) for a in nxt.arms] == [("champion", 0.5), ("retrained", 0.5)]
    assert nxt.guardrails.max_p99_ms == 5000  # the next experiment keeps the old one's settings
    assert nxt.arms[0].checkpoint == os.path.abspath(champion["checkpoint"]) and nxt.arms[1].checkpoint == result.checkpoint
    dep2 = control.start(nxt)
    try:
        # Fresh rows of the drifted world, apart from the pool whose exposures the retrained arm
        # learned from, as world_for takes another pool for a retrained arm (serve/world.py)
        world = SyntheticWorld(params, seed=3, drift_seed=7, start=params.rows + POOL_ROWS)
        for look in range(12):  # the sequential p-value stays valid however often it is looked at
            simulate(URL, world, users=5000, requests=300, seed=look)
            analysis = control.analysis_for(dep2.run_dir)
            if analysis.decision != "continue":
                break
    finally:
        control.stop(dep2.run_dir)
    arms = {a.arm: a for a in analysis.arms}
    assert arms["retrained"].ctr > arms["champion"].ctr and analysis.diff_ci[0] > 0, analysis.to_dict()
    assert analysis.decision == "promote", analysis.reasons
