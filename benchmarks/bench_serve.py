"""Serving benchmark (issue 5): every figure is a ratio of two sides measured in this run.

    .venv/bin/python benchmarks/bench_serve.py [--seconds 8] [--rounds 2] [--clients 32] [--ingress proxy|direct]
        [--client httpx|aiohttp]

Sides serve a small DeepFM (trained here on 6,000 MovieLens ratings, one epoch; the A/B sides
split traffic 50/50 between it and a second one trained with another model seed on the same
prepared data) to the same closed-loop load (N async HTTP clients in a separate process,
each sending one request after another; rows drawn from the data):

- plain:      a uvicorn + FastAPI app in its own process calling the same Scorer (no Ray);
- single:     one Ray Serve deployment (FastAPI ingress) with the Scorer and @serve.batch;
- ab:         rayload's A/B router in combined mode (two arms, sticky hashing, exposure
              events group-committed to SQLite before the answer);
- ab_unbatched: the same router with max_batch_size 1.

Rounds alternate the sides (A B C D, then D C B A, ...) so drift on this shared machine hits all alike;
the ratios use the median over rounds. Split accuracy assigns 10,000 unit IDs.

`--ingress direct` runs the three Serve sides with Ray Serve's direct ingress (each ingress
replica answers HTTP on its own port, no proxy actor in the path; `serving.ingress: direct`),
`proxy` (the default) through Serve's HTTP proxy. Serve's mode is fixed when Ray starts, so one
run measures one mode; the load generator's CPU per answered request is printed for each side.
`--drift on` (the default) has every side count feature drift on the rows it scores, as a
rayload model deployment does by default (the A/B spec's `drift.enabled`); `off` on none;
`both` adds a second single side and a second A/B side without it, so both comparisons
alternate within the same rounds (the plain side counts drift).
`--client aiohttp` drives the same closed loop with aiohttp instead of httpx (less CPU per
request in the load generator, which shares the 2 cores with the servers).
"""


import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
PLAIN_PORT, SERVE_PORT = 8311, 8312


def train_checkpoint(folder: str) -> tuple[str, str, list[dict]]:
    """The champion and a challenger: the same small DeepFM trained with two model seeds on the
    same prepared data (so they share features.json, as a baseline and its tuned rival do)."""
    import pyarrow.parquet as pq

    from rayload.data.builtin import materialize
    from rayload.spec import JobSpec
    from rayload.train.trainer import fit

    src = materialize(JobSpec.model_validate({"name": "x", "data": {"source": {"kind": "movielens"}}}).data.source, folder)[0]
    table = pq.read_table(src).slice(0, 6000)
    pq.write_table(table, os.path.join(folder, "subset.parquet"))
    job = JobSpec.model_validate({
        "name": "bench-serve", "data": {"source": {"kind": "parquet", "path": os.path.join(folder, "subset.parquet")},
                                        "columns": [{"name": "userId", "role": "categorical"}, {"name": "movieId", "role": "categorical"},
                                                    {"name": "genres", "role": "multi_categorical"}, {"name": "year", "role": "numeric"}],
                                        "label": {"column": "rating", "threshold": 4.0}},
        "model": {"name": "deepfm", "embedding_dim": 8, "hidden": [64, 32]}, "train": {"epochs": 1, "batch_size": 256}})
    rows = [{k: r[k] for k in ("userId", "movieId", "genres", "year")} for r in table.slice(0, 500).to_pylist()]
    challenger = job.model_copy(update={"train": job.train.model_copy(update={"seed": 1})})
    return fit(job, evaluate_test=False).checkpoint, fit(challenger, evaluate_test=False).checkpoint, rows


PLAIN_APP = """
import sys, uvicorn
from fastapi import FastAPI
from rayload.serve.scorer import Scorer
scorer = Scorer.load("m", sys.argv[1], drift=sys.argv[3] == "on")
app = FastAPI()
@app.post("/predict")
def predict(body: dict):
    return {"score": float(scorer.score([body["features"]])[0]), "model_version": scorer.version}
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
"""


def single_app():
    """The single side: a FastAPI app and its user class, a Scorer behind @serve.batch (Serve
    ingress-wraps the class; bench_serve_parts.py drives the same app in-process)."""
    from fastapi import FastAPI, Request
    from ray import serve

    app = FastAPI()

    class Single:
        def __init__(self, path, drift):
            from rayload.serve.scorer import Scorer

            self.scorer = Scorer.load("m", path, drift)  # drift: count features as a rayload model deployment does

        @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.002)
        async def _score(self, rows: list[dict]) -> list[float]:
            return self.scorer.score(rows).tolist()

        @app.post("/predict")
        async def predict(self, request: Request):
            body = await request.json()
            return {"score": await self._score(body["features"]), "model_version": self.scorer.version}

    return app, Single


