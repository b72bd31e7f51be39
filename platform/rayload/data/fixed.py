"""Features fixed by a checkpoint: a job that starts from one (`train.init_from`) transforms its
data with the checkpoint's fitted features instead of fitting new ones, and what it declares
(columns, a `features:` section) is checked against them before any input is read."""

from __future__ import annotations

import os

from ..errors import DataError
from ..features import FittedFeatures


def fixed_features(spec) -> FittedFeatures | None:
    """A job that starts from a checkpoint (train.init_from) transforms its data with that
    checkpoint's fitted features instead of fitting new ones: an ID, a bucket, a scale must
    mean what the copied weights learned. Only the label (rate, class weights) comes from this data."""
    init = getattr(getattr(spec, "train", None), "init_from", None)
    if not init:
        return None
    from ..paths import localize

    try:  # a URI (shared storage) is fetched into the local cache first
        path = os.path.join(localize(init), "features.json")
    except (OSError, ValueError) as exc:
        raise DataError(f"train.init_from={init!r} cannot be read: {exc}") from exc
    if not os.path.exists(path):
        raise DataError(f"train.init_from={init!r} is not a checkpoint: {path} does not exist")
    return FittedFeatures.load(path)


FEATURE_ROLES = ("numeric", "categorical", "multi_categorical")


def check_fixed_spec(features, init: str, fixed: FittedFeatures | None = None) -> None:
    """A job that starts from a checkpoint transforms its data with the checkpoint's fitted
    features, so its own `features:` section is not applied. Left out (the default), or applying
    the same transforms as the section the checkpoint was trained with, it says nothing new; any
    other section would be ignored without a word (a user's new log transform or bucket count
    never applied), so it is refused with the fields that differ. Both sides are compared as
    fitting reads them (`_applied`): a feature column with no entry is fitted with the defaults,
    so `x: {}` or the defaults spelled out equal no entry."""
    from ..spec import FeatureSpec
    from ..train.identity import _flat

    if features.model_dump(mode="json") == FeatureSpec().model_dump(mode="json"):
        return
    given = _applied(features.model_dump(mode="json"), fixed)
    trained = _trained_section(init)
    if trained is not None:
        try:
            trained = _applied(trained, fixed)  # today's defaults filled in
        except ValueError:
            pass
        if trained == given:
            return
        before, after = _flat(trained), _flat(given)
        differ = [p for p in sorted(set(before) | set(after)) if before.get(p) != after.get(p)]
        shown = ", ".join(f"features.{p}" for p in differ[:8]) + (f" (and {len(differ) - 8} more)" if len(differ) > 8 else "")
        why = f"differs from the section the checkpoint was trained with at {shown}"
    else:
        why = "cannot be compared with the checkpoint's: its manifest.json holds no job spec"
    raise DataError(f"train.init_from={init!r} transforms the data with the checkpoint's fitted features, so this job's "
                    f"features: section is not applied; it {why}. Remove the features: section (the checkpoint's "
                    "transforms apply), or drop train.init_from to fit these features")


def _applied(section: dict, fixed: FittedFeatures | None) -> dict:
    """A features section as fitting applies it to the checkpoint's columns: validated (today's
    defaults filled in), every feature column without an entry given the default entry fitting
    uses for it, and entries for columns that are no such feature (an id column) left out, as
    fitting leaves them (_feature_fit.FitPlan)."""
    from ..spec import CategoricalFeature, FeatureSpec, NumericFeature

    spec = FeatureSpec.model_validate(section)
    if fixed is not None:
        roles = {c["name"]: c["role"] for c in fixed.columns}
        roles.update({name: "numeric" for name in fixed.derived})
        numeric = [n for n, role in roles.items() if role == "numeric"]
        categorical = [n for n, role in roles.items() if role in ("categorical", "multi_categorical")]
        spec = spec.model_copy(update={"numeric": {n: spec.numeric.get(n, NumericFeature()) for n in numeric},
                                       "categorical": {n: spec.categorical.get(n, CategoricalFeature()) for n in categorical}})
    return spec.model_dump(mode="json")


def _trained_section(init: str, depth: int = 0) -> dict | None:
    """The features section the checkpoint's transforms were fitted with: its job's own, or, for
    a checkpoint that was itself trained from another (`train.init_from`) with the section left
    out, that ancestor's, which is what its features.json holds (followed while readable)."""
    from ..spec import FeatureSpec
    from ..train.identity import read_manifest

    spec = (read_manifest(init) or {}).get("spec") or {}
    section = spec.get("features")
    parent = (spec.get("train") or {}).get("init_from")
    if parent and depth < 16 and (section is None or section == {} or section == FeatureSpec().model_dump(mode="json")):
        try:
            ancestor = _trained_section(parent, depth + 1)
        except (OSError, ValueError):
            ancestor = None
        if ancestor is not None:
            return ancestor
    return section


def check_fixed_columns(declared, fixed: FittedFeatures, where: str) -> None:
    """The job's declared columns against the ones the fixed features were fitted on: every
    feature column (and every column a derived feature is computed from) by name and role, and
    no feature column the checkpoint has no transform for (it would be dropped without a word).
    Label, id and timestamp columns may differ: only the label comes from this data."""
    roles = {c.name: c.role for c in declared}
    needed = {c["name"]: c["role"] for c in fixed.columns if c["role"] in FEATURE_ROLES or c["name"] in fixed.derived_sources}
    missing = [n for n in needed if n not in roles]
    retyped = [f"{n} ({needed[n]} in the checkpoint, {roles[n]} here)" for n in needed if n in roles and roles[n] != needed[n]]
    extra = [n for n, role in roles.items() if role in FEATURE_ROLES and n not in needed]
    # A bag is read with data.columns' separator and split by the checkpoint's: with two
    # separators every training bag would be one unknown token while serving splits it
    separators = {c["name"]: c.get("separator") or "|" for c in fixed.columns if c["role"] == "multi_categorical"}
    declared_separators = {c.name: c.separator for c in declared if c.role == "multi_categorical"}
    retyped += [f"{n} (separator {separators[n]!r} in the checkpoint, {declared_separators[n]!r} here)"
                for n in separators if n in declared_separators and declared_separators[n] != separators[n]]
    # Likewise a timestamp's numbers: written with this data's unit, served with the checkpoint's
    units = {c["name"]: c.get("unit") or "s" for c in fixed.columns if c["role"] == "timestamp" and c["name"] in fixed.derived_sources}
    declared_units = {c.name: c.unit or "s" for c in declared if c.role == "timestamp"}
    retyped += [f"{n} (unit {units[n]} in the checkpoint, {declared_units[n]} here)"
                for n in units if n in declared_units and declared_units[n] != units[n]]
    if not (missing or retyped or extra):
        return
    found = "; ".join(f"{what}: {', '.join(names)}" for what, names in (
        ("missing", missing), ("declared with another role, separator or unit", retyped), ("not in the checkpoint", extra)) if names)
    expected = ", ".join(f"{n}: {r}" for n, r in needed.items())
    raise DataError(f"{where} transforms the data with the checkpoint's fitted features, which were fitted on other columns than "
                    f"data.columns declares ({found}). Declare the checkpoint's columns ({expected}; plus this data's label), or "
                    "drop train.init_from to fit new features on these columns")
