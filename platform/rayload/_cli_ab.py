"""`rayload serve ...` and `rayload ab ...`: thin commands over rayload.serve."""

from __future__ import annotations

import json
import os
import time
from typing import Annotated, Optional

import typer
import yaml
from rich.markup import escape
from rich.table import Table

from .cli import AddressOpt, SetOpt, _friendly, _g, _out_file, app, console

ab_app = typer.Typer(no_args_is_help=True, help="Steer and analyse a running A/B experiment.")
app.add_typer(ab_app, name="ab")
ABArg = Annotated[str, typer.Argument(help="A/B spec YAML (jobs/ab_*.yaml)")]
RunArg = Annotated[str, typer.Argument(help="the experiment: its name, run folder, or A/B spec")]


def _run_of(run: str, overrides: list[str] | None = None) -> str:
    """A spec path names its experiment's run folder, with the `--set` overrides `rayload serve`
    was given (`--set name=trial2` serves another experiment than the file's); a name or
    folder is used as is."""
    if run.endswith((".yaml", ".yml")) and os.path.exists(run):
        from .ab_spec import load_ab_spec
        from .serve.control import run_dir_for

        return run_dir_for(load_ab_spec(run, overrides or []))
    if overrides:
        raise typer.BadParameter(f"--set applies to an A/B spec file, and {run!r} is an experiment's name or run folder: "
                                 "name the spec the experiment was served from, or leave --set out", param_hint="--set")
    return run


@app.command()
@_friendly
def serve(spec: Annotated[str, typer.Argument(help="A/B spec YAML, or `build` followed by the spec")],
          build_spec: Annotated[Optional[str], typer.Argument(help="with `build`: the A/B spec")] = None,
          out: Annotated[Optional[str], typer.Option(help="with build: where to write the Serve config (default serve_config.yaml)")] = None,
          set_: SetOpt = None, address: AddressOpt = None,
          auto: Annotated[bool, typer.Option(help="run the automatic ramp/decision loop")] = True,
          detach: Annotated[bool, typer.Option(help="deploy and return (the app keeps running on a cluster)")] = False) -> None:
    """Deploy an A/B experiment and keep serving (`rayload serve SPEC`), or write its Serve
    config for `serve deploy` (`rayload serve build SPEC --out serve_config.yaml`)."""
    from .ab_spec import load_ab_spec
    from .serve import control

    if spec == "build":
        if not build_spec:
            raise typer.BadParameter("rayload serve build SPEC: name the A/B spec")
        _build(load_ab_spec(build_spec, set_ or []), build_spec, out or "serve_config.yaml", address)
        return
    if build_spec is not None or out is not None:  # both were ignored: the experiment served without a word
        raise typer.BadParameter(f"a second argument and --out are for `rayload serve build SPEC --out FILE`; "
                                 f"to serve: rayload serve {spec}", param_hint="BUILD_SPEC/--out")
    ab = load_ab_spec(spec, set_ or [])
    with console.status("training missing arms and deploying..."):
        dep = control.start(ab, address=address)
    console.print(f"serving [bold]{ab.name}[/] at [bold]{dep.url}[/] ({dep.args['mode']} mode, {ab.serving.ingress} ingress); "
                  f"run folder {dep.run_dir}")
    if dep.urls and len(dep.urls) > 1:
        console.print(f"each router replica answers at its own port: {', '.join(dep.urls)}", soft_wrap=True)
    console.print(f"try: curl -s {dep.url}/experiment", soft_wrap=True)
    if detach:
        return
    _stop_on_signals()
    said = None
    try:
        while True:
            time.sleep(ab.ramp.interval_s)
            if auto and ab.ramp.auto:
                # After a promote or rollback each look returns it again, acting on nothing; say it once.
                try:
                    decision, reasons = control.step(dep.run_dir)
                except Exception as exc:  # noqa: BLE001  a database outage or a slow redeploy: look again next interval
                    # (it ended the loop with a traceback, leaving the experiment without guardrails or ramp)
                    if ("failed", str(exc)) != said:
                        console.print(f"[bold red]the controller's look failed[/] ({escape(type(exc).__name__)}: {escape(str(exc))}); "
                                      f"looking again every {ab.ramp.interval_s:g} s")
                    said = ("failed", str(exc))
                    continue
                if decision != "continue" and (decision, reasons) != said:
                    console.print(f"[bold]{decision}[/]: {escape('; '.join(reasons))}")
                said = (decision, reasons)
    except KeyboardInterrupt:
        _stop_serving(ab.name)
        console.print(f"stopped {ab.name}")


