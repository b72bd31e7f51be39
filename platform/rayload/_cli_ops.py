"""`rayload run`, `demo`, `report`, `submit` and `doctor`: the pipeline and operations commands."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.markup import escape
from rich.table import Table

from .cli import AddressOpt, StageSetOpt, _friendly, _g, _out_file, app, console

DEMO_PIPELINE = "jobs/movielens_pipeline.yaml"


@app.command("run")
@_friendly
def run_cmd(
    spec: Annotated[str, typer.Argument(help="a pipeline spec, or any job, search or A/B spec (run as its own stages)")],
    run_id: Annotated[Optional[str], typer.Option(help="run folder runs/<run-id>/ (default: the pipeline's name)")] = None,
    force: Annotated[Optional[list[str]], typer.Option(help="run this stage even if its inputs did not change (repeatable)")] = None,
    set_: StageSetOpt = None, address: AddressOpt = None,
) -> None:
    """Run a pipeline's stages in order; unchanged stages are skipped. `--set STAGE.field=value` changes one stage."""
    from .pipeline_spec import load_pipeline

    pipeline = load_pipeline(spec, set_ or [])
    result = run_with_progress(pipeline, run_id, address, tuple(force or ()))
    print_run(result)
    if not result.ok:
        raise typer.Exit(exit_code(result))


def exit_code(result) -> int:
    """2 when the failed stage's error was the user's (a RayloadError: a bad spec, bad data), as
    `rayload train` and the other commands exit for the same error; 1 for anything else."""
    return 2 if any(s.outcome == "failed" and s.user_error for s in result.stages) else 1


