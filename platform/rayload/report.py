"""`rayload report RUN`: one self-contained HTML page for a pipeline run.

Plots are matplotlib PNGs inlined as data URIs (no script, no network): training curves of
the baseline and of the best trial, the search history against the baseline, the A/B
experiment's cumulative CTR per arm with bands (at 1 - analysis.alpha) and the lift, then the decision and the
run's manifest (stages, durations, versions).
"""

from __future__ import annotations

import html
import json
import math
import os

from .serve.report import _png


def write_report(run_dir: str, out: str | None = None) -> str:
    with open(os.path.join(run_dir, "manifest.json")) as f:
        manifest = json.load(f)
    path = out or os.path.join(run_dir, "report.html")
    with open(path, "w") as f:
        f.write(render(manifest))
    return path


def _outputs(manifest: dict, kind: str) -> dict:
    found = [s["outputs"] for s in manifest["stages"] if s["kind"] == kind and s["outcome"] in ("ok", "skipped")]
    return found[-1] if found else {}


def baseline_of(stages: list[dict]) -> tuple[str, dict]:
    """(name, outputs) of a pipeline's baseline training: its finished train stage named
    `baseline`, else its first one. The last was taken, so a pipeline training two models (a
    champion and a challenger) reported the second's figures as the baseline's."""
    trains = [s for s in stages if s["kind"] == "train" and s["outcome"] in ("ok", "skipped")]
    chosen = next((s for s in trains if s["name"] == "baseline"), trains[0] if trains else None)
    return (chosen["name"], chosen["outputs"]) if chosen else ("baseline", {})


def baseline_label(name: str) -> str:
    return "baseline" if name == "baseline" else f"baseline ({name})"


def _num(value, fmt: str = ".4f") -> str:
    """A figure, or "-" where there is none (None, or NaN: an arm with no exposures yet)."""
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def training_plot(curves: dict[str, list[dict]]) -> str | None:
    """Train loss and validation AUC per epoch, one line per run."""
    curves = {k: v for k, v in curves.items() if v}
    if not curves:
        return None
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    for name, history in curves.items():
        epochs = [h["epoch"] for h in history]
        left.plot(epochs, [h.get("train_loss") for h in history], marker="o", label=name)
        right.plot(epochs, [h.get("val_auc") for h in history], marker="o", label=name)
    left.set(xlabel="epoch", ylabel="train loss", title="training loss")
    right.set(xlabel="epoch", ylabel="validation AUC", title="validation AUC")
    right.legend()
    png = _png(fig)
    plt.close(fig)
    return png


def best_so_far(values: list[float], mode: str = "max") -> list[float]:
    """The best value up to each point: the highest for mode max, the lowest for min (logloss)."""
    pick = min if mode == "min" else max
    out, run = [], None
    for y in values:
        run = y if run is None else pick(run, y)
        out.append(run)
    return out


def best_line(trials: list[dict], mode: str = "max") -> tuple[list, list]:
    """The best-so-far line's points: over the complete trials, as the search reports its best
    (a pruned trial's intermediate value drew it above the best trial the report named)."""
    complete = sorted((t for t in trials if t["state"] == "complete" and t.get("value") is not None), key=lambda t: t["number"])
    return [t["number"] for t in complete], best_so_far([t["value"] for t in complete], mode)


def search_plot(trials: list[dict], baseline: float | None, metric: str, mode: str = "max") -> str | None:
    """Each trial's value in trial order and the best so far (in the search's mode), against the baseline."""
    done = sorted((t for t in trials if t.get("value") is not None), key=lambda t: t["number"])
    if not done:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs, ys = [t["number"] for t in done], [t["value"] for t in done]
    colours = {"complete": "tab:blue", "fail": "tab:red"}
    ax.scatter(xs, ys, c=[colours.get(t["state"], "tab:orange") for t in done],
               label="trial (orange: stopped early, its best epoch; red: failed)")
    line = best_line(done, mode)
    if line[0]:
        ax.step(*line, where="post", color="tab:green", label="best complete trial so far")
    if baseline is not None:
        ax.axhline(baseline, color="grey", ls="--", label="baseline")
    ax.set(xlabel="trial", ylabel=metric, title="search history")
    ax.legend(fontsize=8)
    png = _png(fig)
    plt.close(fig)
    return png


def _img(name: str, png: str | None) -> str:
    return f'<figure><img alt="{name}" src="data:image/png;base64,{png}"></figure>' if png else f"<p>no data for {name}</p>"


def _best_trial_history(best: dict) -> list[dict]:
    if not best.get("checkpoint"):
        return []
    from .train.checkpoint import read_history

    try:
        return read_history(best["checkpoint"])
    except (OSError, RuntimeError, KeyError, ValueError):  # ValueError: a history.json that is not JSON
        return []


