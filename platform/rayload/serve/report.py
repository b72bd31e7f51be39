"""`rayload ab report`: one self-contained HTML page (plots inlined as PNG) with the
cumulative CTR per arm and its band (at 1 - analysis.alpha), the lift over time, the arm table and the decision."""

from __future__ import annotations

import base64
import html
import io
import math

from .analysis import Analysis, points


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def plots(result: Analysis, frame=None) -> dict[str, str]:
    """PNG (base64) per plot name; empty when there is no traffic yet. `frame`: the events, for
    the lift within weight periods (lift_over_time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not result.timeline:
        return {}
    t0 = result.first_ts if result.first_ts is not None else result.timeline[0]["ts"]
    xs = [(row["ts"] - t0) / 60 for row in result.timeline]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for arm in [a.arm for a in result.arms]:
        pts = [(x, row[arm]) for x, row in zip(xs, result.timeline) if row[arm]["ctr"] is not None]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1]["ctr"] for p in pts], label=f"arm {arm}")  # matplotlib hides a label starting "_"
        ax.fill_between([p[0] for p in pts], [p[1]["low"] for p in pts], [p[1]["high"] for p in pts], alpha=0.2)
    ax.set(xlabel="minutes since the first exposure", ylabel="cumulative CTR", title=f"CTR per arm ({result.ci_label.removesuffix(' CI')} band over units, as the table's)")
    ax.legend()
    out = {"ctr": _png(fig)}
    plt.close(fig)
    if result.challenger:
        lifts = lift_over_time(result, frame)
        if lifts:
            fig, ax = plt.subplots(figsize=(7, 3))
            ax.plot([(ts - t0) / 60 for ts, _ in lifts], [100 * lift for _, lift in lifts], color="tab:purple")
            ax.axhline(0, color="grey", lw=0.8)
            how = ("within weight periods, as the analysis compares them" if frame is not None
                   else "raw ratio of the pooled CTRs: it mixes ramp periods")
            ax.set(xlabel="minutes since the first exposure", ylabel="lift %", title=f"{result.challenger} over {result.champion} ({how})")
            out["lift"] = _png(fig)
            plt.close(fig)
    return out


def lift_over_time(result: Analysis, frame=None) -> list[tuple[float, float]]:
    """(time, lift) at the timeline's times. With the events (`frame`, EventReader rows): the
    lift the analysis reports, from the arms compared within each weight period (a CTR that
    drifts while the ramp moves the challenger's share is not read as an effect). Without: the
    raw ratio of the arms' cumulative CTRs, which mixes the periods."""
    champion, challenger = result.champion, result.challenger
    if frame is None:
        return [(row["ts"], row[challenger]["ctr"] / row[champion]["ctr"] - 1) for row in result.timeline
                if row[challenger]["ctr"] is not None and row[champion]["ctr"]]
    import numpy as np

    from . import stats
    from .sequential import Pairs

    ok = frame[frame["status"] == "ok"]  # as analyze counts: ok rows, a click is an outcome > 0
    pairs = Pairs.of(ok.assign(clicked=(ok["outcome"] > 0).astype(float)), champion, challenger)
    times = [row["ts"] for row in result.timeline]
    looks = np.searchsorted(pairs.ts, times, side="right")
    points = [(t, stats.comparison(est).lift if est is not None else None) for t, est in zip(times, pairs.at_looks(looks))]
    return [(t, lift) for t, lift in points if lift is not None]


def _n(value, spec: str) -> str:
    """A figure as `spec` formats it, or n/a where it has none (NaN: an arm with no exposures yet)."""
    return format(value, spec) if value is not None and math.isfinite(value) else "n/a"


def render(result: Analysis, frame=None) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(a.arm)}</td><td>{result.weights.get(a.arm, 0):.2f}</td><td>{a.units}</td><td>{a.exposures}</td>"
        f"<td>{a.clicks}</td><td>{_n(a.ctr, '.4f')}</td><td>[{_n(a.ctr_ci[0], '.4f')}, {_n(a.ctr_ci[1], '.4f')}]</td>"
        f"<td>{_n(a.error_rate, '.2%')}</td><td>{_n(a.p99_ms, '.1f')}</td>"
        f"<td>{'ok' if a.guardrail_ok else html.escape('; '.join(a.guardrail_reasons))}</td></tr>"
        for a in result.arms)
    images = "".join(f'<p><img alt="{name}" src="data:image/png;base64,{data}"></p>' for name, data in plots(result, frame).items())
    lift = ""
    if result.diff is not None:
        lift = (f"<p>difference {points(result.diff, result.diff_ci)}, {html.escape(lift_text(result))}; "
                f"fixed-horizon p = {result.z_p_value:.4g}; "
                f"sequential (always valid) p = {result.sequential_p:.4g}</p>")
    srm = "MISMATCH: results invalid" if result.srm_flagged else "ok"
    drift = drift_table(result.drift)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>A/B {html.escape(result.experiment)}</title>
<style>body{{font-family:sans-serif;margin:2em}} td,th{{padding:4px 10px;border-bottom:1px solid #ddd}}</style></head><body>
<h1>Experiment {html.escape(result.experiment)}</h1>
<p>champion <b>{html.escape(result.champion)}</b>; decision <b id="decision">{html.escape(result.decision)}</b>: {html.escape('; '.join(result.reasons))}</p>
<table><tr><th>arm</th><th>weight</th><th>units</th><th>exposures</th><th>clicks</th><th>CTR</th><th>{result.ci_label}</th><th>errors</th><th>p99 ms</th><th>guardrails</th></tr>{rows}</table>
{lift}<p>sample ratio check p = {result.srm_p:.4g} ({srm})</p>{drift}{images}</body></html>"""


def lift_text(result: Analysis) -> str:
    """The relative lift with its interval; n/a where it is not defined (a champion CTR of 0)."""
    if result.lift is None:
        return "lift n/a"
    ci = f" [{result.lift_ci[0]:+.2%}, {result.lift_ci[1]:+.2%}]" if result.lift_ci is not None else " [n/a]"
    return f"lift {result.lift:+.2%}{ci}"


def drift_table(rows: list[dict]) -> str:
    """Feature drift per arm (PSI against the training data; flagged past the threshold)."""
    if not rows:
        return ""
    body = []
    for r in rows:
        oov = f"{r['oov_rate']:.2%}" if "oov_rate" in r else ""
        status, css = ("DRIFT", ' class="flagged"') if r["flagged"] else ("ok" if r.get("judged", True) else "too few rows", "")
        body.append(f"<tr{css}><td>{html.escape(r['arm'])}</td><td>{html.escape(r['feature'])}</td><td>{r['rows']}</td>"
                    f"<td>{r['psi']:.4f}</td><td>{oov}</td><td>{status}</td></tr>")
    return ('<h2>Feature drift</h2><table id="drift"><tr><th>arm</th><th>feature</th><th>rows</th><th>PSI</th><th>OOV rate</th>'
            f"<th>status</th></tr>{''.join(body)}</table>")
