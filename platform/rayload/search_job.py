"""A search spec against its base job spec: loading (`load_search_spec`), the base with the
fixed values set (`base_raw`), the job spec of one trial's values (`job_from`), and every
check that needs the job spec: paths that exist (with the valid ones near an unknown one),
values of the space and of `points_to_evaluate` that make a valid job spec, the metric the
job's epochs report, and preprocessing parameters."""

from __future__ import annotations

import os

from .errors import SpecIssue
from .search_spec import MAX_VARIANTS, PREPROCESSING, SearchSpec, metric_mode, strategy_issues


def base_path(spec: SearchSpec, spec_file: str | None) -> str:
    if os.path.isabs(os.path.expanduser(spec.base)) or spec_file is None:
        return os.path.expanduser(spec.base)
    here = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(spec_file)), spec.base))
    # Relative to the search spec's folder; fall back to the working directory (repo root).
    return here if os.path.exists(here) else os.path.abspath(spec.base)


def load_search_spec(path: str, overrides: list[str] | tuple[str, ...] = ()) -> SearchSpec:
    """Read a search spec, check it and its base job spec; raises SpecError listing every problem."""
    from ._spec_load import load_model
    from .spec import JobSpec

    # `--set fixed.train.lr=0.01` sets fixed's key train.lr (a job spec path), `space.train.lr...` space's
    spec = load_model(SearchSpec, path, overrides, check=lambda spec: job_issues(spec, path),
                      keyed={"fixed": JobSpec, "space": None})
    # Pin the base to where it was found: the spec then works from any working directory
    # (the SDK, the demo and a resumed search all pass the object, not the file).
    return spec.model_copy(update={"base": base_path(spec, path)})


def base_raw(spec: SearchSpec, spec_file: str | None) -> dict:
    from ._spec_load import _set_path, dumped_defaults, read_yaml
    from .spec import JobSpec

    raw = read_yaml(base_path(spec, spec_file))
    issues: list[SpecIssue] = []
    defaults = dumped_defaults(JobSpec, raw)  # a list item the base leaves at its default starts from that list
    for key, value in spec.fixed.items():
        _set_path(raw, key.split("."), value, issues, defaults)
    if issues:
        from .errors import SpecError

        raise SpecError(issues)
    return raw


def job_issues(spec: SearchSpec, spec_file: str | None) -> list[SpecIssue]:
    """Strategy problems, unknown paths (with the valid paths near them), and extreme values
    of the space that make the base job spec invalid."""
    from .errors import SpecError

    issues = strategy_issues(spec)
    where = base_path(spec, spec_file)
    try:
        raw = base_raw(spec, spec_file)
        base = job_from(raw, {})
    except SpecError as exc:
        return issues + [SpecIssue("base", f"{where}: {i.render()}") for i in exc.issues]
    reported = _reported_metrics(base.data.resolved_label().task)
    if spec.metric not in reported:
        issues.append(SpecIssue("metric", f"a {base.data.resolved_label().task} job's epochs report {', '.join(reported)}; "
                                "pick one of them", spec.metric, True))
    elif spec.mode is None and metric_mode(spec.metric) is None:
        issues.append(SpecIssue("mode", f"{spec.metric} has no better direction (neither higher nor lower is better "
                                "by itself); set mode: max or min"))
    known = known_paths(base)
    for path in list(spec.fixed) + list(spec.space):
        if path not in known:
            section = "fixed" if path in spec.fixed else "space"
            issues.append(SpecIssue(f"{section}.{path}", f"not a field of the job spec {os.path.basename(where)}; near it: {', '.join(near_paths(path, known))}"))
        elif path in spec.fixed and spec.fixed[path] is not None and (fields := _section_fields(path)):
            # (None turns an optional section off, e.g. fixed train.early_stopping: null; a section
            # that cannot be None is refused by the job spec's own check, named)
            issues.append(SpecIssue(f"fixed.{path}", f"names a section of the job spec, which this value would replace whole (every "
                                    f"field it leaves out back to its default); set its fields one by one: "
                                    f"{', '.join(f'fixed.{path}.{f}' for f in fields[:4])}{', ...' if len(fields) > 4 else ''}"))
        elif path in spec.space and any(isinstance(v, dict) for v in spec.space[path].values) and (fields := _section_fields(path)):
            # each trial (and best.yaml) silently lost the base's other fields of the section
            given = [f for v in spec.space[path].values if isinstance(v, dict) for f in v if f in fields]
            fields = list(dict.fromkeys(given + fields))  # the fields the values set, first
            issues.append(SpecIssue(f"space.{path}", f"names a section of the job spec, which each value here would replace whole "
                                    f"(every field it leaves out back to its default, not the base's); search its fields one by "
                                    f"one: {', '.join(f'space.{path}.{f}' for f in fields[:4])}{', ...' if len(fields) > 4 else ''} "
                                    "(null, to turn the section off, may stay a choice)"))
    if issues:
        return issues
    issues += _preprocessing_issues(spec)
    for path, param in spec.space.items():
        for value in param.values:
            try:
                job_from(raw, {path: value})
            except SpecError as exc:
                issues += [SpecIssue(f"space.{path}", f"value {value!r} makes the job spec invalid: {i.render()}") for i in exc.issues]
        issues += _point_issues(spec, raw, path)
        inside = param.inside()
        if inside is None or any(i.path == f"space.{path}" for i in issues):
            continue
        try:  # the ends may pass where a value between them does not (an integer field takes 8.0, not 23.7)
            job_from(raw, {path: inside})
        except SpecError as exc:
            low, high = getattr(param, param.kind)
            stepped = f" with step {param.step:g}" if param.step is not None else ""
            hint = (f"; an integer field needs {{int: [{int(low)}, {int(high)}]}} or a choice list"
                    + (" (a step and low on it must be whole)" if stepped else "")
                    if any("integer" in i.message for i in exc.issues) else "")
            issues += [SpecIssue(f"space.{path}", f"a {param.kind} range{stepped} draws values such as {inside:.6g}, which make "
                                 f"the job spec invalid: {i.render()}{hint}") for i in exc.issues]
    return issues


