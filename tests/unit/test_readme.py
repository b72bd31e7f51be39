"""The README's CLI list and spec reference agree with the CLI and the spec models."""

import os
import re

import typer.main

from rayload.ab_spec import ABSpec
from rayload.cli import app
from rayload.pipeline_spec import ABStage, DecideStage, PipelineSpec, PrepareStage, TrainStage, TuneStage
from rayload.search_spec import SearchSpec
from rayload.spec import JobSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = open(os.path.join(ROOT, "README.md")).read()


def _commands() -> set[str]:
    from rayload import _cli_ab, _cli_life, _cli_ops  # noqa: F401  (register their commands)

    group = typer.main.get_group(app)
    out = set()
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            out |= {f"{name} {sub}" for sub in cmd.commands}
        else:
            out.add(name)
    return out


def test_every_command_is_in_the_readme_cli_list():
    cli = README.split("## CLI")[1].split("\n## ")[0]
    missing = sorted(c for c in _commands() if f"rayload {c}" not in cli)
    assert not missing, f"commands missing from the README's CLI list: {missing}"


def test_every_command_the_readme_shows_exists():
    shown = set(re.findall(r"bin/rayload ((?:ab|data|cluster) [a-z-]+|[a-z-]+)", README))
    shown |= set(re.findall(r"^rayload ((?:ab|data|cluster) [a-z-]+|[a-z-]+)", README, re.M))
    commands = _commands()
    groups = {c.split()[0] for c in commands}
    unknown = sorted(c for c in shown if c not in commands and c.split()[0] not in groups)
    assert not unknown, f"the README shows commands the CLI does not have: {unknown}"


def _reference(label: str) -> set[str]:
    line = next(l for l in README.split("## Spec reference")[1].splitlines() if l.startswith(f"- {label}:"))
    return set(re.findall(r"`([a-z_]+)`", line))


def test_spec_reference_lists_every_field_of_every_spec_model():
    assert _reference("job spec") == set(JobSpec.model_fields)
    assert _reference("search spec") == set(SearchSpec.model_fields)
    assert _reference("A/B spec") == set(ABSpec.model_fields)
    stage_fields = set().union(*[set(m.model_fields) for m in (PrepareStage, TrainStage, TuneStage, ABStage, DecideStage)])
    assert _reference("pipeline spec") == (set(PipelineSpec.model_fields) - {"folder"}) | stage_fields
