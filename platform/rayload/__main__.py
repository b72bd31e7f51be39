"""`python -m rayload ...`: the CLI, for jobs that run the uploaded code (rayload submit)."""

from .cli import main

main()