def deploy_single(checkpoint: str, ingress: str, drift: bool, name: str = "single") -> str:
    from ray import serve

    from rayload.ab_spec import Serving

    app, single = single_app()
    router = Serving()  # the A/B router's logging defaults: without them this side alone pays
    # Serve's per-request access log (~0.05 ms of replica CPU here)
    Single = serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": 0.5},
                              logging_config={"log_level": router.log_level, "enable_access_log": router.access_log})(
        serve.ingress(app)(single))
    serve.run(Single.bind(checkpoint, drift), name=name, route_prefix=f"/{name}")
    from rayload.serve.ingress import ingress_urls

    serving = {"host": "127.0.0.1", "port": SERVE_PORT, "route_prefix": f"/{name}", "ingress": ingress, "replicas": 1}
    return ingress_urls(serving, name)[0] + "/predict"


def deploy_ab(checkpoint: str, challenger: str, folder: str, name: str, batch: int, ingress: str, drift: bool,
              flush_ms: float | None = None) -> str:
    from rayload.ab_spec import ab_from_dict
    from rayload.serve import control

    spec = ab_from_dict({"name": name, "arms": [{"name": "a", "weight": 0.5, "checkpoint": checkpoint},
                                                {"name": "b", "weight": 0.5, "checkpoint": challenger}],
                         "serving": {"port": SERVE_PORT, "route_prefix": f"/{name}", "max_batch_size": batch, "mode": "combined",
                                     "ingress": ingress},
                         "events": {"url": f"sqlite:///{os.path.join(folder, name + '.db')}",
                                    **({} if flush_ms is None else {"flush_ms": flush_ms})},
                         "drift": {"enabled": drift}})
    return control.start(spec).url + "/predict"


LOAD = """
import asyncio, json, sys, time, random
import httpx
url, clients, seconds, rows = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), json.loads(open(sys.argv[4]).read())
lat, errors, first_error = [], 0, None
async def client(i, deadline):
    global errors, first_error
    rng = random.Random(i)
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=1)) as c:
        while time.perf_counter() < deadline:
            body = {"unit_id": f"u{rng.randrange(100000)}", "features": rng.choice(rows)}
            t = time.perf_counter()
            r = await c.post(url, json=body)
            if r.status_code == 200:
                lat.append((time.perf_counter() - t) * 1000)
            else:
                errors += 1
                first_error = first_error or f"{r.status_code} {r.text[:300]}"
async def main():
    warm = time.perf_counter() + 1.0
    await asyncio.gather(*[client(i, warm) for i in range(clients)])
    lat.clear()
    start, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*[client(i, start + seconds) for i in range(clients)])
    cpu = time.process_time() - cpu0
    print(json.dumps({"n": len(lat), "errors": errors, "seconds": time.perf_counter() - start, "lat": lat, "first_error": first_error,
                      "cpu": cpu}))
asyncio.run(main())
"""


# The same closed loop on aiohttp, whose client costs less CPU per request than httpx's: the load
# generator shares the 2 cores with the servers, so what it spends is taken from them.
LOAD_AIOHTTP = LOAD.replace("import httpx", "import aiohttp").replace(
    "    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=1)) as c:",
    "    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), timeout=aiohttp.ClientTimeout(total=30)) as c:",
).replace(
    """            r = await c.post(url, json=body)
            if r.status_code == 200:""",
    """            async with c.post(url, json=body) as r:
                text = await r.text()
            if r.status == 200:""",
).replace('first_error or f"{r.status_code} {r.text[:300]}"', 'first_error or f"{r.status} {text[:300]}"')
assert "httpx" not in LOAD_AIOHTTP


