"""`rayload` command line: thin commands over the SDK. Errors a user caused exit 2, no traceback."""

from __future__ import annotations

import functools
import logging
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape as _e  # user text (paths, values, messages) is no style tag: '[/x]' raised, '[draft]' vanished
from rich.table import Table

from .errors import RayloadError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Train, tune and A/B-test recommendation models on Ray.")
data_app = typer.Typer(no_args_is_help=True, help="Data utilities.")
app.add_typer(data_app, name="data")
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)

SpecArg = Annotated[str, typer.Argument(help="job spec YAML")]
AnySpecArg = Annotated[str, typer.Argument(help="spec YAML: a job, search, A/B or pipeline spec")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="override a field: section.field=value (repeatable)")]
# A pipeline's fields are one level deeper: its stage name comes first (train.train.epochs=3).
StageSetOpt = Annotated[Optional[list[str]], typer.Option(
    "--set", help="override a field of one stage: STAGE.field=value, e.g. train.train.epochs=3 (repeatable)")]
AddressOpt = Annotated[Optional[str], typer.Option("--address", help="Ray cluster address; default: an embedded local Ray")]


def _friendly(fn):
    """Print user errors (bad spec, bad data) as messages and exit 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RayloadError as exc:
            err_console.print(f"[bold red]error:[/] {_e(str(exc))}", highlight=False, markup=True)
            for note in getattr(exc, "__notes__", ()):  # where it happened (which fold of a k-fold run)
                err_console.print(note, highlight=False, markup=False)
            raise typer.Exit(2) from None

    return wrapper


def _out_file(path: str | None, option: str = "--out") -> None:
    """A file a command will write, checked before it works: a missing folder was a traceback
    after the work was done (an evaluation's metrics lost with it)."""
    import os

    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise RayloadError(f"{option} {path}: a folder; give a file name")
    if not os.path.isdir(folder):
        raise RayloadError(f"{option} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise RayloadError(f"{option} {path}: the folder {folder} is not writable")


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="log at INFO level")] = False) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


@app.command()
@_friendly
def validate(spec: AnySpecArg, set_: SetOpt = None) -> None:
    """Check a spec (job, search, A/B or pipeline) and a job's data schema without running anything."""
    from ._spec_load import read_yaml, spec_kind

    kind = spec_kind(read_yaml(spec))
    if kind != "job":  # each kind through its own loader (a job loader listed a search spec's 13 fields as wrong)
        from .ab_spec import load_ab_spec
        from .pipeline_spec import load_pipeline
        from .search_job import load_search_spec

        {"search": load_search_spec, "ab": load_ab_spec, "pipeline": load_pipeline}[kind](spec, set_ or [])
        console.print(f"[green]ok[/] {_e(spec)}: {kind} spec valid")
        return
    from .data.checks import check_data_schema
    from .spec import load_spec

    job = load_spec(spec, set_ or [])
    files = check_data_schema(job)
    console.print(f"[green]ok[/] {_e(spec)}: spec valid, {files} input file(s), schema matches data.columns")


@app.command()
@_friendly
def preprocess(spec: SpecArg, out: Annotated[Optional[str], typer.Option(help="output folder (default: the shard cache)")] = None, set_: SetOpt = None, address: AddressOpt = None) -> None:
    """Validate, split, fit the preprocessor on train and write preprocessed shards."""
    from .spec import load_spec

    job = load_spec(spec, set_ or [])
    result = _preprocess_with_status(job, out, address)
    print_preprocess_summary(result)


def _preprocess_with_status(job, out, address):
    from .data.pipeline import preprocess as run

    with console.status(f"preprocessing {job.name}...") as status:
        return run(job, out=out, address=address, on_stage=lambda text: status.update(f"{job.name}: {text}..."))


