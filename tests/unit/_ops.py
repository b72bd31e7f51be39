"""Helpers of the ops commands' tests (`rayload submit`, `doctor`, `demo`, `cluster`): a job spec
that loads, and the CLI app with those commands registered."""

import importlib

# A job spec that loads (its data is never read here): `rayload submit` checks the spec before the upload.
JOB = """name: x
data:
  source: {kind: csv, path: /no/such/data/*.csv}
  columns:
    - {name: user, role: categorical}
    - {name: price, role: numeric}
  label: {column: clicked, task: binary}
features:
  numeric: {price: {}}
  categorical: {user: {}}
"""


def cli_app():
    """The typer app with the ops commands registered (`submit`, `doctor`, `demo`, `cluster`, ...)."""
    importlib.import_module("rayload._cli_ops")
    from rayload.cli import app

    return app
