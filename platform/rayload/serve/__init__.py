"""A/B online evaluation on Ray Serve: model deployments, the sticky router, the event store,
the analysis and decisions, and the traffic simulator.

Exports load lazily so the statistics and the event store import without Ray Serve."""

__all__ = ["start", "set_weights", "promote", "rollback", "analysis_for", "step", "Scorer", "EventWriter", "EventReader", "analyze"]


def __getattr__(name: str):
    if name in ("start", "set_weights", "promote", "rollback", "analysis_for", "step"):
        from . import control

        return getattr(control, name)
    if name == "Scorer":
        from .scorer import Scorer

        return Scorer
    if name == "EventWriter":
        from .event_writer import EventWriter

        return EventWriter
    if name == "EventReader":
        from .events import EventReader

        return EventReader
    if name == "analyze":
        from .analysis import analyze

        return analyze
    raise AttributeError(name)