def measure(url: str, clients: int, seconds: float, rows_file: str, client: str = "httpx") -> dict:
    load = LOAD if client == "httpx" else LOAD_AIOHTTP
    out = subprocess.run([sys.executable, "-c", load, url, str(clients), str(seconds), rows_file], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)
    if not r["lat"]:
        raise RuntimeError(f"no request to {url} succeeded: {r['first_error']}")
    lat = np.array(r["lat"])
    return {"client_cpu_ms": r["cpu"] * 1000 / len(lat), "rps": r["n"] / r["seconds"], "p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)), "errors": r["errors"]}


def split_accuracy() -> list[tuple[float, float]]:
    from rayload.serve.assign import Layout

    out = []
    for w in (0.05, 0.25, 0.5):
        layout = Layout.build({"control": 1 - w, "challenger": w}, "control", ["control", "challenger"])
        share = sum(layout.assign("bench", f"unit-{i}") == "challenger" for i in range(10_000)) / 10_000
        out.append((w, share))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--ingress", choices=("proxy", "direct"), default="proxy")
    parser.add_argument("--client", choices=("httpx", "aiohttp"), default="httpx", help="the load generator's HTTP client")
    parser.add_argument("--drift", choices=("on", "off", "both"), default="on",
                        help="feature drift counting on every side (on: as a rayload model deployment does by default); "
                             "both: a single and an A/B side with it and another pair without, alternating in the same rounds")
    parser.add_argument("--flush-ms", type=float, default=None, help="the A/B sides' events.flush_ms (default: the spec's)")
    args = parser.parse_args()
    import ray

    folder = tempfile.mkdtemp(prefix="bench-serve-")
    os.environ["RAYLOAD_HOME"] = os.path.join(folder, "runs")
    from rayload._ray import ensure_ray
    from rayload.serve.ingress import direct_ingress_env

    # Replicas reserve 0.5 CPU each; `both` deploys five, so Ray is told of 4 logical CPUs (a
    # reservation, not a limit: every side still shares the machine's two cores, one at a time).
    ensure_ray(num_cpus=4 if args.drift == "both" else None, env=direct_ingress_env() if args.ingress == "direct" else None)
    checkpoint, challenger, rows = train_checkpoint(folder)
    rows_file = os.path.join(folder, "rows.json")
    with open(rows_file, "w") as f:
        json.dump(rows, f)
    plain = subprocess.Popen([sys.executable, "-c", PLAIN_APP, checkpoint, str(PLAIN_PORT), "off" if args.drift == "off" else "on"])
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
    drift = args.drift != "off"
    urls = {"plain": f"http://127.0.0.1:{PLAIN_PORT}/predict", "single": deploy_single(checkpoint, args.ingress, drift),
            "ab": deploy_ab(checkpoint, challenger, folder, "ab", 32, args.ingress, drift, args.flush_ms),
            "ab_unbatched": deploy_ab(checkpoint, challenger, folder, "ab_unbatched", 1, args.ingress, drift, args.flush_ms)}
    pairs = [("ab", "single")]
    if args.drift == "both":
        urls["single_nodrift"] = deploy_single(checkpoint, args.ingress, False, "single_nodrift")
        urls["ab_nodrift"] = deploy_ab(checkpoint, challenger, folder, "ab_nodrift", 32, args.ingress, False, args.flush_ms)
        pairs.append(("ab_nodrift", "single_nodrift"))
    print(f"{args.ingress} ingress: {json.dumps(urls)}", flush=True)
    time.sleep(3)
    results: dict[str, list[dict]] = {k: [] for k in urls}
    try:
        for rnd in range(args.rounds):
            # The sides run back to back; every other round in reverse order, so that no side
            # always runs right after the same other one (a side inherits the machine's state).
            for side, url in (list(urls.items()) if rnd % 2 == 0 else list(urls.items())[::-1]):
                results[side].append(measure(url, args.clients, args.seconds, rows_file, args.client))
                print(f"round {rnd} {side:13s} {json.dumps({k: round(v, 2) for k, v in results[side][-1].items()})}", flush=True)
    finally:
        plain.terminate()
    med = {side: {k: statistics.median(r[k] for r in rs) for k in ("rps", "p50", "p99", "errors", "client_cpu_ms")} for side, rs in results.items()}
    print(f"\n{args.clients} concurrent clients, {args.seconds:.0f} s per side per round, {args.rounds} rounds (medians), "
          f"Serve sides through {args.ingress} ingress, load generator on {args.client}, drift counting: {args.drift}")
    for side, m in med.items():
        print(f"  {side:13s} throughput {m['rps']:8.1f} req/s   p50 {m['p50']:7.2f} ms   p99 {m['p99']:7.2f} ms   "
              f"errors {m['errors']:.0f}   load generator CPU {m['client_cpu_ms']:.2f} ms/request")
    print(f"Serve single vs plain uvicorn: added p50 {med['single']['p50'] - med['plain']['p50']:+.2f} ms, "
          f"added p99 {med['single']['p99'] - med['plain']['p99']:+.2f} ms, throughput ratio {med['single']['rps'] / med['plain']['rps']:.2f}")
    for ab, single in pairs:
        print(f"{ab} / {single}: p99 {med[ab]['p99'] / med[single]['p99']:.2f}x (target <= 1.1), "
              f"throughput {med[ab]['rps'] / med[single]['rps']:.2f}x (target >= 0.9)")
        # The same ratio paired within each round (the sides of one round run back to back, so the
        # machine's drift between rounds cancels): per round and the median over rounds.
        paired = [(a["rps"] / b["rps"], a["p99"] / b["p99"]) for a, b in zip(results[ab], results[single])]
        print(f"{ab} / {single}, paired per round: throughput {', '.join(f'{t:.2f}' for t, _ in paired)} "
              f"(median {statistics.median(t for t, _ in paired):.2f}x), p99 {', '.join(f'{p:.2f}' for _, p in paired)} "
              f"(median {statistics.median(p for _, p in paired):.2f}x)")
    print(f"dynamic batching / unbatched (A/B router): throughput {med['ab']['rps'] / med['ab_unbatched']['rps']:.2f}x (target >= 3)")
    for w, share in split_accuracy():
        print(f"split accuracy at 10,000 units: configured {w:.2f}, observed {share:.4f}, |diff| {abs(share - w) * 100:.2f} points (target <= 1)")
    ray.shutdown()


if __name__ == "__main__":
    main()
