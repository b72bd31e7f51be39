"""The A/B sections of the reports without Ray: `rayload ab report` and the pipeline report."""

from rayload import report
from rayload.serve import control

from test_ab_control import events, run, spec_of  # noqa: F401 - run is a fixture


def test_the_pipeline_report_shows_a_lift_without_an_interval_when_the_challenger_has_no_clicks(run):
    run_dir = run(spec_of(0.5, guardrails={"min_requests": 200}), events(3_000, {"A": 0.10, "B": 0.0}, {"A": 0.5, "B": 0.5}))
    result = control.analysis_for(run_dir)
    assert result.lift == -1.0 and result.lift_ci is None  # the case: a lift of -100% with no interval
    section = report._ab_section({"run_dir": run_dir}, {})
    assert "lift -100.00% [n/a]" in section and "sequential p" in section
