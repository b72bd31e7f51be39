"""Deploying an A/B experiment and steering it: start, state, weights, decisions.

Everything goes through one Serve config (the `serve deploy` schema): `rayload serve build`
writes it, `rayload serve` deploys it, and a weight change deploys it again with only the
router's `user_config` changed, which Serve applies to the running replicas in place. The
run folder `runs/ab/<name>/` keeps `serve.json` (the config in force, the Ray address, the
URLs, the decision log) and, by default, `events.db`. Where clients reach the router (Serve's
proxy, or each replica's own port with direct ingress) is `ingress.py`.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import dataclass

from ..ab_spec import ABSpec, weight_issues
from ..errors import RayloadError, SpecError, SpecIssue
from ..paths import runs_root
from .ingress import check_direct_ingress, direct_ingress_env, ingress_urls
from .router_config import final_weights_issue
from .run_state import (FINAL, _KEPT, _earlier_state, _locked, _previous_state, load_state, new_generation, parts,  # noqa: F401
                        save_state)  # (load_state, save_state, parts: public here)
from .serve_config import NotRunningError, app_args, deploy, resolve_checkpoints, serve_config

log = logging.getLogger(__name__)


def run_dir_for(spec: ABSpec) -> str:
    return os.path.join(runs_root(), "ab", spec.name)


def live_urls(run: str) -> list[str]:
    """A running experiment's router URLs now (with direct ingress a replaced replica answers
    at a new port, so the ones saved at start can be stale)."""
    _, state = load_state(run)
    args, _ = parts(state["config"])
    if args["serving"].get("ingress", "proxy") == "proxy":
        return state.get("urls") or [state["url"]]
    from .._ray import ensure_ray

    ensure_ray(state["address"])
    return ingress_urls(args["serving"], args["experiment"], every_replica=False)


@dataclass
class Deployment:
    run_dir: str
    url: str
    config: dict
    urls: list[str] | None = None  # with ingress: direct, one per router replica (url is the first)

    @property
    def args(self) -> dict:
        return parts(self.config)[0]


def start(spec: ABSpec, address: str | None = None, run_dir: str | None = None) -> Deployment:
    """Train what is missing, deploy the experiment, record it in the run folder
    (`runs/ab/<name>/` unless a pipeline stage gives its own)."""
    from .._ray import ensure_ray

    ensure_ray(address, env=direct_ingress_env() if spec.serving.ingress == "direct" else None)
    run_dir = run_dir or run_dir_for(spec)
    os.makedirs(run_dir, exist_ok=True)
    args = app_args(spec, resolve_checkpoints(spec, address), run_dir)
    with _locked(run_dir):  # a controller's decision during the restart is neither lost nor overwritten
        return _start_locked(spec, run_dir, args)


def _in_force(args: dict, kept: dict | None, generation: str | None) -> dict:
    """The Serve config of `args`; of the same experiment's earlier start (`kept`), its
    generation and the weights, champion and final decision in force, not the spec's again."""
    args["generation"] = parts(kept["config"])[0].get("generation") if kept else generation
    config = serve_config(args)
    if kept:
        parts(config)[1].update(parts(kept["config"])[1])
    return config


def build(spec: ABSpec, address: str | None = None) -> dict:
    """The config `rayload serve build` writes for `serve deploy`. Of an experiment that has
    run, as a restart would deploy it: the spec's starting weights and no generation undid a
    promote and hid every later exposure from its analysis (which reads its generation's)."""
    run_dir = run_dir_for(spec)
    os.makedirs(run_dir, exist_ok=True)
    args = app_args(spec, resolve_checkpoints(spec, address), run_dir)
    with _locked(run_dir):
        return _in_force(args, _earlier_state(run_dir, args), None)