def _section_fields(path: str) -> list[str]:
    """The fields of the job spec section at `path` ([] when it is a field, a list item or a
    mapping such as features.numeric)."""
    from ._spec_load import _fields_at
    from .spec import JobSpec

    return _fields_at(JobSpec, path.split("."))


def _point_issues(spec: SearchSpec, raw: dict, path: str) -> list[SpecIssue]:
    """The points' values for `path` that the space takes but the job spec does not."""
    from .errors import SpecError

    out = []
    for i, point in enumerate(spec.points_to_evaluate):
        if path in point and not spec.space[path].refuses(point[path]):
            try:
                job_from(raw, {path: point[path]})
            except SpecError as exc:
                out += [SpecIssue(f"points_to_evaluate.{i}.{path}", f"makes the job spec invalid: {e.render()}") for e in exc.issues]
    return out


def _reported_metrics(task: str) -> list[str]:
    """What every epoch of the training loop reports that a search can rank trials by
    (train/loop.py `run`: the training loss, and `val_` + the task's validation metrics); each
    has its direction in search_spec.METRIC_MODES."""
    names = ["auc", "logloss", "calibration", "ece", "mean_prediction", "observed_rate"] if task == "binary" else ["rmse", "mean_prediction", "observed_rate"]
    return [f"val_{n}" for n in names] + ["train_loss"]


def _preprocessing_issues(spec: SearchSpec) -> list[SpecIssue]:
    paths = [p for p in spec.space if p.split(".")[0] in PREPROCESSING]
    # data and split decide which rows (and labels) validation holds: trials of different values
    # were ranked on different validation rows, and the search picked the easiest partition (or
    # a random split interleaved in time with its training rows over a temporal one)
    issues = [SpecIssue(f"space.{p}", "trials would be ranked on different validation rows; set it in fixed: (one "
                        "search per value)") for p in paths if p.split(".")[0] in ("data", "split")]
    issues += [SpecIssue(f"space.{p}", "a parameter that changes preprocessing must be a choice or grid list: each "
                         "variant is preprocessed once before the trials start") for p in paths
               if p.split(".")[0] not in ("data", "split") and spec.space[p].kind not in ("choice", "grid")]
    variants = 1
    for p in paths:
        variants *= len(spec.space[p].values)
    if not issues and variants > MAX_VARIANTS:
        issues.append(SpecIssue("space", f"the preprocessing parameters ({', '.join(paths)}) make {variants} data variants; at most {MAX_VARIANTS}"))
    return issues


