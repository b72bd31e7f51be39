"""What a search leaves behind: the trials table, best.yaml and Optuna's plots."""

from __future__ import annotations

import csv
import logging
import math
import os

import optuna
import yaml
from optuna.trial import TrialState

from ._study import decode

log = logging.getLogger(__name__)
_ORDER = {TrialState.COMPLETE: 0, TrialState.PRUNED: 1, TrialState.RUNNING: 2, TrialState.WAITING: 3, TrialState.FAIL: 4}


def trial_rows(study: optuna.Study) -> list[dict]:
    """One row per trial: finished trials best first, then stopped early, running, failed."""
    sign = -1 if study.direction == optuna.study.StudyDirection.MAXIMIZE else 1
    rows = []
    for t in study.get_trials(deepcopy=False):
        summary = t.user_attrs.get("rayload", {})
        value = t.value if t.state == TrialState.COMPLETE else summary.get("best_value", t.value)
        epochs = summary.get("epochs_done")
        if not summary and t.intermediate_values:  # a running trial: its epochs so far (its summary comes when it ends)
            reported = [v for v in t.intermediate_values.values() if math.isfinite(v)]
            value = (max if sign < 0 else min)(reported) if reported else value
            epochs = max(t.intermediate_values)
        duration = t.duration.total_seconds() if t.duration else None
        rows.append({"number": t.number, "state": t.state.name.lower(), "value": value,
                     "epochs": epochs, "seconds": duration,
                     "params": {k: decode(v) for k, v in t.params.items()}, "checkpoint": summary.get("checkpoint")})
    # Within a state, trials without a value (pruned before their first result) come last in either mode.
    return sorted(rows, key=lambda r: (_ORDER.get(TrialState[r["state"].upper()], 5), r["value"] is None,
                                       sign * r["value"] if r["value"] is not None else 0.0, r["number"]))


def best_row(rows: list[dict]) -> dict | None:
    return next((r for r in rows if r["state"] == "complete" and r["value"] is not None), None)


def write_csv(rows: list[dict], path: str) -> None:
    names = sorted({k for r in rows for k in r["params"]})
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["number", "state", "value", "epochs", "seconds", *names, "checkpoint"])
        for r in rows:
            out.writerow([r["number"], r["state"], r["value"], r["epochs"], r["seconds"],
                          *[r["params"].get(n) for n in names], r["checkpoint"]])


def write_best_spec(raw: dict, params: dict, path: str, header: list[str]) -> None:
    """A complete job spec: the base (with the search's fixed changes) plus the best values."""
    from .search_job import job_from

    job = job_from(raw, params)  # validates; raises if the best values do not make a job spec
    body = _with_params(raw, _as_validated(job, params))
    body["name"] = job.name
    body.get("train", {}).pop("run_name", None)
    with open(path, "w") as f:
        f.write("".join(f"# {line}\n" for line in header))
        yaml.safe_dump(body, f, sort_keys=False, default_flow_style=None)


def _as_validated(job, params: dict) -> dict:
    """Each searched value as the job spec holds it: a stepped uniform range on an integer field
    draws 40.0, which the spec reads as 40, and best.yaml should say 40."""
    dumped = job.model_dump(mode="json")
    out = {}
    for path, value in params.items():
        at = dumped
        try:
            for part in path.split("."):
                at = at[int(part)] if isinstance(at, list) else at[part]
        except (KeyError, IndexError, ValueError, TypeError):  # a path the dump spells otherwise: as drawn
            at = value
        out[path] = at if type(at) is int and type(value) is float else value
    return out


def _with_params(raw: dict, params: dict) -> dict:
    import copy

    from ._spec_load import _set_path, dumped_defaults
    from .errors import SpecError
    from .spec import JobSpec

    raw, issues = copy.deepcopy(raw), []
    # as job_from builds a trial's job: an item of a list the base leaves at its default
    # (model.hidden.0) starts from that list, not from a section {'0': value}
    defaults = dumped_defaults(JobSpec, raw)
    for path, value in params.items():
        _set_path(raw, path.split("."), value, issues, defaults)
    if issues:
        raise SpecError(issues)
    return raw


def write_plots(study: optuna.Study, out_dir: str) -> list[str]:
    """Optimisation history, parameter importances, parallel coordinates (PNG); a plot that
    needs more finished trials than there are is left out with a log line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ov

    os.makedirs(out_dir, exist_ok=True)
    written = []
    complete = len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))
    for name, plot, needs in (("history", ov.plot_optimization_history, 1), ("importances", ov.plot_param_importances, 2),
                              ("parallel_coordinates", ov.plot_parallel_coordinate, 1)):
        if complete < needs:  # optuna only warns and draws empty axes: three blank PNGs were written and listed
            log.info("plot %s skipped: %d complete trial(s), it needs %d", name, complete, needs)
            continue
        try:
            ax = plot(study)
            figure = (ax.flat[0] if hasattr(ax, "flat") else ax).figure
            figure.set_size_inches(9, 5.5)
            figure.tight_layout()
            path = os.path.join(out_dir, f"{name}.png")
            figure.savefig(path, dpi=110)
            plt.close(figure)
            written.append(path)
        except (ValueError, RuntimeError, ZeroDivisionError) as exc:
            log.info("plot %s skipped: %s", name, exc)
    return written