def _start_locked(spec: ABSpec, run_dir: str, args: dict) -> Deployment:
    import ray

    kept = _earlier_state(run_dir, args)
    config = _in_force(args, kept, new_generation())
    check_direct_ingress(args["serving"])
    was_running = _app_running(spec.name)  # this experiment, or one of its name started with another spec

    def record_submitted() -> None:  # Serve runs `config` now: serve.json says so (a later look would redeploy the old one)
        earlier = _previous_state(run_dir)
        save_state(run_dir, {"config": config, "url": earlier.get("url"), "urls": earlier.get("urls") or [],
                             "address": ray.get_runtime_context().gcs_address, "decisions": [],
                             **{k: kept[k] for k in _KEPT if k in (kept or {})}})

    try:
        deploy(config)
    except BaseException as exc:  # Serve took the config, and its wait failed or was interrupted: record what it runs
        if isinstance(exc, NotRunningError) or getattr(exc, "rayload_config_submitted", False):
            record_submitted()
        raise
    try:
        urls = ingress_urls(args["serving"], spec.name)
    except BaseException as exc:  # a refusal, a Ray error or Ctrl-C in the wait: nothing half-deployed stays behind
        if was_running:  # a restart of a live experiment (maybe promoted): it stays up, running the new config
            record_submitted()
            raise
        from ray import serve as ray_serve

        ray_serve.delete(spec.name)
        if isinstance(exc, RayloadError):
            raise RayloadError(f"{exc}; the app {spec.name} was removed again") from exc
        raise
    save_state(run_dir, {"config": config, "url": urls[0], "urls": urls, "address": ray.get_runtime_context().gcs_address,
                         "decisions": [], **{k: kept[k] for k in _KEPT if k in (kept or {})}})
    return Deployment(run_dir, urls[0], config, urls)


def _app_running(name: str) -> bool:
    """Whether Serve runs the app `name` now (a restart's clean-up must not delete a live experiment)."""
    import ray
    from ray import serve as ray_serve

    if not ray.is_initialized():  # serve.status() would start a Ray of its own
        return False
    try:
        status = ray_serve.status().applications.get(name)
    except Exception:  # noqa: BLE001 - no Serve yet: nothing runs
        return False
    return status is not None and status.status == "RUNNING"


def set_weights(run: str, weights: dict[str, float], champion: str | None = None, reason: str = "by hand",
                decision: str | None = None) -> dict:
    """New weights (and champion) for a running experiment, applied in place. Bad weights
    raise SpecError and leave the old ones in force. A promote or rollback is final: the
    automatic controller stops; any other change (a new ramp by hand) starts it again."""
    run_dir, _ = load_state(run)
    with _locked(run_dir):
        _, state = load_state(run_dir)
        return _apply(run_dir, state, weights, champion, reason, decision)


def _apply(run_dir: str, state: dict, weights: dict[str, float], champion: str | None, reason: str, decision: str | None,
           step_units: int | None = None) -> dict:
    """set_weights with the lock held and the state read. `step_units`: the challenger's units
    when a ramp step begins (None: counted from the controller's next look)."""
    config = copy.deepcopy(state["config"])
    args, user = parts(config)
    champion = champion or user["champion"]
    if issues := weight_issues(weights, args["arms"], champion, where="weights", shadow=bool(user.get("shadow"))):
        raise SpecError(issues)
    if decision in FINAL and (why := final_weights_issue(weights, champion)):
        raise SpecError([SpecIssue("weights", f"a {decision} gives the champion all traffic and every other arm none", why, True)])
    now = time.time()  # a final decision rides in the user_config too: the router's GET /experiment reports it
    final = {"decision": decision, "reason": reason, "time": now} if decision in FINAL else None
    user.update(weights={a: float(weights[a]) for a in args["arms"]}, champion=champion, final=final)
    entry = {"time": now, "decision": decision or "set-weights", "weights": user["weights"], "champion": champion,
             "reason": reason}
    after = {**state, "config": config, "decisions": [*(state.get("decisions") or []), entry], "final": entry if final else None,
             "ramp_step": {"weights": user["weights"], "units": step_units}}
    try:
        _redeploy(config, state["address"])
    except BaseException as exc:
        # Serve has the new config (a rollback of an unhealthy challenger is exactly when its app
        # does not come up, and an operator's Ctrl-C in the long wait): recorded, or the next look
        # would act on the old weights and undo it
        if isinstance(exc, NotRunningError) or getattr(exc, "rayload_config_submitted", False):
            save_state(run_dir, after)
        raise
    save_state(run_dir, after)
    return user


