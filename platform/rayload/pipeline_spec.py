"""Pipeline specs (`jobs/*_pipeline.yaml`): stages chained by name, run by `rayload run`.

A stage refers to a job, search or A/B spec by path (relative to the pipeline file) and to
the outputs of earlier stages by their names: the A/B stage's champion and challenger are
train or tune stages, the decide stage names an A/B stage. Everything is checked at load,
before any stage runs: a missing file, an unknown stage name, a reference to a later stage
or to a stage of the wrong kind is an error naming the field.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal, Union

from pydantic import Field, field_validator

from .errors import SpecError, SpecIssue
from .paths import NAME_MAX, NAME_PATTERN
from .spec import _Spec

# Folders under runs/ that other commands own; a pipeline run may not take their names.
RESERVED_RUN_IDS = frozenset({"train", "tune", "ab", "cache", "pipelines", "compressed", "retrain"})
# Files of a run folder beside its stage folders: a stage may not take their names
RUN_FILES = frozenset({"manifest.json", "report.html", ".lock"})


class _Stage(_Spec):
    name: str = Field(pattern=NAME_PATTERN, max_length=NAME_MAX)

    @field_validator("name")
    @classmethod
    def _not_a_run_file(cls, value: str) -> str:
        if value in RUN_FILES or value.endswith(".tmp"):  # a stage folder of that name broke the manifest's write
            raise ValueError(f"names a file of the run folder ({', '.join(sorted(RUN_FILES))}, *.tmp); choose another stage name")
        return value


class PrepareStage(_Stage):
    """Validate, split, fit the preprocessor and write preprocessed shards (content-addressed cache)."""

    kind: Literal["prepare"]
    job: str
    set: list[str] = Field(default_factory=list)


class TrainStage(_Stage):
    kind: Literal["train"]
    job: str
    set: list[str] = Field(default_factory=list)


class TuneStage(_Stage):
    kind: Literal["tune"]
    search: str
    set: list[str] = Field(default_factory=list)


class ABStage(_Stage):
    """Deploy champion vs challenger on Serve and collect traffic until a decision.

    traffic `simulate` replays the spec's simulator against the live endpoint (the demo and
    tests); `live` serves real users and looks at the analysis every `interval_s` until a
    decision or `max_minutes`."""

    kind: Literal["ab"]
    spec: str
    # Earlier train/tune stages whose checkpoints replace the A/B spec's two arms; without
    # them the arms are used as the A/B spec gives them (checkpoints, or jobs trained first).
    champion: str | None = None
    challenger: str | None = None
    traffic: Literal["simulate", "live"] = "simulate"
    interval_s: float = Field(default=30.0, gt=0, le=86_400)  # sleeps: bounded (1e300 overflowed time.sleep)
    max_minutes: float = Field(default=60.0, gt=0)
    keep_serving: bool = False  # leave the experiment deployed after the stage (on a cluster)
    set: list[str] = Field(default_factory=list)


class DecideStage(_Stage):
    """Act on the experiment's analysis: promote, roll back, or record `continue`."""

    kind: Literal["decide"]
    experiment: str
    act: bool = True  # apply promote / rollback to the live experiment when it still runs


Stage = Annotated[Union[PrepareStage, TrainStage, TuneStage, ABStage, DecideStage], Field(discriminator="kind")]


class PipelineSpec(_Spec):
    name: str = Field(min_length=1, pattern=NAME_PATTERN, max_length=NAME_MAX)
    stages: list[Stage] = Field(min_length=1)
    folder: str = ""  # set at load: the pipeline file's folder (paths resolve against it)

    def stage(self, name: str):
        found = next((s for s in self.stages if s.name == name), None)
        if found is None:  # a bare StopIteration named nothing
            raise KeyError(f"no stage named {name!r}; the stages are {', '.join(s.name for s in self.stages)}")
        return found

    def path(self, relative: str) -> str:
        if "://" in relative:
            return relative
        relative = os.path.expanduser(relative)
        if os.path.isabs(relative):
            return relative
        return os.path.normpath(os.path.join(self.folder, relative))


_FILE_FIELD = {"prepare": "job", "train": "job", "tune": "search", "ab": "spec"}
_REFS = {"ab": {"champion": ("train", "tune"), "challenger": ("train", "tune")}, "decide": {"experiment": ("ab",)}}