def print_preprocess_summary(result) -> None:
    c = result.counts
    state = "reused from cache" if result.cached else "written"
    console.print(f"[bold]{_e(result.out_dir)}[/] ({state})")
    counts = Table("input", "good", "quarantined", "train", "val", "test", title="rows")
    w = c.get("written", c["split_rows"])
    counts.add_row(*map(str, [c["input"], c["good"], c["quarantined"], w["train"], w["val"], w["test"]]))
    console.print(counts)
    for reason, n in sorted(c["reasons"].items(), key=lambda kv: -kv[1])[:10]:
        console.print(f"  quarantined {n}: {_e(reason)}")
    console.print(feature_table(result.features))


def feature_table(features) -> Table:
    table = Table("column", "kind", "output", "null rate", "details", title="features (fitted on train)")
    for n in features.numeric:
        s = n.stats
        kind = f"numeric ({'bucketised' if n.boundaries is not None else n.scale}{', log' if n.log else ''})"
        out = f"id[{n.cardinality}]" if n.boundaries is not None else "float32"
        detail = f"mean={_g(s.get('mean'))} std={_g(s.get('std'))} impute={_g(n.impute_value)}"
        table.add_row(_e(n.name), kind, out, f"{s.get('null_rate', 0):.3f}", _e(detail))
    for cat in features.categorical:
        s = cat.stats
        out = ("bag" if cat.multi else "onehot" if cat.encode == "onehot" else "id") + f"[{cat.cardinality}]"
        detail = f"vocab={s.get('vocab_size')} distinct={s.get('distinct')} coverage={_g(s.get('coverage'))}" if cat.encode != "hash" else f"{cat.buckets} hash buckets"
        table.add_row(_e(cat.name), f"{'multi_' if cat.multi else ''}categorical ({cat.encode})", out, f"{s.get('null_rate', 0):.3f}", _e(detail))
    for x in features.crosses:
        table.add_row(_e(x.name), "cross (hash)", f"id[{x.buckets}]", "-", _e(" x ".join(x.columns)))
    return table


def _g(v) -> str:
    return "-" if v is None else f"{v:.4g}"


@app.command()
@_friendly
def train(
    spec: SpecArg, set_: SetOpt = None, address: AddressOpt = None,
    run_name: Annotated[Optional[str], typer.Option(help="resume this run if it exists, else start it")] = None,
    kfold: Annotated[Optional[int], typer.Option(help="train K times (k-fold) and report mean and std")] = None,
) -> None:
    """Preprocess and train; ends with the metrics and the best checkpoint's path."""
    from .spec import load_spec
    from .train.trainer import fit, kfold as run_kfold

    import json

    # quoted: the name as given (20240601, 2024-06-01 and yes stay text, not a number, a date, True)
    # `is not None`: --run-name '' went unchecked (the spec's pattern refuses it) and trained a fresh run
    overrides = list(set_ or []) + ([f"train.run_name={json.dumps(run_name)}"] if run_name is not None else [])
    if kfold is not None and kfold < 2:  # 0 trained once without folds, 1 and -1 raised tracebacks
        raise typer.BadParameter(f"k-fold cross-validation needs at least 2 folds (got {kfold})", param_hint="--kfold")
    job = load_spec(spec, overrides)
    if kfold is not None:
        result = run_kfold(job, kfold, address=address)
        table = Table("metric", "mean", "std", title=f"{kfold}-fold cross-validation",
                      caption="val_*: each fold's best epoch, picked on the same rows (optimistic); "
                              "test_*: that checkpoint on the held-out test rows, the same for every fold")
        for key, mean in result.mean.items():
            digits = 1 if key.endswith("rows") else 4  # a mean row count, not 1206.6667
            table.add_row(key, f"{mean:.{digits}f}", f"{result.std[key]:.{digits}f}")
        console.print(table)
        return
    with console.status(f"training {job.name} ({job.model.name}, {job.train.epochs} epochs)..."):
        result = fit(job, address=address)
    print_training(result)


