"""The automatic A/B controller's test helpers (no Ray): a two-arm spec, one exposure per unit
split by the router's own layout, and a run folder as `control.start` leaves it."""

import json

import numpy as np
import pandas as pd

from rayload.ab_spec import ab_from_dict
from rayload.serve import control
from rayload.serve.assign import Layout
from rayload.serve.serve_config import serve_config


def spec_of(a: float = 0.95, shadow: bool = False, **extra):
    return ab_from_dict({"name": "t", "shadow": shadow, "arms": [{"name": "A", "weight": a, "checkpoint": "/x"},
                                                                 {"name": "B", "weight": round(1 - a, 4), "checkpoint": "/y"}],
                         "drift": {"enabled": False}, "analysis": {"min_units": 200}, **extra})


def events(units: int, rates: dict, weights: dict, seed: int = 0, start: int = 0) -> pd.DataFrame:
    """One exposure per unit, split by the router's own layout."""
    rng = np.random.default_rng(seed)
    layout = Layout.build(weights, "A", ["A", "B"])
    ids = [f"u{i}" for i in range(start, start + units)]
    arms = [layout.assign("t", u) for u in ids]
    return pd.DataFrame({"request_id": [f"r{u}" for u in ids], "unit_id": ids, "arm": arms, "model_version": "v", "score": 0.5,
                         "status": "ok", "latency_ms": 5.0, "layout": json.dumps(weights, sort_keys=True),
                         "ts": np.arange(start, start + units, dtype=float), "outcome": [float(rng.random() < rates[a]) for a in arms]})


def control_run(tmp_path, monkeypatch):
    """make(spec, frame) -> a run folder as `control.start` leaves it, whose events are `frame`;
    deploying records the configs instead (in make.box["deployed"]). The body of the `run`
    fixture of the files that use it."""
    def make(spec, frame):
        args = {"experiment": spec.name, "arms": ["A", "B"], "serving": spec.serving.model_dump(), "weights": spec.weights,
                "champion": "A", "shadow": spec.shadow, "spec": spec.model_dump(mode="json"), "events_url": "sqlite:///unused",
                "checkpoints": {}}
        control.save_state(str(tmp_path), {"config": serve_config(args), "address": None, "decisions": []})
        box["frame"] = frame
        return str(tmp_path)

    box = {"deployed": []}
    monkeypatch.setattr(control, "_redeploy", lambda config, address: box["deployed"].append(control.parts(config)[1]))
    monkeypatch.setattr(control, "_events_frame", lambda args, spec: box["frame"])
    monkeypatch.setattr(control, "_shadow_summary", lambda args: {})
    make.box = box
    return make


def user(run_dir: str) -> dict:
    return control.parts(control.load_state(run_dir)[1]["config"])[1]
