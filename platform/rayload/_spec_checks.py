"""Checks across spec sections that pydantic field validation cannot see."""

from __future__ import annotations

from .errors import SpecIssue
from .spec import EARLY_STOPPING_METRICS, FileSource, JobSpec

_CATEGORICAL = ("categorical", "multi_categorical")


def check_job(spec: JobSpec) -> list[SpecIssue]:
    issues = _check_schema(spec)
    if issues:
        return issues  # the other checks need a usable schema
    roles = {c.name: c.role for c in spec.data.resolved_columns()}
    return (_check_label(spec, roles) + _check_features(spec, roles) + _check_split(spec, roles) + _check_training(spec)
            + check_early_stopping(spec))


# Model settings only some models read (models/zoo.py): given for another model they change nothing.
_MODEL_ONLY = {"bottom": ("dlrm",), "cross_layers": ("dcn",), "cross_rank": ("dcn",)}


def warn_ignored_model_settings(spec: JobSpec) -> list[str]:
    """The model fields the spec sets that its model does not read, logged when it trains (not
    refused: a search over model.name draws models that read different ones)."""
    import logging

    # Set away from its default, not merely written: retraining copies a champion's whole model.json
    default = type(spec.model)()
    notes = [f"model.{name} is read only by model {' or '.join(models)}; model {spec.model.name} ignores it"
             for name, models in _MODEL_ONLY.items()
             if getattr(spec.model, name) != getattr(default, name) and spec.model.name not in models]
    for note in notes:
        logging.getLogger("rayload.train").warning("%s", note)
    return notes


def check_early_stopping(spec: JobSpec) -> list[SpecIssue]:
    """A rule on a metric the task's epochs do not report would never stop the run, and no
    checkpoint would carry the score the best one is picked by."""
    rule, task = spec.train.early_stopping, spec.data.resolved_label().task
    if rule is None or rule.metric is None or rule.metric in EARLY_STOPPING_METRICS[task]:
        return []
    reported = " or ".join(EARLY_STOPPING_METRICS[task])
    return [SpecIssue("train.early_stopping.metric", f"a {task} label (data.label.task: {task}) reports {reported}; set "
                      f"train.early_stopping.metric to {reported}, or leave it out for the task's own", rule.metric, True)]


def _check_training(spec: JobSpec) -> list[SpecIssue]:
    issues = []
    if spec.train.sync_bn and not spec.model.batch_norm:
        issues.append(SpecIssue("train.sync_bn", "there is no batch norm to synchronise; set model.batch_norm: true", True, True))
    if spec.train.sync_bn and spec.resources.gpus_per_worker == 0:
        issues.append(SpecIssue("train.sync_bn", "PyTorch synchronises batch norm only on GPUs; set resources.gpus_per_worker or sync_bn: false", True, True))
    if spec.train.batch_size < spec.train.accumulation:
        issues.append(SpecIssue("train.batch_size", f"must be at least train.accumulation={spec.train.accumulation} (micro-batches of batch_size / accumulation rows)", spec.train.batch_size, True))
    elif spec.train.batch_size % spec.train.accumulation:  # each step held batch_size // k * k rows, silently fewer
        issues.append(SpecIssue("train.batch_size", f"must be a multiple of train.accumulation={spec.train.accumulation} (each optimizer "
                                f"step takes accumulation micro-batches of batch_size / accumulation rows; "
                                f"{spec.train.batch_size // spec.train.accumulation * spec.train.accumulation} or "
                                f"{-(-spec.train.batch_size // spec.train.accumulation) * spec.train.accumulation} would do)",
                                spec.train.batch_size, True))
    micro = spec.train.batch_size // spec.train.accumulation
    if spec.model.batch_norm and micro == 1:
        issues.append(SpecIssue("train.batch_size", f"model.batch_norm needs micro-batches of at least 2 rows (batch_size / accumulation "
                                f"= {spec.train.batch_size} / {spec.train.accumulation}); raise batch_size, lower accumulation, or "
                                "set model.batch_norm: false", spec.train.batch_size, True))
    if spec.train.sparse_optimizer != "adam" and not spec.model.sparse_embeddings:
        issues.append(SpecIssue("train.sparse_optimizer", "applies only to sparse embedding tables; set model.sparse_embeddings: true "
                                "or leave sparse_optimizer out", spec.train.sparse_optimizer, True))
    for field, value, unset in (("sparse_lr", spec.train.sparse_lr, None), ("sparse_lr_schedule", spec.train.sparse_lr_schedule, "follow")):
        if value != unset and not spec.model.sparse_embeddings:  # it set nothing: the one dense optimizer takes train.lr
            issues.append(SpecIssue(f"train.{field}", f"applies only to sparse embedding tables; set model.sparse_embeddings: true "
                                    f"or leave {field} out", value, True))
    issues += _freeze_issues(spec)
    if spec.model.sparse_embeddings and spec.resources.gpus_per_worker > 0:
        issues.append(SpecIssue("model.sparse_embeddings", "sparse embedding gradients are synchronised on CPU (gloo) workers only; "
                                "on GPU workers set model.sparse_embeddings: false (dense gradients all-reduce over NCCL)", True, True))
    return issues