def print_training(result) -> None:
    # The task's own validation metrics: a regression run is ranked by val_rmse, which the table
    # (val auc and val logloss, empty for it) never showed.
    shown = [k for k in ("val_auc", "val_logloss", "val_rmse") if any(h.get(k) is not None for h in result.history)]
    shown = shown or ["val_auc", "val_logloss"]
    table = Table("epoch", "train loss", *(k.replace("_", " ") for k in shown), "samples/s", title=f"run {result.run_name}")
    for h in result.history:
        table.add_row(str(h["epoch"]), _g(h.get("train_loss")), *(_g(h.get(k)) for k in shown), _g(h.get("samples_per_s")))
    console.print(table)
    if result.test:
        console.print(metrics_table(result.test, "test metrics (best checkpoint)"))
    console.print(f"best checkpoint: [bold]{_e(result.checkpoint)}[/]")


def metrics_table(metrics: dict, title: str) -> Table:
    table = Table("metric", "value", title=title)
    for key, value in metrics.items():
        if value is not None:
            table.add_row(key, _g(value) if isinstance(value, float) else str(value))
    return table


@app.command()
@_friendly
def evaluate(
    spec: SpecArg, checkpoint: Annotated[str, typer.Option(help="checkpoint directory")],
    split: Annotated[str, typer.Option(help="train, val or test")] = "test",
    out: Annotated[Optional[str], typer.Option(help="write the metrics as JSON here")] = None,
    set_: SetOpt = None, address: AddressOpt = None,
) -> None:
    """Offline metrics (AUC, log loss, calibration) of a checkpoint on a split of the spec's data."""
    from .evaluate import evaluate_split
    from .spec import load_spec

    job = load_spec(spec, set_ or [])
    _out_file(out)
    metrics = evaluate_split(job, checkpoint, split, address=address)
    console.print(metrics_table(metrics.to_dict(), f"{split} metrics"))
    if out:
        from .paths import write_json

        write_json(out, metrics.to_dict())  # whole or not at all: an earlier good file is never cut short
        console.print(f"wrote {_e(out)}")


@app.command()
@_friendly
def tune(
    spec: Annotated[str, typer.Argument(help="search spec YAML (tune/*.yaml), or `status` followed by a run")],
    run: Annotated[Optional[str], typer.Argument(help="with `status`: the run name or folder")] = None,
    resume: Annotated[Optional[str], typer.Option(help="continue this interrupted search (run name or folder)")] = None,
    set_: SetOpt = None, address: AddressOpt = None,
) -> None:
    """Search a job spec's hyperparameters (`rayload tune SPEC`), or show a search (`rayload tune status RUN`)."""
    from . import tuning

    if spec == "status":
        if not run:
            raise typer.BadParameter("rayload tune status RUN: name the run (or its folder)")
        if resume or set_:  # they were ignored
            raise typer.BadParameter("rayload tune status RUN takes no --resume or --set", param_hint="--resume/--set")
        print_search_status(tuning.status(run))
        return
    if run is not None:  # `rayload tune SPEC RUN` started a new search, RUN dropped: a resume is --resume RUN
        raise typer.BadParameter(f"a second argument ({run!r}) is only for `rayload tune status RUN`; to continue a "
                                 f"search: rayload tune {spec} --resume {run}", param_hint="RUN")
    with console.status(f"searching {_e(spec)}..."):
        result = tuning.tune(spec, resume=resume, address=address, overrides=set_ or [])
    print_trials(result.trials, result.metric, f"search {result.run_name}")
    counts = ", ".join(f"{n} {state}" for state, n in result.counts().items())
    console.print(f"trials: {counts}; ended: {_e(result.ended)}; run folder [bold]{_e(result.run_dir)}[/]")
    if result.best:
        console.print(f"best: trial {result.best['number']} {result.metric}={_g(result.best_value)}; train it with "
                      f"[bold]rayload train {_e(result.best_spec)}[/]")
    for path in result.plots:
        console.print(f"plot: {_e(path)}")
    if not result.best:  # it said nothing and exited 0: no best line, no best.yaml (a pipeline's tune stage fails)
        failed = any(r["state"] == "fail" for r in result.trials)
        console.print(f"[bold red]no trial finished with a {_e(result.metric)} value[/]: no best.yaml written; see trials.csv"
                      + (f" and Ray Tune's error files in {_e(result.run_dir)}" if failed else
                         f" in {_e(result.run_dir)} (every trial was stopped before it finished)"))
        raise typer.Exit(1)