def _stop_serving(name: str) -> None:
    """Ctrl-C on `rayload serve`: this experiment's app goes; Serve and Ray end only where this
    process started them (a Ray it joined, e.g. found through `ray start`'s address file without
    --address, keeps Serve for the other apps on it)."""
    import ray
    from ray import serve as ray_serve

    from ._ray import embedded

    ray_serve.delete(name)  # this experiment only; others on a shared cluster keep running
    if embedded():
        ray_serve.shutdown()
        ray.shutdown()


def _stop_on_signals() -> None:
    """Ctrl-C and SIGTERM both end `rayload serve` cleanly (a shell may start it with SIGINT ignored)."""
    import signal

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def _build(ab, spec: str, out: str, address) -> None:
    from .serve import control

    _out_file(out)
    config = control.build(ab, address)
    from .paths import open_private

    with open_private(out) as f:  # events_url may hold a password
        f.write(f"# serve deploy {out}   (written by rayload serve build {spec})\n")
        if ab.serving.ingress == "direct":
            f.write("# serving.ingress: direct: start every node with RAY_SERVE_ENABLE_DIRECT_INGRESS=1 in the environment of\n"
                    "# `ray start`; the router replicas then answer on ports from 30000 (Serve's target groups list them)\n")
        yaml.safe_dump(config, f, sort_keys=False)
    console.print(f"wrote {escape(out)}: deploy it with [bold]serve deploy {escape(out)}[/]")


@ab_app.command("status")
@_friendly
def status(run: RunArg, as_json: Annotated[bool, typer.Option("--json", help="print the analysis as JSON")] = False,
           set_: SetOpt = None) -> None:
    """The live analysis: CTR per arm, lift, tests, SRM, guardrails, the decision."""
    from .serve.control import analysis_for

    result = analysis_for(_run_of(run, set_))
    if as_json:
        console.print_json(json.dumps(result.to_dict()))
        return
    print_analysis(result)


def print_analysis(result) -> None:
    table = Table("arm", "weight", "units", "exposures", "clicks", "CTR", result.ci_label, "errors", "p99 ms", "guardrails",
                  title=f"experiment {result.experiment} (champion {result.live_champion or result.champion}"
                        f"{f', promoted over {result.champion}' if result.live_champion else ''})")

    from .serve.analysis import points
    from .serve.report import _n, lift_text

    for a in result.arms:
        table.add_row(escape(a.arm), _g(result.weights.get(a.arm)), str(a.units), str(a.exposures), str(a.clicks), _n(a.ctr, ".4g"),
                      escape(f"[{_n(a.ctr_ci[0], '.4g')}, {_n(a.ctr_ci[1], '.4g')}]"), _n(a.error_rate, ".2%"), _n(a.p99_ms, ".4g"),
                      "ok" if a.guardrail_ok else escape("; ".join(a.guardrail_reasons)))
    console.print(table)
    if result.diff is not None:
        console.print(escape(f"difference {points(result.diff, result.diff_ci)}, {lift_text(result)}; "
                             f"fixed-horizon p={_g(result.z_p_value)}, sequential (always valid) p={_g(result.sequential_p)}"))
    console.print(f"sample ratio check p={_g(result.srm_p)}{' [red]MISMATCH: results invalid[/]' if result.srm_flagged else ''}")
    if result.sequential_mde_now is not None:
        console.print(f"sequential test (decides): detectable effect now {_g(result.sequential_mde_now)}; about "
                      f"{result.sequential_units_needed} more units for the configured power (a fixed-horizon test looked at "
                      f"once: {_g(result.mde_now)}, {result.units_needed} more)")
    for arm, shadow in (result.shadow_scores or {}).items():
        console.print(f"shadow arm {arm}: scored {shadow['requests']} requests beside the champion, "
                      f"{'[red]' if shadow['errors'] else ''}{shadow['errors']} failed ({shadow['error_rate']:.2%})"
                      f"{'[/]' if shadow['errors'] else ''}")
    if result.drift:
        drift = Table("arm", "feature", "rows", "PSI", "OOV rate", "status", title="feature drift (PSI against the training data)")
        for r in result.drift:
            drift.add_row(escape(r["arm"]), escape(r["feature"]), str(r["rows"]), f"{r['psi']:.4f}", f"{r['oov_rate']:.2%}" if "oov_rate" in r else "",
                          "[red]DRIFT[/]" if r["flagged"] else "ok" if r.get("judged", True) else "too few rows")
        console.print(drift)
    console.print(f"decision: [bold]{result.decision}[/] ({escape('; '.join(result.reasons))})")