def _check_schema(spec: JobSpec) -> list[SpecIssue]:
    issues = []
    if isinstance(spec.data.source, FileSource):
        if spec.data.columns is None:
            issues.append(SpecIssue("data.columns", "a file source must declare its columns (name and role)"))
        if spec.data.label is None:
            issues.append(SpecIssue("data.label", "a file source must name its label column: label: {column: ...}"))
    names = [c.name for c in spec.data.columns or []]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        issues.append(SpecIssue("data.columns", f"column '{dup}' is declared more than once"))
    for i, col in enumerate(spec.data.columns or []):
        if col.unit is not None and col.role != "timestamp":
            issues.append(SpecIssue(f"data.columns[{i}].unit", f"column '{col.name}' has role '{col.role}'; unit says what a "
                                    "timestamp column's numbers count (s, ms, us, ns) and needs role: timestamp", col.unit, True))
    return issues


def _check_label(spec: JobSpec, roles: dict[str, str]) -> list[SpecIssue]:
    label = spec.data.resolved_label()
    issues = []
    role = roles.get(label.column)
    if role not in (None, "label"):
        issues.append(SpecIssue("data.label.column", f"column '{label.column}' is declared with role '{role}'; the label column must have role 'label' or be left out of data.columns"))
    if label.task == "regression" and label.threshold is not None:
        issues.append(SpecIssue("data.label.threshold", "a threshold turns values into 0/1 labels and needs task: binary"))
    if label.task == "binary" and label.domain is not None:
        issues.append(SpecIssue("data.label.domain", "domain bounds regression targets; binary labels are 0/1"))
    if label.task == "regression":
        if spec.rebalance.method != "none":
            issues.append(SpecIssue("rebalance.method", "rebalancing needs a binary label (data.label.task: binary)", spec.rebalance.method, True))
        if spec.split.kind == "stratified":
            issues.append(SpecIssue("split.kind", "stratified splits need a binary label", "stratified", True))
    return issues


def _freeze_issues(spec: JobSpec) -> list[SpecIssue]:
    """train.freeze names parts the chosen model has: one it lacks failed on the worker, after the
    data was prepared. The parts of the model built on a small input with dense, ID and bag
    fields (every part a model can have)."""
    if not spec.train.freeze:
        return []
    from .models import InputShape, build_model
    from .train.transfer import PARTS, has_part

    model = build_model({**spec.model.model_dump(), "hidden": [2], "bottom": [2]}, InputShape(2, (3, 3), (3,)))
    has = [k for k, attrs in PARTS.items() if any(has_part(model, a) for a in attrs)]
    return [SpecIssue("train.freeze", f"model {spec.model.name} has no {part!r} part; its parts are {has}", part, True)
            for part in spec.train.freeze if part not in has]


