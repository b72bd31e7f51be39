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


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.M | re.S)


def _spec_tree(tmp_path) -> tuple[str, str]:
    """tmp_path/jobs and tmp_path/tune holding links to the repository's specs, so an example
    written beside them resolves its relative references as a file in jobs/ or tune/ would."""
    for folder in ("jobs", "tune"):
        os.makedirs(tmp_path / folder)
        for name in os.listdir(os.path.join(ROOT, folder)):
            os.symlink(os.path.join(ROOT, folder, name), tmp_path / folder / name)
    return str(tmp_path / "jobs"), str(tmp_path / "tune")


def test_every_spec_example_in_the_readme_loads(tmp_path, monkeypatch):
    """Each YAML example is a spec a user may copy: it must pass the same checks as a spec
    file (a job spec's missing name or a cross of an undeclared column failed here once)."""
    import yaml

    from rayload.ab_spec import load_ab_spec
    from rayload.pipeline_spec import load_pipeline
    from rayload.search_job import load_search_spec
    from rayload.spec import load_spec

    monkeypatch.setenv("RAYLOAD_API_KEY", "example")  # the A/B example's serving.api_key_env
    jobs, tune = _spec_tree(tmp_path)
    examples = _blocks("yaml")
    kinds = []
    for i, text in enumerate(examples):
        raw = yaml.safe_load(text)
        kind, folder, load = next((k, f, fn) for key, k, f, fn in [
            ("stages", "pipeline", jobs, load_pipeline), ("base", "search", tune, load_search_spec),
            ("arms", "A/B", jobs, load_ab_spec), ("data", "job", jobs, load_spec)] if key in raw)
        path = os.path.join(folder, f"readme_example_{i}.yaml")
        with open(path, "w") as f:
            f.write(text)
        try:
            load(path)
        except Exception as exc:
            raise AssertionError(f"the README's {kind} spec example does not load:\n{exc}") from exc
        kinds.append(kind)
    assert sorted(kinds) == ["A/B", "job", "pipeline", "search"]


def test_every_sdk_name_the_readme_uses_exists():
    """`rayload.X` in the README's Python examples is an attribute of the package (the SDK
    example once called rayload.train.load, hidden by the rayload.train function)."""
    import rayload

    used = set(re.findall(r"\brayload\.([a-z_]+(?:\.[a-z_]+)?)\(", "\n".join(_blocks("python"))))
    missing = []
    for name in sorted(used):
        obj = rayload
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            missing.append(f"rayload.{name}")
    assert used and not missing, f"the README's SDK examples use names rayload does not have: {missing}"


def test_the_readme_lists_every_field_a_relaunch_may_change():
    """identity.RELAUNCH_MAY_CHANGE let eval.calibration_bins change on a relaunch while the
    README's list, which says any other difference is refused, left it out."""
    from rayload.train.identity import RELAUNCH_MAY_CHANGE

    listed = README[README.index("A relaunch may change"):README.index("any other difference is refused")]
    wanted = {k for k in RELAUNCH_MAY_CHANGE if k.startswith(("train.", "eval."))} - {"train.run_name"}
    assert {k for k in wanted if f"`{k}`" not in listed} == set()
    assert "`resources`" in listed and "`name`" in listed and "path" in listed