def print_trials(rows: list[dict], metric: str, title: str, limit: int = 30) -> None:
    names = sorted({k for r in rows for k in r["params"]})
    from rich.table import Column

    # a searched path folds onto two lines rather than losing its end (model.embedding_…)
    table = Table("trial", "state", metric, "epochs", "seconds", *[Column(n, overflow="fold") for n in names], title=_e(title))
    for r in rows[:limit]:
        table.add_row(str(r["number"]), r["state"], _g(r["value"]), "-" if r["epochs"] is None else str(r["epochs"]), _g(r["seconds"]),
                      *[_e(_param(r["params"].get(n))) for n in names])
    console.print(table)
    if len(rows) > limit:
        console.print(f"... and {len(rows) - limit} more trials (trials.csv in the run folder has them all)")


def _param(value) -> str:
    return _g(value) if isinstance(value, float) else str(value)


def print_search_status(state: dict) -> None:
    done = sum(r["state"] in ("complete", "pruned", "fail") for r in state["trials"])
    print_trials(state["trials"], state["metric"], f"{state['run_dir']}: {state['state']}, {done} of {state['total']} trials finished")
    if state.get("ended"):
        console.print(f"ended: {_e(state['ended'])}" + (f" after {state['spent_s']:.0f} s" if state.get("spent_s") is not None else ""))
    if state["best"]:
        # "interrupted (driver gone; ...)" too: a search that can still be resumed has a best so far
        so_far = " so far" if state["state"].startswith(("running", "preparing", "interrupted")) else ""
        console.print(f"best{so_far}: trial {state['best']['number']} {state['metric']}={_g(state['best']['value'])}")


@data_app.command("synth")
@_friendly
def synth(
    out: Annotated[str, typer.Option(help="output folder or URI")],
    rows: Annotated[int, typer.Option(help="rows to generate")] = 1_000_000,
    numeric: Annotated[int, typer.Option(help="numeric columns I1..I<n>")] = 13,
    categorical: Annotated[int, typer.Option(help="categorical columns C1..C<n> (cardinalities 10..100,000, log-spaced)")] = 26,
    shard_rows: Annotated[int, typer.Option(help="rows per Parquet shard")] = 250_000,
    missing_rate: Annotated[float, typer.Option(help="share of nulls in each feature column")] = 0.05,
    zipf: Annotated[float, typer.Option(help="Zipf exponent of the categorical IDs' popularity")] = 1.1,
    seed: Annotated[int, typer.Option(help="the data set's seed (the same seed gives the same rows)")] = 0,
) -> None:
    """Write the seeded Criteo-like synthetic-ctr data set as Parquet shards."""
    from .data.synthetic import SynthParams, write_synthetic

    if not out.strip():  # '' wrote the shards into the working folder and said "to " (blank)
        raise typer.BadParameter("give a folder or URI", param_hint="--out")
    try:
        params = SynthParams(rows=rows, numeric=numeric, categorical=categorical, shard_rows=shard_rows, missing_rate=missing_rate, zipf=zipf, seed=seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    with console.status(f"generating {rows:,} rows..."):
        result = write_synthetic(out, params)
    console.print(f"[green]wrote[/] {len(result.files)} shard(s), {result.rows:,} rows to {_e(result.out_dir)}")
    console.print(f"positive rate {result.positive_rate:.4f}; Bayes-optimal AUC {result.bayes_auc:.4f} (the ceiling for any model)")


def main() -> None:
    from . import _cli_ab, _cli_life, _cli_ops  # noqa: F401  (register `serve`, `ab`, `compress`, `retrain`, `run`, `demo`, ...)

    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