def pipeline_issues(spec: PipelineSpec) -> list[SpecIssue]:
    issues, seen = [], {}
    for i, stage in enumerate(spec.stages):
        where = f"stages.{i}"  # the path --set takes, as pydantic's own errors give it
        if stage.name in seen:
            issues.append(SpecIssue(f"{where}.name", "stage names must be unique", stage.name, True))
        if field := _FILE_FIELD.get(stage.kind):
            path = spec.path(getattr(stage, field))
            if not os.path.exists(path):
                issues.append(SpecIssue(f"{where}.{field}", f"file not found: {path}", getattr(stage, field), True))
            else:
                issues += _spec_file_issues(stage.kind, path, stage.set, f"{where}.{field}")
        if stage.kind == "ab" and (stage.champion is None) != (stage.challenger is None):
            issues.append(SpecIssue(f"{where}.champion", "give both champion and challenger, or neither (the A/B spec's arms)"))
        elif stage.kind == "ab" and stage.champion and os.path.exists(spec.path(stage.spec)):
            issues += _two_arms(spec.path(stage.spec), stage.set, f"{where}.spec")
        for field, kinds in _REFS.get(stage.kind, {}).items():
            ref = getattr(stage, field)
            if ref is None:
                continue
            if ref not in seen:
                if ref == stage.name or any(s.name == ref for s in spec.stages[i + 1:]):
                    what = f"names {'this stage itself' if ref == stage.name else 'a later stage'}; a stage can only use the outputs of stages before it"
                else:
                    what = f"no stage of that name before it; earlier stages: {list(seen) or 'none'}"
                issues.append(SpecIssue(f"{where}.{field}", what, ref, True))
            elif seen[ref] not in kinds:
                issues.append(SpecIssue(f"{where}.{field}", f"must name a {' or '.join(kinds)} stage, not a {seen[ref]} stage", ref, True))
        seen.setdefault(stage.name, stage.kind)
    return issues


def _two_arms(path: str, overrides: list[str], where: str) -> list[SpecIssue]:
    """Champion and challenger from earlier stages fill an A/B spec of exactly two arms."""
    from .ab_spec import load_ab_spec
    from .errors import SpecError

    try:
        arms = load_ab_spec(path, overrides).arms
    except SpecError:
        return []  # reported by _spec_file_issues
    if len(arms) != 2:
        return [SpecIssue(where, f"champion and challenger fill the A/B spec's arms, which must then be two; it has "
                          f"{len(arms)}: {[a.name for a in arms]}", os.path.basename(path), True)]
    return []


def _spec_file_issues(kind: str, path: str, overrides: list[str], where: str) -> list[SpecIssue]:
    """The referenced spec loads with the stage's overrides (checked now, not when the stage starts)."""
    if kind in ("prepare", "train"):
        from .spec import load_spec as load
    elif kind == "tune":
        from .search_job import load_search_spec as load
    else:
        from .ab_spec import load_ab_spec as load
    try:
        load(path, overrides)
    except SpecError as exc:
        return [SpecIssue(f"{where} ({path}): {i.path}", i.message, i.value, i.has_value) for i in exc.issues]
    return []


def load_pipeline_spec(path: str, overrides=()) -> PipelineSpec:
    """Read a pipeline spec; raises SpecError listing every problem with its field path."""
    from ._spec_load import apply_overrides, read_yaml, spec_kind, validate_model

    raw = read_yaml(path)
    if spec_kind(raw) != "pipeline":
        raw = single_stage(path, raw)
    issues = apply_overrides(raw, overrides, model_cls=PipelineSpec)
    if "folder" in raw:  # internal, set below (a folder: in the file was taken silently and replaced)
        issues.append(SpecIssue("folder", "unknown field; allowed: name, stages (paths resolve against the pipeline file's folder)"))
    raw["folder"] = os.path.dirname(os.path.abspath(path))
    return validate_model(PipelineSpec, raw, check=pipeline_issues, file=path, issues=issues)


def single_stage(path: str, raw: dict) -> dict:
    """A job, search or A/B spec as a pipeline of its own stages (`rayload run` takes any spec in jobs/)."""
    from ._spec_load import spec_kind

    name = os.path.basename(os.path.abspath(path))
    stages = {"job": [{"name": "train", "kind": "train", "job": name}],
              "search": [{"name": "tune", "kind": "tune", "search": name}],
              "ab": [{"name": "ab", "kind": "ab", "spec": name}, {"name": "decide", "kind": "decide", "experiment": "ab"}]}
    return {"name": raw.get("name") or os.path.splitext(name)[0], "stages": stages[spec_kind(raw)]}


def _inner_fields(kind: str) -> set[str]:
    """The top-level fields of the spec a stage of `kind` reads (its `set` applies to it)."""
    from .ab_spec import ABSpec
    from .search_spec import SearchSpec
    from .spec import JobSpec

    model = {"prepare": JobSpec, "train": JobSpec, "tune": SearchSpec, "ab": ABSpec}.get(kind)
    return set(model.model_fields) if model else set()