def _check_features(spec: JobSpec, roles: dict[str, str]) -> list[SpecIssue]:
    issues = []
    if not any(role in ("numeric", *_CATEGORICAL) for role in roles.values()) and not spec.features.derived:
        # a model of no inputs trained, scoring every row the same
        issues.append(SpecIssue("data.columns", "no feature column: declare at least one column with role numeric, categorical or "
                                "multi_categorical (id, timestamp and label columns are not fed to the model)"))
    seen: dict[tuple, int] = {}
    for i, cross in enumerate(spec.features.crosses):
        key = tuple(sorted(cross.columns))
        if len(set(cross.columns)) != len(cross.columns):
            issues.append(SpecIssue(f"features.crosses.{i}.columns", "names a column twice", cross.columns, True))
        elif key in seen:
            issues.append(SpecIssue(f"features.crosses.{i}", f"crosses the same columns as features.crosses.{seen[key]}", cross.columns, True))
        else:
            seen[key] = i
    first: dict[str, int] = {}
    for i, cross in enumerate(spec.features.crosses):
        name = "x_" + "_".join(cross.columns)  # features.CrossState.name: the model's input of the cross
        j = first.setdefault(name, i)
        if j != i and sorted(cross.columns) != sorted(spec.features.crosses[j].columns):
            # [a_b, c] and [a, b_c] both became x_a_b_c: one feature, the other lost without a word
            issues.append(SpecIssue(f"features.crosses.{i}", f"its feature name {name!r} is that of features.crosses.{j}; rename a "
                                    "column or drop one of the two", cross.columns, True))
        elif name in roles:
            issues.append(SpecIssue(f"features.crosses.{i}", f"its feature name {name!r} is a column's of data.columns", cross.columns, True))
    for name, d in spec.features.derived.items():
        if name in roles:
            issues.append(SpecIssue(f"features.derived.{name}", f"'{name}' is already a column of data.columns; pick another name"))
        if roles.get(d.source) != "timestamp":
            issues.append(_role_issue(f"features.derived.{name}.source", d.source, roles, "timestamp"))
        if d.minus is not None and roles.get(d.minus) != "numeric":
            issues.append(_role_issue(f"features.derived.{name}.minus", d.minus, roles, "numeric"))
    roles = {**roles, **{name: "numeric" for name in spec.features.derived}}
    issues += _check_output_names(spec, roles)
    for name in spec.features.numeric:
        if roles.get(name) != "numeric":
            issues.append(_role_issue(f"features.numeric.{name}", name, roles, "numeric"))
    for name, feat in spec.features.categorical.items():
        if roles.get(name) not in _CATEGORICAL:
            issues.append(_role_issue(f"features.categorical.{name}", name, roles, "categorical or multi_categorical"))
        elif feat.target_raw and not feat.target_stats:
            issues.append(SpecIssue(f"features.categorical.{name}.target_raw", "adds a target statistic of the raw label and needs target statistics; set "
                                    f"features.categorical.{name}.target_stats: true, or leave target_raw out", True, True))
        elif feat.target_stats and roles[name] == "multi_categorical":
            issues.append(SpecIssue(f"features.categorical.{name}.target_stats", "target statistics need a single-valued categorical column", True, True))
        elif feat.encode == "onehot" and roles[name] == "multi_categorical":
            issues.append(SpecIssue(f"features.categorical.{name}.encode", "onehot needs a single-valued column; use vocab or hash for multi_categorical", "onehot", True))
    for i, cross in enumerate(spec.features.crosses):
        for name in cross.columns:
            if roles.get(name) != "categorical":
                issues.append(_role_issue(f"features.crosses.{i}.columns", name, roles, "categorical"))
    return issues


# Columns rayload adds to a row on its own (data.validate.RAW_LABEL, the read pass's error column).
RESERVED_COLUMNS = ("__label_raw", "__rayload_error__")


