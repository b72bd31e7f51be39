"""A/B spec and control rules found in review: a fresh start under an experiment's name is a
new generation, analysed without its predecessor's events (a restart of the same experiment,
or a run saved before generations, keeps reading its own); a ramp step of 1 is refused (and one
saved before is not taken); names that the event store cannot keep are refused at load; a
model version fits its column; a unit ID is a string or an integer, not a boolean or a float."""

import json
import types

import pytest
from pydantic import ValidationError

from rayload.ab_spec import ABSpec, ab_from_dict
from rayload.errors import SpecError
from rayload.serve import control
from rayload.serve.event_writer import EventWriter
from rayload.serve.events import default_url
from rayload.serve.http_io import AssignBody, PredictBody
from rayload.serve.serve_config import serve_config

from _ab_control import events, spec_of, user


# ------------------------------------------------------------------ generations


@pytest.fixture
def started(tmp_path, monkeypatch):
    """start(checkpoints) -> control.start of spec_of(0.5) in one run folder whose store is real
    SQLite, with Ray, Serve and training replaced by stand-ins."""
    import ray

    import rayload._ray

    url = default_url(str(tmp_path))
    box = {}
    monkeypatch.setattr(rayload._ray, "ensure_ray", lambda *a, **k: None)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(gcs_address="127.0.0.1:1"))
    monkeypatch.setattr(control, "resolve_checkpoints", lambda spec, address=None: box["checkpoints"])
    monkeypatch.setattr(control, "app_args", lambda spec, checkpoints, run_dir: {
        "experiment": spec.name, "salt": spec.experiment_salt, "arms": ["A", "B"], "serving": spec.serving.model_dump(),
        "weights": spec.weights, "champion": "A", "shadow": False, "spec": spec.model_dump(mode="json"), "events_url": url,
        "checkpoints": checkpoints})
    monkeypatch.setattr(control, "deploy", lambda config: None)
    monkeypatch.setattr(control, "_redeploy", lambda config, address: None)
    monkeypatch.setattr(control, "ingress_urls", lambda serving, app, **k: ["http://127.0.0.1:8000"])
    monkeypatch.setattr(control, "check_direct_ingress", lambda serving: None)

    def start(checkpoints):
        box["checkpoints"] = checkpoints
        return control.start(spec_of(0.5), run_dir=str(tmp_path))

    start.url, start.run_dir = url, str(tmp_path)
    return start


def log_events(url: str, frame, generation) -> None:
    """The frame's exposures and clicks in the store, as the router writes them."""
    writer = EventWriter(url)
    for rec in frame.to_dict("records"):
        clicked = rec.pop("outcome")
        writer.submit("exposure", {**rec, "experiment": "t", "features": None, "generation": generation})
        if clicked:
            writer.submit("outcome", {"request_id": rec["request_id"], "event": "click", "value": 1.0, "ts": rec["ts"]})
    writer.close()


def generation_of(run_dir: str):
    return control.parts(control.load_state(run_dir)[1]["config"])[0].get("generation")


def test_a_fresh_start_under_the_name_is_not_decided_on_its_predecessors_events(started):
    dep = started({"A": "/x", "B": "/worse"})
    first = generation_of(dep.run_dir)
    assert first and dep.args["generation"] == first
    log_events(started.url, events(20_000, {"A": 0.13, "B": 0.10}, {"A": 0.5, "B": 0.5}), first)
    started({"A": "/x", "B": "/worse"})  # the same experiment again (a crash, a re-run): its generation, its events
    assert generation_of(dep.run_dir) == first
    assert control.analysis_for(dep.run_dir).arms[1].exposures > 0
    assert control.step(dep.run_dir)[0] == "rollback"
    started({"A": "/x", "B": "/new"})  # a new challenger under the name: a new generation
    second = generation_of(dep.run_dir)
    assert second != first
    result = control.analysis_for(dep.run_dir)
    assert [a.exposures for a in result.arms] == [0, 0] and not result.srm_flagged
    assert control.step(dep.run_dir)[0] == "continue"  # not rolled back on the old challenger's clicks
    assert len(control.events_of(dep.run_dir)) == 0


def test_a_run_saved_before_generations_keeps_reading_all_its_events(started):
    dep = started({"A": "/x", "B": "/y"})
    state = control.load_state(dep.run_dir)[1]
    del control.parts(state["config"])[0]["generation"]  # serve.json as an older rayload wrote it
    control.save_state(dep.run_dir, state)
    log_events(started.url, events(3_000, {"A": 0.1, "B": 0.1}, {"A": 0.5, "B": 0.5}), None)
    assert sum(a.exposures for a in control.analysis_for(dep.run_dir).arms) == 3_000
    started({"A": "/x", "B": "/y"})  # restarted as the same experiment: still no generation, still every event
    assert generation_of(dep.run_dir) is None
    assert sum(a.exposures for a in control.analysis_for(dep.run_dir).arms) == 3_000


# ------------------------------------------------------------------ ramp steps