def _pipeline_own(item: str) -> bool:
    """A `--set` item of the pipeline spec itself: its name, or a stage by index (stages.N.field)."""
    return item.partition(".")[0].partition("=")[0] in ("name", "stages")


def split_overrides(spec: PipelineSpec, overrides, single: bool = False) -> tuple[list[str], dict[str, list[str]]]:
    """`--set` items whose first part names a stage go to that stage: a field of the stage itself
    that its spec does not have (`decide.act=false`, `ab.traffic=live`) as
    `stages.<i>.<field>`, anything else to its `set` (`baseline.train.epochs=2`); the rest apply
    to the pipeline spec itself. A pipeline of one spec (`rayload run jobs/x.yaml`) also takes
    that spec's own paths (`train.epochs=3` for its stage named train)."""
    names = [s.name for s in spec.stages]
    own, per_stage = [], {}
    for item in overrides:
        key = item.partition("=")[0]
        # the longest stage name the item starts with: a stage name may hold dots (base.v2)
        head = max((n for n in names if item.startswith(n + ".")), key=len, default=None)
        if head is not None:
            i, rest = names.index(head), item[len(head) + 1:]
            stage = spec.stages[i]
            field, inner = rest.partition("=")[0].partition(".")[0], _inner_fields(stage.kind)
            if field in type(stage).model_fields and field not in inner and field not in ("name", "kind", "set"):
                own.append(f"stages.{i}.{rest}")
                continue
            if single and field not in inner and field not in type(stage).model_fields and key.partition(".")[0] in inner:
                # `rayload run jobs/x.yaml --set train.epochs=3`: the job's own path, not the stage named train
                per_stage.setdefault(head, []).append(item)
                continue
            per_stage.setdefault(head, []).append(rest)
        elif _pipeline_own(item):
            own.append(item)
        elif single and key.partition(".")[0] in _inner_fields(spec.stages[0].kind):
            # a spec run as its own stages takes its own paths (data.max_bad_fraction=0.2)
            per_stage.setdefault(names[0], []).append(item)
        else:  # was "model: unknown field; allowed: folder, name, stages", folder being internal
            raise SpecError([SpecIssue("--set", f"the first part names a stage of the pipeline ({', '.join(names)}) or the "
                                       "pipeline's own name or stages: STAGE.field=value changes one stage", item, True)])
    return own, per_stage


def with_stage_sets(spec: PipelineSpec, per_stage: dict[str, list[str]], file: str | None = None) -> PipelineSpec:
    """The same pipeline with more `set` overrides for the named stages (checked again)."""
    from ._spec_load import validate_model

    raw = spec.model_dump(mode="json")
    names = [stage["name"] for stage in raw["stages"]]
    for name in per_stage:
        if name not in names:  # a --set renamed it (stages.N.name): its overrides were dropped without a word
            raise SpecError([SpecIssue(f"--set {name}", f"no stage is named {name} (stages: {', '.join(names)})")], file=file)
    for i, stage in enumerate(raw["stages"]):
        if stage["name"] in per_stage and "set" in stage:
            stage["set"] = [*stage["set"], *per_stage[stage["name"]]]
        elif stage["name"] in per_stage:
            raise SpecError([SpecIssue(f"--set {stage['name']}", f"a {stage['kind']} stage has no spec of its own to override; "
                                       f"its fields ({', '.join(f for f in type(spec.stages[i]).model_fields if f not in ('name', 'kind'))}) "
                                       f"are set as {stage['name']}.FIELD=VALUE", per_stage[stage["name"]], True)], file=file)
    return validate_model(PipelineSpec, raw, check=pipeline_issues, file=file)


def load_pipeline(path: str, overrides=()) -> PipelineSpec:
    """load_pipeline_spec, with `--set STAGE.field=value` routed to that stage. The pipeline's
    own items (`name=`, `stages.N.field=`) apply first, so the others find a stage by the name
    those give it (routed by the file's names, a renamed stage could take no overrides)."""
    from ._spec_load import read_yaml, spec_kind

    spec = load_pipeline_spec(path)
    single = spec_kind(read_yaml(path)) != "pipeline"
    own = [item for item in overrides if _pipeline_own(item) and not any(item.startswith(s.name + ".") for s in spec.stages)]
    if own:
        spec = load_pipeline_spec(path, own)
    own_after, per_stage = split_overrides(spec, [item for item in overrides if item not in own], single=single)
    if own_after:  # a stage's own field (decide.act=false), as stages.N.field
        spec = load_pipeline_spec(path, [*own, *own_after])
    return with_stage_sets(spec, per_stage, file=path) if per_stage else spec