def _redeploy(config: dict, address: str | None) -> None:
    import ray

    if not ray.is_initialized():
        from .._ray import ensure_ray

        ensure_ray(address)
    deploy(config)


def promote(run: str, reason: str = "by hand") -> dict:
    """The challenger takes all traffic and becomes the champion (final: automatic steps stop)."""
    return _decide(run, "promote", reason)


def rollback(run: str, reason: str = "by hand") -> dict:
    """The challenger gets no traffic; the champion keeps it all (final: automatic steps stop)."""
    return _decide(run, "rollback", reason)


def _decide(run: str, decision: str, reason: str) -> dict:
    """A promote or rollback by hand, in the experiment's own roles (the champion it started
    with and its challenger): a rollback after a promote gives the traffic back to the original
    champion, and the same decision made again (a retry, or the operator confirming what the
    controller did) changes nothing."""
    run_dir, _ = load_state(run)
    with _locked(run_dir):
        _, state = load_state(run_dir)
        weights, champion = _final_weights(state, decision, parts(state["config"])[0]["champion"])
        user = parts(state["config"])[1]
        # the same decision already in force: nothing to change. By name alone, a promote by hand after
        # the controller promoted in swapped roles (the other arm) was a no-op, with no way to promote B
        if (state.get("final") or {}).get("decision") == decision and user.get("weights") == weights and user.get("champion") == champion:
            log.info("%s: already decided %s (%s); nothing changed", run_dir, decision, state["final"]["reason"])
            return user
        return _apply(run_dir, state, weights, champion, reason, decision)


def _final_weights(state: dict, decision: str, champion: str) -> tuple[dict[str, float], str]:
    """The weights and champion after a promote or rollback of `champion`'s challenger."""
    args, _ = parts(state["config"])
    winner = _challenger(args["arms"], champion) if decision == "promote" else champion
    return {a: 1.0 if a == winner else 0.0 for a in args["arms"]}, winner


def _challenger(arms: list[str], champion: str) -> str:
    others = [a for a in arms if a != champion]
    if len(others) != 1:
        raise RayloadError(f"promote and rollback need exactly one challenger; arms: {arms}, champion: {champion}")
    return others[0]


def analysis_for(run: str):
    """The live analysis from the event store (no Ray needed). After a promote or rollback
    its decision is that one: the statistics that follow compare the arms in their new roles
    and no longer steer anything."""
    from .analysis import final_reasons

    _, state = load_state(run)
    result, _ = _analysis_of(state)
    if final := state.get("final"):
        result.decision, result.reasons = final["decision"], final_reasons(final)
    return result


def events_of(run: str):
    """The experiment's events (EventReader rows), as its analysis reads them."""
    _, state = load_state(run)
    args, _ = parts(state["config"])
    return _events_frame(args, ABSpec.model_validate(args["spec"]))


def _analysis_of(state: dict):
    from .analysis import analyze, decided_champion

    args, user = parts(state["config"])
    spec = ABSpec.model_validate(args["spec"])
    # after a promote, in the roles it was decided in (the winner as the challenger)
    champion = decided_champion(args["arms"], user["champion"], state.get("final"))
    result = analyze(_events_frame(args, spec), spec, user["weights"], champion)
    result.live_champion = user["champion"] if champion != user["champion"] else None
    if args.get("shadow"):  # a generation's shadow mode is fixed (a change starts a new one)
        result.shadow_scores = _shadow_summary(args)
    if spec.drift.enabled:
        from .monitor import report_for

        result.drift = report_for(args["events_url"], args["experiment"], args["checkpoints"], spec.drift)
    return result, spec


def _events_frame(args: dict, spec: ABSpec):
    """The current generation's exposures (all of them for a run started before generations)."""
    from .events import EventReader

    reader = EventReader(args["events_url"], must_exist=True)  # a moved run folder: an error, not a new empty store
    try:
        return reader.frame(args["experiment"], spec.analysis.event, args.get("generation"))
    finally:
        reader.close()


def _shadow_summary(args: dict) -> dict:
    from .events import EventReader

    reader = EventReader(args["events_url"], must_exist=True)
    try:
        return reader.shadow_summary(args["experiment"], args.get("generation"))
    finally:
        reader.close()


