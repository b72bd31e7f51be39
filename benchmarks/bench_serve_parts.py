"""Where the A/B router's extra cost per request goes (issue 5), measured in one process.

    .venv/bin/python benchmarks/bench_serve_parts.py [--rounds 6] [--seconds 3] [--clients 32]

`bench_serve.py` measures throughput over HTTP, where the machine's noise (the load generator,
Serve's proxy or ingress, every other process on 2 cores) moves one run's A/B / single ratio by
more than the distance to its target. This script drives the same two FastAPI apps as that
benchmark's `single` and `ab` sides through ASGI in this process (no network, no Ray
processes; Serve's @serve.batch runs on this event loop), with the same closed loop of N
concurrent clients, and prints the process CPU time per answered request of each side,
alternating the sides round by round. It then repeats the A/B side with one part taken away
at a time, each against the same single side in the same rounds:

- `no-store`: the exposures are built but the SQLite commit is skipped (not a valid
  configuration: it measures what the commit costs);
- `no-exposures`: neither built nor committed;
- `one-arm`: weights 1.0 / 0.0, so each batch makes one model call instead of two;
- `no-drift`: drift counting off in the A/B side only.

The differences are the CPU each part costs per request on the replica's event loop. What the
in-process figure leaves out (Serve's HTTP handling, the same for both sides) dilutes the
difference over HTTP. Models and rows as bench_serve.py: two small DeepFMs trained here.
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "platform"))


def _user_init(cls, name: str):
    """The user class's own __init__ under Serve's ingress wrapper (which needs a replica)."""
    return [b for b in cls.__mro__ if b.__name__ == name and "__init__" in b.__dict__][-1].__init__


def build_single(checkpoint: str):
    from ray import serve

    from bench_serve import single_app

    app, single = single_app()
    wrapped = serve.ingress(app)(single)
    inst = object.__new__(wrapped)
    _user_init(wrapped, "Single")(inst, checkpoint, True)
    return app, inst


def build_ab(checkpoints: dict[str, str], folder: str, variant: str):
    from rayload.ab_spec import ab_from_dict
    from rayload.serve import app as abapp
    from rayload.serve.serve_config import app_args

    spec = ab_from_dict({"name": f"ab-{variant}", "arms": [{"name": a, "weight": 0.5, "checkpoint": p} for a, p in checkpoints.items()],
                         "serving": {"mode": "combined"}, "events": {"url": f"sqlite:///{folder}/{variant}.db"}})
    args = app_args(spec, checkpoints, folder)
    inst = object.__new__(abapp.ABRouter.func_or_class)
    _user_init(abapp.ABRouter.func_or_class, "ABRouter")(inst, args)
    if variant == "no-store":
        inst.writer.write_now = lambda events: True
    elif variant == "no-exposures":
        async def passthrough(items, results):
            return results
        inst.models.log = passthrough
    elif variant == "one-arm":
        first = next(iter(checkpoints))
        inst.reconfigure({"weights": {a: float(a == first) for a in checkpoints}, "champion": first, "shadow": False})
    elif variant == "no-drift":
        inst.flusher.close()
        inst.flusher = None
        for scorer in inst.models.scorers.values():
            scorer.drift = None
    return abapp.api, inst


async def _post(app, body: bytes) -> None:
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/predict", "raw_path": b"/predict", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    sent, status = False, []

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(scope, receive, send)
    if status != [200]:
        raise RuntimeError(f"answer {status}")


async def _load(app, rows: list[dict], clients: int, seconds: float) -> float:
    """CPU microseconds of this process per answered request, over `seconds` of closed loop."""
    done = 0

    async def client(i, deadline):
        nonlocal done
        rng = random.Random(i)
        while time.perf_counter() < deadline:
            await _post(app, json.dumps({"unit_id": f"u{rng.randrange(100000)}", "features": rng.choice(rows)}).encode())
            done += 1

    warm = time.perf_counter() + 0.5
    await asyncio.gather(*[client(i, warm) for i in range(clients)])
    done, cpu0, start = 0, time.process_time(), time.perf_counter()
    await asyncio.gather(*[client(i, start + seconds) for i in range(clients)])
    return (time.process_time() - cpu0) / done * 1e6


async def run(args) -> None:
    from ray import serve

    from bench_serve import train_checkpoint

    folder = tempfile.mkdtemp(prefix="bench-serve-parts-")
    os.environ["RAYLOAD_HOME"] = os.path.join(folder, "runs")
    champion, challenger, rows = train_checkpoint(folder)
    replica = types.SimpleNamespace(servable_object=None, _deployment_config=types.SimpleNamespace(max_ongoing_requests=64))
    serve.get_replica_context = lambda: replica  # the ingress's `self` dependency and @serve.batch read it
    variants = ["full", "no-store", "no-exposures", "one-arm", "no-drift"]
    sides = {"single": build_single(champion)}
    sides.update({v: build_ab({"a": champion, "b": challenger}, folder, v) for v in variants})
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    for rnd in range(args.rounds):
        for name in (list(sides) if rnd % 2 == 0 else list(sides)[::-1]):
            app, replica.servable_object = sides[name]
            cpu[name].append(await _load(app, rows, args.clients, args.seconds))
        print(f"round {rnd}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in cpu.items()) + " us CPU/request", flush=True)
    med = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"\nmedian CPU per request over {args.rounds} rounds, {args.clients} clients, in-process ASGI:")
    print(f"  single deployment            {med['single']:7.1f} us")
    for v in variants:
        extra = med[v] - med["single"]
        saved = "" if v == "full" else f"   (part's cost: {med['full'] - med[v]:+.1f} us)"
        print(f"  A/B router, {v:16s} {med[v]:7.1f} us   A/B extra {extra:+.1f} us   single / A/B {med['single'] / med[v]:.3f}{saved}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--clients", type=int, default=32)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