@ab_app.command("set-weights")
@_friendly
def set_weights(run: RunArg, weights: Annotated[list[str], typer.Argument(help="arm=share ... (summing to 1)")],
                set_: SetOpt = None) -> None:
    """Change the traffic split of a running experiment in place (Serve user_config)."""
    from .errors import RayloadError
    from .serve.control import set_weights as apply

    parsed = {}
    for item in weights:
        name, _, value = item.partition("=")
        try:
            share = float(value)
        except ValueError:
            share = None
        if not name or share is None:
            raise RayloadError(f"weights: {item!r} is not arm=share (for example control=0.9 challenger=0.1)")
        if name in parsed:  # the last one won, the first dropped without a word
            raise RayloadError(f"weights: the arm {name!r} is given twice ({name}={parsed[name]:g} and {item}); give each arm once")
        parsed[name] = share
    console.print(f"weights now {apply(_run_of(run, set_), parsed)['weights']}")


@ab_app.command("promote")
@_friendly
def promote(run: RunArg, set_: SetOpt = None) -> None:
    """The challenger takes all traffic and becomes the champion."""
    from .serve.control import promote as apply

    console.print(f"promoted: {apply(_run_of(run, set_))}")


@ab_app.command("rollback")
@_friendly
def rollback(run: RunArg, set_: SetOpt = None) -> None:
    """The challenger gets no traffic."""
    from .serve.control import rollback as apply

    console.print(f"rolled back: {apply(_run_of(run, set_))}")


@ab_app.command("simulate")
@_friendly
def simulate(spec: ABArg, users: Annotated[Optional[int], typer.Option(min=1, help="simulated users (default: the spec's)")] = None,
             requests: Annotated[Optional[int], typer.Option(min=1, help="requests in all (default: the spec's)")] = None,
             url: Annotated[Optional[str], typer.Option(help="default: the running experiment's URL")] = None,
             decide: Annotated[bool, typer.Option(help="run the automatic controller while traffic flows")] = True,
             set_: SetOpt = None) -> None:
    """Send simulated users to the live endpoint and report the analysis and decision."""
    from .ab_spec import load_ab_spec
    from .serve import control
    from .serve.world import world_for
    from .serve.simulate import simulate_and_decide

    ab = load_ab_spec(spec, set_ or [])
    run_dir, state = control.load_state(control.run_dir_for(ab))
    sim = ab.simulate
    world = world_for(ab, control.parts(state["config"])[0])
    key = os.environ.get(ab.serving.api_key_env) if ab.serving.api_key_env else None
    total = sim.requests if requests is None else requests  # `or` would take an explicit 0 for the spec's value
    users = sim.users if users is None else users
    with console.status("simulating...") as line:
        out = simulate_and_decide(run_dir, url or (lambda: control.live_urls(run_dir)), world, users, total, sim.concurrency, sim.seed, key,
                                  auto=decide and ab.ramp.auto,
                                  on_chunk=lambda done, status: line.update(f"simulated {done}/{total} requests; statuses {status}"))
    for s in out.steps:
        console.print(escape(f"after {s['requests']} requests: {s['decision']} ({'; '.join(s['reasons'])})"))
    console.print(f"requests {out.requests}, HTTP statuses {out.status}" + (f", click feedback statuses {out.feedback}" if out.feedback else ""))
    print_analysis(control.analysis_for(run_dir))
    console.print(f"[bold]decision: {out.decision}[/]")


@ab_app.command("report")
@_friendly
def report(run: RunArg, out: Annotated[Optional[str], typer.Option(help="default: report.html in the run folder")] = None,
           set_: SetOpt = None) -> None:
    """Write an HTML page: cumulative CTR per arm with bands, lift over time, the decision."""
    from .serve.control import analysis_for, events_of, load_state
    from .serve.report import render

    _out_file(out)
    run_dir, _ = load_state(_run_of(run, set_))
    path = out or os.path.join(run_dir, "report.html")
    with open(path, "w") as f:
        f.write(render(analysis_for(run_dir), events_of(run_dir)))
    console.print(f"wrote {escape(path)}")
