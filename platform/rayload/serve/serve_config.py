"""An A/B experiment's Serve application: each arm's checkpoint (trained from its job spec when
none is given), the serving mode, the app's arguments, the `serve deploy` config holding them,
and deploying that config on the connected cluster. `control.py` starts and steers it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

from ..ab_spec import ABSpec
from ..errors import RayloadError
from ..paths import localize
from .events import default_url

log = logging.getLogger(__name__)
ROUTER = "ABRouter"


def resolve_checkpoints(spec: ABSpec, address: str | None = None) -> dict[str, str]:
    """Each arm's checkpoint: given, or the best of training its job spec (a finished run
    with the same name is reused, so this trains once)."""
    out = {}
    trained: dict[str, str] = {}  # resolved job (run name aside) -> the arm that trained it
    for arm in spec.arms:
        if arm.checkpoint:
            try:  # a URI (shared storage) is fetched once here, and again by each replica's node
                here = localize(arm.checkpoint)
            except (OSError, ValueError) as exc:  # pyarrow: an unknown scheme, a missing bucket or folder
                raise RayloadError(f"arms.{arm.name}.checkpoint: cannot read {arm.checkpoint}: {exc}") from exc
            if not os.path.exists(os.path.join(here, "model.pt")):
                raise RayloadError(f"arms.{arm.name}.checkpoint: no model.pt in {arm.checkpoint}")
            out[arm.name] = arm.checkpoint
            continue
        from ..data.pipeline import job_cache_key
        from ..spec import load_spec
        from ..train.trainer import finished_run, fit

        job = load_spec(arm.job, arm.set)
        raw = job.model_dump(mode="json")
        raw["train"].pop("run_name")
        key = json.dumps(raw, sort_keys=True)
        # The run is named by what it trains: the resolved job and its data's identity (the
        # preprocessing cache key: spec sections, input paths, sizes, mtimes). An unchanged arm
        # finds its finished run and reuses it; an edited job or new data trains a run of its own
        # (one name for both would be a relaunch of the old run, which train refuses).
        data_key = job_cache_key(job)
        fingerprint = hashlib.sha256(f"{key}|{data_key}".encode()).hexdigest()[:10]
        job = job.model_copy(update={"train": job.train.model_copy(update={"run_name": f"ab-{spec.name}-{arm.name}-{fingerprint}"})})
        if key in trained:  # an A/A test: the same job trains to the same model (one seed), once
            log.info("arm %s: the same job as arm %s; sharing its checkpoint", arm.name, trained[key])
            out[arm.name] = out[trained[key]]
            continue
        if done := finished_run(job, data_key):  # read off the run's record: no Ray start, no loop resumed to do nothing
            log.info("arm %s: %s trained to its end in %s; serving its best checkpoint", arm.name, arm.job, done.run_dir)
            out[arm.name] = done.checkpoint
        else:
            log.info("arm %s: training %s", arm.name, arm.job)
            out[arm.name] = fit(job, address=address, evaluate_test=False).checkpoint
        trained[key] = arm.name
    return out


def serving_mode(spec: ABSpec, checkpoints: dict[str, str]) -> str:
    if spec.serving.mode != "auto":
        return spec.serving.mode
    import torch

    total = 0
    for path in checkpoints.values():
        state = torch.load(os.path.join(localize(path), "model.pt"), weights_only=True, map_location="cpu")
        total += sum(t.numel() for t in state.values())
    return "combined" if total <= spec.serving.combined_max_params else "separate"


def app_args(spec: ABSpec, checkpoints: dict[str, str], run_dir: str) -> dict:
    from ..features import FittedFeatures

    names = set()  # a request may carry what any arm reads
    for path in checkpoints.values():
        features = FittedFeatures.load(os.path.join(localize(path), "features.json"))
        names |= {c["name"] for c in features.columns if c["role"] != "label"}
    serving = spec.serving.model_dump()
    key_sha = None
    if spec.serving.api_key_env:
        key = os.environ.get(spec.serving.api_key_env)
        if not key:
            raise RayloadError(f"serving.api_key_env: the environment variable {spec.serving.api_key_env} is not set; "
                               "export the API key there, or remove api_key_env to serve without a key")
        if not (key.isascii() and key.isprintable() and key == key.strip()):
            # HTTP carries header values as bytes that servers read as Latin-1 and strip: a key with
            # 'é' (sent as UTF-8 by curl and aiohttp) or surrounding spaces could never match
            raise RayloadError(f"serving.api_key_env: the API key in {spec.serving.api_key_env} must be printable ASCII "
                               "without surrounding spaces, which an x-api-key header carries as it is")
        key_sha = hashlib.sha256(key.encode()).hexdigest()
    return {"api_key_sha256": key_sha,"experiment": spec.name, "salt": spec.experiment_salt, "arms": [a.name for a in spec.arms],
            "checkpoints": checkpoints, "mode": serving_mode(spec, checkpoints), "serving": serving,
            "events": spec.events.model_dump(), "events_url": spec.events.url or default_url(run_dir),
            "weights": spec.weights, "champion": spec.champion_arm, "shadow": spec.shadow,
            "feature_names": sorted(names), "spec": spec.model_dump(mode="json")}


def serve_config(args: dict) -> dict:
    """A config `serve deploy` accepts (ServeDeploySchema)."""
    s = args["serving"]
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": s["host"], "port": s["port"]},
        "applications": [{
            "name": args["experiment"], "route_prefix": s["route_prefix"],
            "import_path": "rayload.serve.app:build_app", "args": args,
            "logging_config": {"log_level": s.get("log_level", "WARNING"), "enable_access_log": s.get("access_log", False)},
            "deployments": [{"name": ROUTER, "user_config": {"weights": args["weights"], "champion": args["champion"],
                                                              "shadow": args["shadow"]}}],
        }],
    }


def deploy(config: dict, wait_s: float = 300) -> None:
    """Deploy (or update) the config's app on the connected Ray cluster and wait until it runs.

    A declarative deploy replaces the whole set of apps, so the apps already deployed from
    configs (other experiments) are sent along unchanged and keep running."""
    from ray.serve._private import api as serve_api
    from ray.serve.config import HTTPOptions
    from ray.serve.schema import ServeDeploySchema

    client = serve_api.serve_start(http_options=HTTPOptions(**config["http_options"]), proxy_location=config["proxy_location"])
    ours = config["applications"][0]["name"]
    others = [app["deployed_app_config"] for name, app in client.get_serve_details().get("applications", {}).items()
              if name != ours and app.get("deployed_app_config")]
    schema = ServeDeploySchema.model_validate({**config, "applications": others + config["applications"]})
    client.deploy_apps(schema, _blocking=False)
    try:
        wait_running(ours, wait_s)
    except RayloadError as exc:
        raise NotRunningError(str(exc)) from exc
    except BaseException as exc:  # Ctrl-C or a Ray error in the wait: Serve has the config all the same
        exc.rayload_config_submitted = True  # (control._apply records it, or the next look would undo a rollback)
        raise


class NotRunningError(RayloadError):
    """Serve took the new config, and the app did not come up running with it in time: what is
    deployed is that config, whatever became of its replicas (serve/control.py records it)."""


def wait_running(app: str, wait_s: float) -> None:
    from ray import serve

    deadline, status = time.monotonic() + wait_s, None
    while time.monotonic() < deadline:
        status = serve.status().applications.get(app)
        if status is not None:
            if status.status == "RUNNING" and all(d.status == "HEALTHY" for d in status.deployments.values()):
                return
            if status.status == "DEPLOY_FAILED":
                raise RayloadError(f"the A/B app {app} failed to deploy: {status.message}")
        time.sleep(0.5)
    waiting = "; ".join(f"{name}: {d.status} {d.message}".strip() for name, d in (status.deployments.items() if status else []))
    raise RayloadError(f"the A/B app {app} was not running after {wait_s:.0f} s ({waiting or 'no status'}); "
                       "check serving.replicas and serving.cpus_per_replica against the cluster's free CPUs")
