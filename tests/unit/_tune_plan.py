"""What the `tune_plan` fixture (tests/unit/conftest.py) raises when a search reaches its plan."""


class PlanReached(Exception):
    """Raised by the `tune_plan` fixture's _run: the search got as far as running its plan."""