def test_a_ramp_step_of_1_is_refused_at_load_with_what_to_do():
    with pytest.raises(SpecError, match=r"ramp.steps: every step must be below 1.*promote"):
        spec_of(0.95, ramp={"steps": [0.05, 0.5, 1.0]})


def test_a_saved_spec_with_a_step_of_1_still_loads_and_the_controller_never_takes_it(tmp_path, monkeypatch):
    spec = spec_of(0.5, ramp={"steps": [0.5], "min_units_per_step": 500})
    raw = spec.model_dump(mode="json")
    raw["ramp"]["steps"] = [0.5, 1.0]  # as a run saved before the rule has it
    assert ABSpec.model_validate(raw).ramp.steps == [0.5, 1.0]
    args = {"experiment": "t", "arms": ["A", "B"], "serving": spec.serving.model_dump(), "weights": spec.weights, "champion": "A",
            "shadow": False, "spec": raw, "events_url": "sqlite:///unused", "checkpoints": {}}
    control.save_state(str(tmp_path), {"config": serve_config(args), "address": None, "decisions": []})
    monkeypatch.setattr(control, "_redeploy", lambda config, address: None)
    monkeypatch.setattr(control, "_events_frame", lambda args, spec: events(6_000, {"A": 0.1, "B": 0.1}, {"A": 0.5, "B": 0.5}))
    decision, _ = control.step(str(tmp_path))
    assert decision == "continue" and user(str(tmp_path))["weights"] == {"A": 0.5, "B": 0.5}


# ------------------------------------------------------------------ names, versions, unit IDs


def test_names_longer_than_the_event_stores_columns_are_refused_at_load():
    arms = [{"name": "A" * 65, "weight": 0.5, "checkpoint": "/x"}, {"name": "B", "weight": 0.5, "checkpoint": "/y"}]
    with pytest.raises(SpecError) as info:
        ab_from_dict({"name": "e" * 129, "arms": arms})
    text = str(info.value)
    assert "name: at most 128 characters" in text and "arms.0.name: at most 64 characters" in text and "VARCHAR(64)" in text
    ok = ab_from_dict({"name": "e" * 128, "arms": [dict(arms[0], name="A" * 64), arms[1]]})
    assert len(ok.name) == 128


def test_a_model_version_fits_its_column_and_still_pins_the_weights(tmp_path):
    from rayload.serve.events import exposures
    from rayload.serve.scorer import model_version

    deep = tmp_path / ("run-" + "r" * 150) / ("checkpoint-" + "c" * 150)
    deep.mkdir(parents=True)
    (deep / "model.pt").write_bytes(b"weights")
    version = model_version(str(deep))
    assert len(version) <= exposures.c.model_version.type.length
    assert version.startswith("run-rrr") and "..." in version and version.split("@")[0].endswith("ccc")
    (deep / "model.pt").write_bytes(b"other weights")
    assert model_version(str(deep)).split("@")[1] != version.split("@")[1]
    short = tmp_path / "run" / "best"
    short.mkdir(parents=True)
    (short / "model.pt").write_bytes(b"weights")
    assert model_version(str(short)).startswith("run/best@")


@pytest.mark.parametrize("unit", [True, False, 1.0, 2.5, None, [1], {"u": 1}])
def test_a_unit_id_is_a_string_or_an_integer_and_nothing_coerced_into_one(unit):
    with pytest.raises(ValidationError) as info:
        PredictBody.model_validate({"unit_id": unit, "features": {}})
    assert [e["loc"] for e in info.value.errors()] == [("unit_id",)], info.value.errors()
    assert "must be a string or an integer" in info.value.errors()[0]["msg"]
    with pytest.raises(ValidationError):
        AssignBody.model_validate({"unit_ids": ["a", unit]})


def test_string_and_integer_unit_ids_are_kept_as_sent():
    assert PredictBody.model_validate({"unit_id": "1", "features": {}}).unit_id == "1"
    assert PredictBody.model_validate({"unit_id": 1, "features": {}}).unit_id == 1
    assert PredictBody.model_validate(json.loads('{"unit_id": 12345678901234567890}')).unit_id == 12345678901234567890


def test_a_drift_seed_with_movielens_traffic_is_refused_by_name():
    """MovieLens replays recorded ratings: a drift_seed with it was ignored, a drift rehearsal that changed nothing."""
    from rayload.ab_spec import ab_from_dict
    from rayload.errors import SpecError

    arms = [{"name": "a", "weight": 0.5, "checkpoint": "/x"}, {"name": "b", "weight": 0.5, "checkpoint": "/y"}]
    with pytest.raises(SpecError, match=r"simulate.drift_seed: needs source: synthetic-ctr"):
        ab_from_dict({"name": "t", "arms": arms, "simulate": {"drift_seed": 7}})
    assert ab_from_dict({"name": "t", "arms": arms, "simulate": {"source": "synthetic-ctr", "drift_seed": 7}}).simulate.drift_seed == 7
    # a run saved with one before the rule still loads where a saved spec is read back (analysis, controller)
    assert ABSpec.model_validate({"name": "t", "arms": arms, "simulate": {"drift_seed": 7}}).simulate.drift_seed == 7