def _check_output_names(spec: JobSpec, roles: dict[str, str]) -> list[SpecIssue]:
    """A transform's output named like a column (or derived feature) of its own: one of the
    two silently replaced the other in the prepared rows (a numeric column `color__oh0` beside
    `color` one-hot, or `user__te` beside user's target statistics), and the model was fed one
    of them twice."""
    issues = [SpecIssue("data.columns", f"column name {name!r} is reserved for rayload's own columns; rename the column", name)
              for name in RESERVED_COLUMNS if name in roles]
    # the prepared rows' label column (FittedFeatures.transform_table); id and timestamp columns do not reach them
    if roles.get("label") in ("numeric", *_CATEGORICAL) and spec.data.resolved_label().column != "label":
        issues.append(SpecIssue("data.columns", "column name 'label' is where the prepared rows keep the label, which would replace "
                                "this column's values with the label's (the model trained on its own target); rename the column"))
    from .target_stats import onehot_name, output_names

    for name, feat in spec.features.categorical.items():
        outputs = output_names(name) * bool(feat.target_stats) + output_names(name, "raw") * bool(feat.target_raw)
        if feat.encode == "onehot":
            prefix = onehot_name(name, "")
            outputs += [c for c in roles if c.startswith(prefix) and c[len(prefix):].isdigit()]
        for out in outputs:
            if out in roles:
                issues.append(SpecIssue(f"features.categorical.{name}", f"its output column {out!r} is also a column of data.columns or "
                                        "features.derived, and one would replace the other; rename that column", out, True))
    return issues


def _check_split(spec: JobSpec, roles: dict[str, str]) -> list[SpecIssue]:
    split, issues = spec.split, []
    known = set(roles) | {spec.data.resolved_label().column}
    for name in split.key or []:
        if name not in known:
            issues.append(SpecIssue("split.key", f"unknown column '{name}'; columns: {', '.join(sorted(known))}"))
    if split.kind == "kfold" and split.group is not None and split.group not in known:
        issues.append(SpecIssue("split.group", f"kind: kfold with a group keys its folds by that column; columns: {', '.join(sorted(known))}",
                                split.group, True))
    if split.kind == "group" and split.group not in known:
        issues.append(SpecIssue("split.group", f"kind: group needs a column to group by; columns: {', '.join(sorted(known))}", split.group, True))
    if split.group is not None and split.kind not in ("group", "kfold"):  # it was ignored: a group's rows landed in every split
        issues.append(SpecIssue("split.group", f"keeps a column's rows in one split only with kind: group (or kfold); kind: "
                                f"{split.kind} ignores it. Use kind: group, or leave group out", split.group, True))
    if split.key and (split.kind == "group" or (split.kind == "kfold" and split.group)):
        issues.append(SpecIssue("split.key", f"a split by group hashes the group column ({split.group}) alone; leave key out",
                                split.key, True))
    stamps = [name for name, role in roles.items() if role == "timestamp"]
    if split.kind == "temporal" and not stamps:
        issues.append(SpecIssue("split.kind", "a temporal split needs a column with role 'timestamp' in data.columns", "temporal", True))
    elif split.kind == "temporal" and split.time_column is None and len(stamps) > 1:  # the first one was taken silently
        issues.append(SpecIssue("split.time_column", f"data.columns declares {len(stamps)} timestamp columns ({', '.join(stamps)}); "
                                "name the one a temporal split cuts on"))
    if split.time_column is not None and split.kind != "temporal":
        issues.append(SpecIssue("split.time_column", f"only a temporal split cuts on a time column; kind: {split.kind} ignores it",
                                split.time_column, True))
    elif split.time_column is not None and roles.get(split.time_column) != "timestamp":
        issues.append(SpecIssue("split.time_column", f"'{split.time_column}' is not a timestamp column; timestamp columns: "
                                f"{', '.join(stamps) or 'none'}", split.time_column, True))
    return issues


def _role_issue(path: str, name: str, roles: dict[str, str], wanted: str) -> SpecIssue:
    if name not in roles:
        return SpecIssue(path, f"no column '{name}' in data.columns; columns: {', '.join(sorted(roles))}")
    return SpecIssue(path, f"column '{name}' has role '{roles[name]}', this transform needs {wanted}")