def job_from(raw: dict, params: dict):
    """The job spec with `params` ({dotted path: value}) applied to a copy of `raw`."""
    import copy

    from pydantic import ValidationError

    from ._spec_checks import check_job
    from ._spec_load import _set_path, dumped_defaults, pydantic_issues
    from .errors import SpecError
    from .spec import JobSpec

    raw = copy.deepcopy(raw)
    issues: list[SpecIssue] = []
    defaults = dumped_defaults(JobSpec, raw)  # a list item `raw` leaves at its default (known_paths lists it) starts from that list
    for path, value in params.items():
        _set_path(raw, path.split("."), value, issues, defaults)
    try:
        job = JobSpec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(issues + pydantic_issues(exc, JobSpec)) from None
    issues += check_job(job)
    if issues:
        raise SpecError(issues)
    return job


def known_paths(job) -> set[str]:
    """Every dotted path of a job spec: its values, sections, list items, and the fields of
    sections that are unset (None)."""
    from ._spec_load import _fields_at
    from .spec import JobSpec

    out: set[str] = set()

    def walk(node, prefix: list[str]):
        if prefix:
            out.add(".".join(prefix))
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, prefix + [str(key)])
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, prefix + [str(i)])
        elif node is None:
            for field in _fields_at(JobSpec, prefix):
                out.add(".".join(prefix + [field]))

    walk(job.model_dump(mode="json"), [])
    return out


def near_paths(path: str, known: set[str], n: int = 6) -> list[str]:
    import difflib

    parts = path.split(".")
    close = difflib.get_close_matches(path, sorted(known), n=n, cutoff=0.6)
    for depth in range(len(parts) - 1, 0, -1):  # siblings under the longest prefix that exists
        prefix = ".".join(parts[:depth])
        if prefix in known:
            siblings = sorted(p for p in known if p.startswith(prefix + ".") and p.count(".") == depth)
            close += [p for p in siblings if p not in close]
            break
    else:
        close += [p for p in sorted(known) if "." not in p and p not in close]
    return close[:n]


MAX_FIT_CHECKS = 64  # model settings combinations tried against train.init_from before a search


def _fit_candidates(param, path: str, inits: list[str]) -> list:
    """The values of a searched setting tried against the checkpoints: its choices, or its range's
    bounds and, among the values the range can draw, each checkpoint's own (model.embedding_dim
    int [2, 8] around a checkpoint of 4 fits only there). A checkpoint that cannot be read adds
    none: check_before_training names it."""
    from .errors import RayloadError
    from .train.transfer import _model_json

    values = list(param.values)
    if param.kind == "int" and path.startswith("model."):
        for init in inits:
            try:
                own = _model_json(init).get("config", {}).get(path[len("model."):])
            except RayloadError:
                continue
            if isinstance(own, int) and param.refuses(own) is None and own not in values:
                values.append(own)
    return values


def _inits(spec: SearchSpec, raw: dict) -> list[str]:
    """Every checkpoint a trial may start from: the base's train.init_from and the searched ones."""
    found = [(raw.get("train") or {}).get("init_from")]
    if "train.init_from" in spec.space:
        found += spec.space["train.init_from"].values
    if "train" in spec.space:
        found += [v.get("init_from") for v in spec.space["train"].values if isinstance(v, dict)]
    return [f for f in dict.fromkeys(found) if isinstance(f, str) and f]


def check_init_from(spec: SearchSpec, raw: dict) -> None:
    """A base job that starts from a checkpoint (train.init_from) must take its weights in some
    trial: the searched model settings (choices and grids by value, ranges by their bounds) are
    tried over the base; the search is refused only when no combination fits, with the first
    one's error. Unsearched, the base alone (a model.hidden the checkpoint does not fit failed
    every trial on its worker). Past MAX_FIT_CHECKS combinations each trial checks its own."""
    import itertools

    from .errors import RayloadError
    from .train.transfer import check_before_training

    paths = [p for p in spec.space if p.startswith("model.") or p in ("model", "train", "train.freeze", "train.init_from")]
    inits = _inits(spec, raw)
    combos = list(itertools.islice(itertools.product(*(_fit_candidates(spec.space[p], p, inits) for p in paths)), MAX_FIT_CHECKS + 1))
    if len(combos) > MAX_FIT_CHECKS:
        return
    first = None
    for combo in combos:
        try:
            return check_before_training(job_from(raw, dict(zip(paths, combo))))
        except RayloadError as exc:
            first = first or exc
    raise first