def stop(run: str) -> None:
    """Delete this experiment's Serve application (others on the cluster keep running)."""
    from ray import serve as ray_serve

    _, state = load_state(run)
    args, _ = parts(state["config"])
    ray_serve.delete(args["experiment"])


def step(run: str) -> tuple[str, list[str]]:
    """One look of the automatic controller: act on the analysis by the ramp schedule.
    promote / rollback end the experiment: later looks change nothing and return that
    decision. Otherwise the challenger's share moves to the next ramp step once
    `min_units_per_step` challenger units came in since the current step began and its
    guardrails have been judged (guardrails.min_requests requests; a breach has rolled it back)."""
    run_dir, _ = load_state(run)
    with _locked(run_dir):
        _, state = load_state(run_dir)
        if final := state.get("final"):
            from .analysis import final_reasons

            return final["decision"], final_reasons(final)
        result, spec = _analysis_of(state)
        if result.decision in FINAL:
            # The analysis's roles: after a promote and a new ramp by hand they are the swapped ones
            _apply(run_dir, state, *_final_weights(state, result.decision, result.champion), "; ".join(result.reasons),
                   result.decision)
            return result.decision, result.reasons
        return "continue", result.reasons + _ramp(run_dir, state, result, spec)


def _ramp(run_dir: str, state: dict, result, spec: ABSpec) -> list[str]:
    """Move the challenger to the next ramp step when the current one has its units; what was done."""
    if result.srm_flagged or result.challenger is None:
        return []
    if not next(a.guardrail_ok for a in result.arms if a.arm == result.challenger):
        # A breach the challenger is not clearly worse in (an incident both arms share): more
        # traffic waits until it ends (a breach it is worse in has rolled it back).
        return ["the ramp holds while the challenger breaches a guardrail"]
    _, user = parts(state["config"])
    if user.get("shadow"):
        return ["shadow mode: the champion answers all traffic, so the ramp holds"]
    share = result.weights.get(result.challenger, 0.0)
    # A step of 1.0 would hand the challenger all traffic without a promote: specs refuse it
    # (ab_spec.spec_issues), and one saved before that rule is not taken either.
    later = [s for s in spec.ramp.steps if share + 1e-12 < s < 1]
    if not later:
        return []
    units = next(a.units for a in result.arms if a.arm == result.challenger)
    begun = _step_start(state, user["weights"])
    if share == 0 and state.get("ramp_step") is None:
        # The spec starts the challenger dark: at 0% no unit can come in to complete a step, so
        # the ramp begins at its first step at once (a 0% set by hand later is a pause: below).
        nxt = later[0]
        _apply(run_dir, state, {result.champion: round(1 - nxt, 4), result.challenger: nxt}, None, f"ramp to {nxt:.0%}", "ramp", units)
        return [f"ramped the challenger from 0% to its first step, {nxt:.0%}"]
    if begun is None:  # a share set by hand: its step begins at this look
        state["ramp_step"] = {"weights": user["weights"], "units": units}
        save_state(run_dir, state)
        return []
    if share == 0:
        return ["the challenger's share is 0%, set by hand: the ramp holds until a share is set (rayload ab set-weights)"]
    if units - begun < spec.ramp.min_units_per_step:
        return []
    requests = next(a.requests for a in result.arms if a.arm == result.challenger)
    if requests < spec.guardrails.min_requests:
        # A step is gated by the guardrails too: they are judged only from min_requests on, and
        # a min_units_per_step below it would step up before they had looked at all.
        return [f"the ramp holds until the challenger's guardrails can be judged: {requests} of "
                f"guardrails.min_requests={spec.guardrails.min_requests} requests"]
    nxt = later[0]
    _apply(run_dir, state, {result.champion: round(1 - nxt, 4), result.challenger: nxt}, None, f"ramp to {nxt:.0%}", "ramp", units)
    return [f"ramped the challenger to {nxt:.0%}"]


def _step_start(state: dict, weights: dict[str, float]) -> int | None:
    """The challenger's units when the current weights' ramp step began; None: not known yet."""
    begun = state.get("ramp_step")
    if begun is None:  # the spec's own weights, in force since start: every unit counts
        return 0
    return begun["units"] if begun["weights"] == weights else None