def run_with_progress(pipeline, run_id, address, force=()):
    from . import stages

    columns = (SpinnerColumn(), TextColumn("{task.description:<22}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
               TimeElapsedColumn(), TextColumn("{task.fields[note]}"))
    with Progress(*columns, console=console) as bars:
        tasks = {s.name: bars.add_task(f"{s.name} ({s.kind})", total=1.0, start=False, note="") for s in pipeline.stages}

        def on_event(kind, name, info):
            task = tasks[name]
            if kind == "start":
                bars.start_task(task)
            elif kind == "progress":
                bars.update(task, completed=min(max(info, 0.0), 0.99))
            else:
                note = {"ok": "[green]done", "skipped": "[cyan]unchanged, skipped", "failed": "[red]failed"}[info.outcome]
                bars.update(task, completed=1.0 if info.outcome != "failed" else 0.0, note=note)
                bars.stop_task(task)

        return stages.run(pipeline, run_id, address, force, on_event)


def print_run(result) -> None:
    table = Table("stage", "kind", "outcome", "seconds", "key outputs", title=f"run {result.run_id}")
    for s in result.stages:
        table.add_row(s.name, s.kind, s.outcome, f"{s.seconds:.1f}", escape(_key_outputs(s)))
    console.print(table)
    for s in result.stages:
        if s.error:
            console.print(f"[red]stage {s.name} failed[/]: {escape(str(s.error))}")
    console.print(f"run folder [bold]{escape(result.run_dir)}[/] (manifest.json, one folder per stage)")


def _key_outputs(stage) -> str:
    o = stage.outputs
    if stage.kind == "prepare":
        return f"{o.get('good_rows')} good rows, {o.get('quarantined_rows')} quarantined"
    if stage.kind == "train":
        return f"val auc {_g((o.get('val') or {}).get('val_auc'))}, test auc {_g((o.get('test') or {}).get('auc'))}"
    if stage.kind == "tune":
        best = o.get("best") or {}
        return f"{o.get('trials')} trials, best {o.get('metric')} {_g(best.get('value'))}, test auc {_g((best.get('test') or {}).get('auc'))}"
    if stage.kind in ("ab", "decide"):
        return f"decision {o.get('decision')}"
    return ""


@app.command()
@_friendly
def demo(
    spec: Annotated[str, typer.Option(help="the demo pipeline spec")] = DEMO_PIPELINE,
    # min=1: a 0 was refused as the search spec's num_samples, a field the command line never named
    trials: Annotated[Optional[int], typer.Option(min=1, help="trials of the search stage (default: the pipeline's)")] = None,
    search_epochs: Annotated[Optional[int], typer.Option(min=1, help="most epochs of one search trial")] = None,
    port: Annotated[int, typer.Option(help="HTTP port of the demo A/B experiment")] = 8000,
    ab_requests: Annotated[Optional[int], typer.Option(help="simulated requests of the A/B test (default: the pipeline's)")] = None,
    run_id: Annotated[str, typer.Option(help="run folder runs/<run-id>/")] = "demo",
    set_: StageSetOpt = None,
    address: AddressOpt = None,
) -> None:
    """The whole lifecycle on MovieLens (the pipeline spec): data, baseline, search, A/B test, decision, report."""
    from .pipeline_spec import load_pipeline

    sets = demo_sets(spec, port, trials, search_epochs, ab_requests) + list(set_ or [])  # STAGE.field=value, as `rayload run --set`
    pipeline = load_pipeline(spec, sets)
    console.rule(f"[bold]rayload demo: {pipeline.name}")
    result = run_with_progress(pipeline, run_id, address)
    print_run(result)
    if not result.ok:
        raise typer.Exit(exit_code(result))
    path = _write_report(result.run_dir)
    print_summary(result, path)


def demo_sets(spec: str, port: int, trials: int | None = None, search_epochs: int | None = None,
              ab_requests: int | None = None) -> list[str]:
    """The demo's options as `--set` items for the pipeline's stages of each kind, whatever their
    names: the port for its A/B stages (none without one), the search options for its tune stages."""
    from .errors import RayloadError
    from ._stage_runners import _search
    from .pipeline_spec import load_pipeline_spec

    pipeline = load_pipeline_spec(spec)
    stages = pipeline.stages
    named = {kind: [s.name for s in stages if s.kind == kind] for kind in ("tune", "ab")}
    asked = {"tune": {"--trials": trials, "--search-epochs": search_epochs}, "ab": {"--ab-requests": ab_requests}}
    for kind, options in asked.items():
        given = [name for name, value in options.items() if value is not None]
        if given and not named[kind]:
            raise RayloadError(f"{' and '.join(given)}: the pipeline {spec} has no {kind} stage")
    sets = []
    for name in named["ab"]:
        # `is not None`: a 0 was dropped for the pipeline's own value; given, the spec refuses it by name
        sets += [f"{name}.serving.port={port}"] + ([f"{name}.simulate.requests={ab_requests}"] if ab_requests is not None else [])
    for stage in (s for s in stages if s.kind == "tune"):
        name = stage.name
        if trials is not None:  # startup_trials is for Bayesian searches only (a random or grid search ignores it, saying so)
            bayes = _search(pipeline, stage).strategy == "bayes"
            sets += [f"{name}.num_samples={trials}"] + ([f"{name}.startup_trials={max(2, trials // 2)}"] if bayes else [])
        sets += [f"{name}.scheduler.max_epochs={search_epochs}"] if search_epochs is not None else []
    return sets


def print_summary(result, report_path: str) -> None:
    from .report import baseline_label, baseline_of

    by_kind = {s.kind: s.outputs for s in result.stages}
    prep, search, decided = (by_kind.get(k, {}) for k in ("prepare", "tune", "decide"))
    base_name, base = baseline_of([{"name": s.name, "kind": s.kind, "outcome": s.outcome, "outputs": s.outputs} for s in result.stages])
    best = search.get("best") or {}
    console.rule("[bold]summary")
    console.print(f"data: {prep.get('input_rows')} ratings, {prep.get('good_rows')} good, {prep.get('quarantined_rows')} quarantined")
    console.print(f"{escape(baseline_label(base_name))}: val AUC {_g((base.get('val') or {}).get('val_auc'))}; test AUC {_g((base.get('test') or {}).get('auc'))}")
    console.print(f"best tuned (trial {best.get('number')} of {search.get('trials')}): {search.get('metric', 'val_auc')} {_g(best.get('value'))}; "
                  f"test AUC {_g((best.get('test') or {}).get('auc'))}; configuration {best.get('spec')}")
    if decided:
        arms = "; ".join(f"{arm} CTR {_g(a['ctr'])} [{_g(a['ctr_ci'][0])}, {_g(a['ctr_ci'][1])}] over {a['units']} users"
                         for arm, a in decided["arms"].items())

        lift = (f"lift of {decided.get('challenger')} over {decided.get('champion')} {decided['lift']:+.2%}"
                if decided.get("lift") is not None else "lift n/a")
        console.print(escape(f"A/B decision: {decided['decision']} ({'; '.join(decided['reasons'])}); {arms}; {lift}; "
                             f"sequential p {_g(decided.get('sequential_p'))}; {decided['action']}"))
    console.print(f"report: [bold]{escape(report_path)}[/]")


def _write_report(run_dir: str) -> str:
    from .report import write_report

    return write_report(run_dir)


@app.command()
@_friendly
def report(
    run: Annotated[str, typer.Argument(help="pipeline run id or folder")],
    out: Annotated[Optional[str], typer.Option(help="default: report.html in the run folder")] = None,
) -> None:
    """One HTML page: training curves, the search history, A/B CTR per arm with bands, the decision."""
    from .report import write_report
    from .stages import load_run

    _out_file(out)
    run_dir, _ = load_run(run)
    console.print(f"wrote {escape(write_report(run_dir, out))}")


@app.command()
@_friendly
def submit(
    spec: Annotated[str, typer.Argument(help="a spec in jobs/ or tune/, run with `rayload run` on the cluster")],
    address: Annotated[str, typer.Option(help="the cluster's job API, e.g. http://127.0.0.1:8265 (ray dashboard cluster.yaml)",
                                         envvar="RAY_API_SERVER_ADDRESS")],
    set_: StageSetOpt = None,
    wait: Annotated[bool, typer.Option(help="follow the job's logs until it ends")] = True,
    home: Annotated[Optional[str], typer.Option(
        help="the job's RAYLOAD_HOME on the cluster, an absolute path there (default: the cluster's own, "
             "which cluster.yaml sets, else ~/rayload-runs on the head)", envvar="RAYLOAD_JOB_HOME")] = None,
) -> None:
    """Submit a spec as a Ray job: checked here first, this directory uploaded (without runs/, .venv/, caches), the token sent."""
    from .ops import submit as run

    job_id, status = run(spec, address, list(set_ or []), wait=wait, home=home,
                         on_log=lambda text, end="": console.out(text, end=end, highlight=False))
    console.print(f"job [bold]{job_id}[/]: {status}")
    if wait and status != "SUCCEEDED":
        raise typer.Exit(1)


@app.command()
@_friendly
def doctor(
    address: AddressOpt = None,
    specs: Annotated[str, typer.Option(help="folder of specs whose GPUs and databases to check")] = "jobs",
    serve_port: Annotated[int, typer.Option(help="the Serve HTTP port to check", min=1, max=65535)] = 8000,
) -> None:
    """Pass/fail: Ray reachable, versions on every node, token auth, GPUs for the specs, shared storage, Serve port, databases."""
    from .ops import doctor as run

    checks = run(address, specs, serve_port)
    table = Table("check", "result", "detail", title="rayload doctor")
    for c in checks:
        table.add_row(escape(c.name), "[green]pass" if c.ok else "[red]FAIL", escape(c.detail))
    console.print(table)
    if not all(c.ok for c in checks):
        raise typer.Exit(1)


cluster_app = typer.Typer(no_args_is_help=True, help="cluster.yaml: lint, local fake multi-node config.")
app.add_typer(cluster_app, name="cluster")


@cluster_app.command("lint")
@_friendly
def cluster_lint(path: Annotated[str, typer.Argument(help="the `ray up` file")] = "cluster.yaml") -> None:
    """Validate against Ray's cluster schema and check the secure defaults; exits 2 naming each failing field."""
    from .cluster import check

    check(path)
    console.print(f"[green]ok[/] {escape(path)}: Ray's cluster schema, token auth, dashboard on loopback, no Ray port or SSH open to the internet")


@cluster_app.command("local")
@_friendly
def cluster_local(
    path: Annotated[str, typer.Argument(help="the `ray up` file")] = "cluster.yaml",
    gcs_address: Annotated[str, typer.Option(help="host:port the fake head's GCS will listen on")] = "127.0.0.1:6380",
    out: Annotated[str, typer.Option(help="where to write the autoscaling config (JSON)")] = "fake_cluster.json",
) -> None:
    """Write a fake multi-node autoscaling config with cluster.yaml's node types (RAY_FAKE_CLUSTER=1 ray start --head ...)."""
    import json

    from .cluster import gcs_port, local_config, node_type_issues, read_cluster
    from .errors import SpecError

    _out_file(out)
    port = gcs_port(gcs_address)
    cluster = read_cluster(path)
    if issues := node_type_issues(cluster):
        raise SpecError(issues, file=path)
    config = local_config(cluster, gcs_address)
    with open(out, "w") as f:
        json.dump(config, f, indent=1)
    console.print(escape(f"wrote {out}; start it with: RAY_FAKE_CLUSTER=1 RAY_AUTH_MODE=token ray start --head "
                         f"--port={port} --num-cpus=0 --autoscaling-config={out}"))
