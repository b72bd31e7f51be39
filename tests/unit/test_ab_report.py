"""The A/B sections of the reports without Ray: `rayload ab report` and the pipeline report."""

import pytest

from _ab_control import control_run, events, spec_of
from rayload import report
from rayload.serve import control


@pytest.fixture
def run(tmp_path, monkeypatch):
    return control_run(tmp_path, monkeypatch)


def test_the_pipeline_report_shows_a_lift_and_its_interval_when_the_challenger_has_no_clicks(run):
    run_dir = run(spec_of(0.5, guardrails={"min_requests": 200}), events(3_000, {"A": 0.10, "B": 0.0}, {"A": 0.5, "B": 0.5}))
    result = control.analysis_for(run_dir)
    # a lift of -100%: the score interval (MOVER-R) is defined there, from -100% up
    assert result.lift == -1.0 and result.lift_ci[0] == pytest.approx(-1.0) and -1.0 < result.lift_ci[1] < -0.9
    section = report._ab_section({"run_dir": run_dir}, {})
    assert "lift -100.00% [-100.00%, -9" in section and "sequential p" in section


def test_the_lift_over_time_is_the_analysis_lift_within_ramp_periods_not_a_ratio_of_pooled_ctrs():
    """A ramp 5% -> 50% while the CTR falls for both arms alike (no effect): pooled cumulative
    CTRs give the challenger, mostly seen late, a large negative 'lift'."""
    import pandas as pd

    from rayload.serve.analysis import analyze
    from rayload.serve.report import lift_over_time, plots

    early = events(20_000, {"A": 0.20, "B": 0.20}, {"A": 0.95, "B": 0.05}, seed=1)
    late = events(20_000, {"A": 0.05, "B": 0.05}, {"A": 0.5, "B": 0.5}, seed=2, start=20_000)
    frame = pd.concat([early, late], ignore_index=True)
    result = analyze(frame, spec_of(0.95), {"A": 0.5, "B": 0.5}, "A")
    lifts = lift_over_time(result, frame)
    assert lifts[-1][0] == result.timeline[-1]["ts"] and abs(lifts[-1][1] - result.lift) < 1e-9
    assert all(abs(lift) < 0.25 for _, lift in lifts[len(lifts) // 2:])  # no effect, read as none
    raw = lift_over_time(result)[-1][1]
    assert raw < -0.3  # what the plot showed: the pooled ratio
    assert set(plots(result, frame)) == {"ctr", "lift"}


def test_the_ctr_plot_starts_at_the_first_exposure_and_names_arms_starting_with_an_underscore(monkeypatch):
    """The x axis, "minutes since the first exposure", started at the timeline's first point, a
    1/30 quantile past it (an hour of traffic ended at minute 58); matplotlib drops legend labels
    starting with "_", which arm names may."""
    import matplotlib.axes

    from rayload.serve.analysis import analyze
    from rayload.serve.report import plots

    frame = events(3601, {"A": 0.1, "B": 0.1}, {"A": 0.5, "B": 0.5})  # one exposure a second for an hour
    result = analyze(frame, spec_of(0.5), {"A": 0.5, "B": 0.5}, "A")
    assert result.first_ts == frame["ts"].min() < result.timeline[0]["ts"]
    drawn = {}
    real_plot, real_legend = matplotlib.axes.Axes.plot, matplotlib.axes.Axes.legend

    def plot(ax, xs, *args, **kwargs):
        drawn.setdefault("x_last", []).append(list(xs)[-1])
        return real_plot(ax, xs, *args, **kwargs)

    def legend(ax, *args, **kwargs):
        out = real_legend(ax, *args, **kwargs)
        drawn["labels"] = [t.get_text() for t in out.get_texts()]
        return out

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    monkeypatch.setattr(matplotlib.axes.Axes, "legend", legend)
    result.arms[0].arm, result.arms[1].arm = "_control", "_new"
    result.timeline = [{**row, "_control": row["A"], "_new": row["B"]} for row in result.timeline]
    result.challenger = None  # the CTR plot only
    assert set(plots(result)) == {"ctr"}
    assert drawn["x_last"][0] == pytest.approx(60.0) and drawn["labels"] == ["arm _control", "arm _new"]


def test_interval_headings_follow_analysis_alpha(run):
    """The intervals are at 1 - analysis.alpha, under a heading that said 95% whatever alpha was."""
    from rayload.serve.report import render

    run_dir = run(spec_of(0.5, analysis={"min_units": 200, "alpha": 0.1}), events(3_000, {"A": 0.10, "B": 0.12}, {"A": 0.5, "B": 0.5}))
    result = control.analysis_for(run_dir)
    assert result.ci_label == "90% CI" and result.to_dict()["confidence"] == pytest.approx(0.9)
    assert "<th>90% CI</th>" in report._ab_section({"run_dir": run_dir}, {}) and "95% CI" not in report._ab_section({"run_dir": run_dir}, {})
    assert "<th>90% CI</th>" in render(result, control.events_of(run_dir))
    assert [type(result)("e", "A", None, {}, [], confidence=1 - a).ci_label for a in (5e-5, 0.025)] == ["99.995% CI", "97.5% CI"]