def _ab_section(ab: dict, decided: dict) -> str:
    if not ab.get("run_dir") or not os.path.exists(os.path.join(ab["run_dir"], "serve.json")):
        return "<p>no A/B experiment in this run</p>"
    from .serve.control import analysis_for, events_of
    from .serve.report import drift_table, lift_text, plots

    result = analysis_for(ab["run_dir"])
    rows = "".join(f"<tr><td>{html.escape(a.arm)}</td><td>{a.units}</td><td>{a.exposures}</td><td>{a.clicks}</td>"
                   f"<td>{_num(a.ctr, '.4f')}</td><td>[{_num(a.ctr_ci[0], '.4f')}, {_num(a.ctr_ci[1], '.4f')}]</td></tr>"
                   for a in result.arms)
    # lift_text: the lift and its interval (MOVER-R: defined with no challenger clicks); none at a champion CTR of 0
    roles = f"{html.escape(str(result.challenger))} over {html.escape(result.champion)}: " if result.challenger else ""
    lift = "" if result.diff is None else (f"<p>{roles}<b>{html.escape(lift_text(result))}</b>; "
                                           f"fixed-horizon p {_num(result.z_p_value, '.4g')}; sequential p {_num(result.sequential_p, '.4g')}; "
                                           f"sample ratio p {_num(result.srm_p, '.4g')}</p>")
    images = "".join(_img(name, png) for name, png in plots(result, events_of(ab["run_dir"])).items())
    return (f"<table><tr><th>arm</th><th>users</th><th>exposures</th><th>clicks</th><th>CTR</th><th>{result.ci_label}</th></tr>{rows}</table>"
            f"{lift}{drift_table(result.drift)}{images}")


def render(manifest: dict) -> str:
    search, ab, decided = (_outputs(manifest, k) for k in ("tune", "ab", "decide"))
    base_name, base = baseline_of(manifest["stages"])
    best = search.get("best") or {}
    # every training stage by its name (the others were left out), then the best trial
    curves = {s["name"]: _history(s["outputs"]) for s in manifest["stages"] if s["kind"] == "train" and s["outcome"] in ("ok", "skipped")}
    curves[f"best trial {best.get('number')}"] = _best_trial_history(best)
    metric = search.get("metric", "val_auc")
    mode = search.get("mode") or _metric_mode(metric)
    base_val = (base.get("val") or {}).get(metric)  # the baseline on the search's own metric
    # a failed stage's error beside it: the report showed "failed" and, for a search, "0 trials ({})"
    stages = "".join(f"<tr><td>{html.escape(s['name'])}</td><td>{s['kind']}</td><td>{s['outcome']}</td><td>{s['seconds']:.1f}</td>"
                     f"<td>{html.escape(str(s.get('error') or ''))}</td></tr>" for s in manifest["stages"])
    decision = decided.get("decision") or ab.get("decision") or "none"
    reasons = html.escape("; ".join(decided.get("reasons") or ab.get("reasons") or []))
    versions = ", ".join(f"{k} {v}" for k, v in manifest.get("versions", {}).items())
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>rayload run {html.escape(manifest['run_id'])}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}} td,th{{padding:4px 10px;border-bottom:1px solid #ddd;text-align:left}}
.key{{font-size:1.2em}} img{{max-width:100%}}</style></head><body>
<h1>rayload run {html.escape(manifest['run_id'])} ({html.escape(manifest['pipeline'])})</h1>
<p class="key">{html.escape(baseline_label(base_name))} test AUC <b id="baseline-auc">{_num((base.get('test') or {}).get('auc'))}</b> ·
best tuned test AUC <b id="best-auc">{_num((best.get('test') or {}).get('auc'))}</b> ({html.escape(metric)} {_num(best.get('value'))}, trial {best.get('number')}) ·
A/B decision <b id="decision">{html.escape(decision)}</b></p>
<p>{reasons}{' · ' + html.escape(decided['action']) if decided.get('action') else ''}</p>
<h2>Training curves</h2>{_img('training curves', training_plot(curves))}
<h2>Search</h2><p>{search.get('trials', 0)} trials ({html.escape(json.dumps(search.get('counts', {})))}); best parameters
<code>{html.escape(json.dumps(best.get('params')))}</code></p>{_img('search history', search_plot(search.get('history', []), base_val, metric, mode))}
<h2>A/B experiment</h2>{_ab_section(ab, decided)}
<h2>Run</h2><table><tr><th>stage</th><th>kind</th><th>outcome</th><th>seconds</th><th>error</th></tr>{stages}</table>
<p>git {html.escape(str(manifest.get('git_commit')))}; {html.escape(versions)}; started {manifest.get('started')}, last stage {manifest.get('finished')}</p>
</body></html>"""


def _metric_mode(metric: str) -> str:
    """A run recorded before tune stages kept their mode: the metric's own direction."""
    from .search_spec import metric_mode

    return metric_mode(metric) or "max"


def _history(train_outputs: dict) -> list[dict]:
    """The baseline's whole history (history.json beside its run), not only up to its best epoch."""
    checkpoint = train_outputs.get("checkpoint")
    if not checkpoint:
        return []
    path = train_outputs.get("history") or os.path.join(os.path.dirname(os.path.dirname(checkpoint)), "history.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return _best_trial_history({"checkpoint": checkpoint})
