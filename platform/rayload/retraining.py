"""`rayload retrain SPEC --from-events RUN`: continuous training from an A/B run's feedback.

1. Training rows: the run's exposures (the raw features of the row each user was shown,
   logged by the router) in a sliding `window` of recent time, labelled 1 when an outcome of
   the experiment's event with a value > 0 (a click, as the A/B analysis counts one) arrived
   within `attribution` of the exposure (by default the A/B spec's analysis.attribution_s, else
   30 minutes). An exposure younger
   than `attribution` is left out, with or without an outcome yet: its label is not final, and
   keeping only the young ones already clicked would bias the labels toward positives.
2. A job: SPEC's model and training settings on those rows, warm-started from the champion
   checkpoint (`train.init_from`, which also reuses the champion's fitted features, so IDs keep
   their meaning; a compressed champion is served, not trained: the retrain starts from the
   checkpoint it was compressed from), split at random into train, validation (which picks the
   best epoch) and test, keyed by what a row shows the model (`job_for`), so copies of one
   showing stay on one side.
3. Offline gate: the new model and the champion are scored on the same held-out test rows,
   which neither trained on nor chose an epoch; the new model must beat the champion's AUC by
   at least `min_auc_gain`. The result also gives the gain's 95% interval and p-value by
   DeLong's paired test (`evaluate.paired_auc_difference`), so a gain measured on few rows
   reads as what it is; a test split with fewer than `MIN_GATE_CLASS` rows of either class is
   refused (an AUC on a handful of rows would pass or fail the gate by chance).
4. Registration: a new A/B spec (`ab.yaml` in the retrain folder) with the champion as control
   and the new model as challenger (arm `retrained`, `retrained-2` when the champion has that
   name), under a new experiment name (so a new salt reshuffles units; by default the
   experiment's, with this retrain's stamp in place of an earlier one), ready for `rayload
   serve`; a shadow experiment's successor is a shadow experiment unless `--weight` gives the
   challenger traffic. It is built and validated before step 1, so a spec it would refuse costs
   no training.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from .errors import DataError, RayloadError
from .retrain_gate import GATE_SPLIT, Gate, gate_aucs
from .retrain_rows import check_rows, experiment_attribution, input_columns, training_rows, windows
from .paths import is_remote, localize, open_private, runs_root

log = logging.getLogger(__name__)
SPLIT = {"train": 0.7, "val": 0.15, GATE_SPLIT: 0.15}
_STAMP = re.compile(r"-r\d{8}-\d{6}(?:-\d+)?$")  # the suffix a default retrain name ends with (-2: the second of a second)


@dataclass(frozen=True)
class RetrainResult:
    run_dir: str
    experiment: str  # the experiment whose events were used
    champion: str  # its checkpoint
    checkpoint: str | None  # the retrained model
    rows: int
    positives: int
    auc_champion: float
    auc_new: float
    min_auc_gain: float
    ab_spec: str | None  # the new experiment's spec, written when the gate passed
    gate_split: str = GATE_SPLIT  # the held-out split of the events both AUCs were scored on
    warm_start: str | None = None  # the checkpoint the retrain started from (a compressed champion's source)
    gate_rows: int = 0  # rows of the gate split, of which gate_positives are positive
    gate_positives: int = 0
    gain_ci: tuple[float, float] | None = None  # 95% interval of auc_new - auc_champion (DeLong, paired)
    gain_p: float | None = None  # two-sided p-value of a zero gain
    unlogged: int = 0  # ok exposures of the window left out: their features were not logged (events.log_features off)

    @property
    def passed(self) -> bool:
        from .evaluate import AUC_TOLERANCE  # "at least the champion's plus --min-auc-gain": 0.7 - 0.6 was refused at 0.1

        return self.auc_new - self.auc_champion >= self.min_auc_gain - AUC_TOLERANCE

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def retrain(spec, from_events: str, window: str = "7d", attribution: str | None = None, min_auc_gain: float = 0.0,
            challenger_weight: float | None = None, name: str | None = None, overrides=(), address: str | None = None,
            now: float | None = None) -> RetrainResult:
    """Retrain the champion of A/B run `from_events` on its logged feedback; see the module doc."""
    from .serve.control import load_state, parts
    from .spec import JobSpec, load_spec

    if not isinstance(min_auc_gain, (int, float)) or not math.isfinite(min_auc_gain):
        # NaN was taken, and a full fine-tune later refused a model however much it gained
        raise RayloadError(f"--min-auc-gain must be a finite number (a negative one accepts a small loss), got {min_auc_gain}")

    if attribution is not None:
        windows(window, attribution)  # a bad option refused before anything is read
    job = spec if isinstance(spec, JobSpec) else load_spec(spec, list(overrides))
    run, state = load_state(from_events)
    args, user = parts(state["config"])
    given, attribution = attribution, attribution or experiment_attribution(args)  # None: the A/B spec's, else 30m
    try:
        window_s, attribution_s = windows(window, attribution)
    except RayloadError as exc:
        if given is not None:
            raise
        raise RayloadError(f"{exc} (--attribution {attribution} is the default: the experiment's analysis.attribution_s; "
                           "pass a longer --window, or --attribution)") from None
    champion = args["checkpoints"][user["champion"]]
    _check_champion(champion, user["champion"], from_events)
    now = time.time() if now is None else now
    # UTC: local time repeats an hour when the clocks go back, and two retrains shared one folder and name
    stamp = _dt.datetime.fromtimestamp(now, _dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    # a second retrain of the same second gets its own folder, training run and next name (-2, ...)
    # the folder first: its name (-2, ... for a retrain of the same second) gives the training run's
    # and the next experiment's, so two retrains never share either
    out = _new_folder(os.path.join(runs_root(), "retrain", f"{args['experiment']}-{stamp}"))
    stamp = os.path.basename(out)[len(args["experiment"]) + 1:]
    name = name or next_name(args["experiment"], stamp)
    # The next experiment is built and checked before anything is read or trained (the retrained
    # checkpoint stands in for itself): a spec it would refuse fails now, not after the fine-tune.
    try:
        next_ab_spec(args, user["champion"], champion, champion, name, challenger_weight)
    except Exception:
        os.rmdir(out)  # empty: nothing was written yet
        raise
    unlogged: list[int] = []
    path = os.path.join(out, "events.parquet")
    try:
        table = training_rows(args, champion, window_s, attribution_s, now, unlogged)
        pq.write_table(table, path)
        label = _label_column(champion)
        positives = int(pa.compute.sum(table.column(label)).as_py() or 0)
        check_rows(table.num_rows, positives, from_events)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # too few rows (or none readable) leaves no retrain folder behind
        raise
    retrain_job = job_for(job, champion, path, label, f"retrain-{args['experiment']}-{stamp}")
    gate, checkpoint = _fit_and_gate(retrain_job, champion, address)
    ab_path = None
    outcome = RetrainResult(out, args["experiment"], champion, checkpoint, table.num_rows, positives, gate.auc_champion, gate.auc_new,
                            min_auc_gain, None, warm_start=retrain_job.train.init_from, gate_rows=gate.rows,
                            gate_positives=gate.positives, gain_ci=gate.gain_ci, gain_p=gate.gain_p, unlogged=sum(unlogged))
    if outcome.passed:
        ab_path = write_ab_spec(out, args, user["champion"], champion, checkpoint, name, challenger_weight)
        outcome = RetrainResult(**{**asdict(outcome), "ab_spec": ab_path})
    with open(os.path.join(out, "retrain.json"), "w") as f:
        json.dump({**outcome.to_dict(), "window": window, "attribution": attribution, "job": retrain_job.model_dump(mode="json")},
                  f, indent=1, default=str)
    return outcome


def next_name(experiment: str, stamp: str) -> str:
    """The next experiment's default name: the experiment's, its retrain stamp (-rYYYYMMDD-HHMMSS)
    replaced rather than appended, so rounds of retraining do not grow it without end (it is
    stored in the event tables' experiment column, 128 characters: a longer name is cut to fit,
    or a legal 120-character name could never be retrained under its default name)."""
    from .ab_spec import MAX_NAME

    suffix = f"-r{stamp}"
    return f"{_STAMP.sub('', experiment)[: MAX_NAME - len(suffix)]}{suffix}"


def _new_folder(path: str) -> str:
    """Make `path`, or `path-2`, `path-3`, ... when a retrain of the same second made it already."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for n in range(1, 1000):
        candidate = path if n == 1 else f"{path}-{n}"
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            continue
    raise RayloadError(f"{path}: a thousand retrains of this experiment in one second")


def _check_champion(champion: str, arm: str, run: str) -> None:
    """The champion's checkpoint must still be there, with a binary label (events are labelled
    clicked or not, and the gate compares AUCs): named before anything is read or trained."""
    from .compression import require_checkpoint
    from .features import FittedFeatures

    require_checkpoint(champion, f"the champion of A/B run {run} (arm {arm!r}, whose checkpoint a retrain starts from)",
                       "restore it, or retrain from a run whose champion's checkpoint exists")
    task = FittedFeatures.load(os.path.join(localize(champion), "features.json")).label.task
    if task != "binary":  # found by the gate, after a whole fine-tune of a regression model as a classifier
        raise DataError(f"the champion of A/B run {run} (arm {arm!r}) has a {task} label; a retrain labels exposures 0/1 by "
                        "their outcome and gates on AUC, so it needs a champion with a binary label")


def _label_column(champion: str) -> str:
    from .features import FittedFeatures

    return FittedFeatures.load(os.path.join(localize(champion), "features.json")).label.column


def job_for(job, champion: str, events_path: str, label: str, run_name: str):
    """SPEC's model and training settings on the event rows, warm-started from the champion."""
    from .features import FittedFeatures
    from .spec import JobSpec
    from .train.identity import read_manifest

    features = FittedFeatures.load(os.path.join(localize(champion), "features.json"))
    columns = [{k: c[k] for k in ("name", "role", "separator", "required", "unit") if k in c} for c in input_columns(features)]
    raw = job.model_dump(mode="json", exclude_none=True)
    raw["name"] = run_name
    raw["data"] = {"source": {"kind": "parquet", "path": events_path},
                   "columns": [*columns, {"name": label, "role": "label"}, {"name": "request_id", "role": "id"}],
                   "label": {"column": label, "task": "binary"}}
    # Keyed by what a row shows the model, not by its request: exposures of the same features
    # (a user shown the same item again) were split apart, so the gate scored rows whose exact
    # copies the retrained model had trained on, and the champion had not. A timestamp (the
    # source of a derived hour or weekday) is left out: nearly unique per exposure, it split
    # showings the model reads alike.
    key = [c["name"] for c in columns if c["role"] != "timestamp"]
    raw["split"] = {"kind": "random", **SPLIT, "seed": job.split.seed, "key": key or None}
    raw["rebalance"] = {"method": "none"}
    raw["train"] = {**raw["train"], "init_from": warm_start(champion), "run_name": run_name}
    raw["model"] = _model_section(champion)
    # The champion's fitted features transform the event rows whatever SPEC's features: section
    # says; the run records the section the champion was trained with (none when unknown), so a
    # later retrain from this model compares with what was really applied.
    trained = ((read_manifest(champion) or {}).get("spec") or {}).get("features")
    raw["features"] = trained if trained is not None else {}
    return JobSpec.model_validate(raw)


def _model_section(champion: str) -> dict:
    """The champion's architecture: a warm start needs the same shapes whatever SPEC says."""
    with open(os.path.join(localize(champion), "model.json")) as f:
        config = dict(json.load(f)["config"])
    from .spec import ModelSpec

    # A model.json from before `align` existed describes a model built unpadded, which is how the
    # loader rebuilds it (models.zoo); ModelSpec's default (8) would give other shapes.
    config.setdefault("align", 1)
    return {k: v for k, v in config.items() if k in ModelSpec.model_fields}


def warm_start(champion: str) -> str:
    """The checkpoint a retrain starts from: the champion, or for a compressed champion (served,
    not trained) the original it was compressed from (model.json `compression.source`)."""
    from .train.checkpoint import read_model_json

    compression = read_model_json(champion).get("compression")
    if not compression:
        return _where(champion)
    source = compression.get("source")
    if not source or not _has_checkpoint(source):
        raise RayloadError(f"the champion {champion} is a {compression.get('method')} checkpoint, and the checkpoint it was compressed "
                           f"from (model.json compression.source: {source!r}), which a retrain warm-starts from, is gone; restore it, "
                           "or make an uncompressed checkpoint the champion")
    if _features_json(source) != _features_json(champion):
        raise RayloadError(f"the champion {champion} was compressed from {source}, whose features.json has changed since; "
                           "a warm start from it would give IDs another meaning: restore the original checkpoint")
    log.info("the champion %s is %s-compressed: warm-starting from its source %s", champion, compression.get("method"), source)
    return source


def _has_checkpoint(path: str) -> bool:
    try:
        return os.path.isfile(os.path.join(localize(path), "model.json"))
    except (OSError, ValueError):  # a URI that cannot be fetched
        return False


def _features_json(checkpoint: str) -> dict:
    with open(os.path.join(localize(checkpoint), "features.json")) as f:
        return json.load(f)


def _fit_and_gate(job, champion: str, address) -> tuple["Gate", str]:
    """The gate on the held-out test events, and the new checkpoint."""
    from .train.trainer import fit

    result = fit(job, address=address, evaluate_test=False)
    return gate_aucs(result.preprocessed, result.checkpoint, champion, job.eval), result.checkpoint


def _where(checkpoint: str) -> str:
    """A checkpoint as the next A/B spec names it: a URI as it is, a local folder absolute."""
    return checkpoint if is_remote(checkpoint) else os.path.abspath(checkpoint)


def next_ab_spec(args: dict, champion_arm: str, champion: str, challenger: str, name: str, weight: float | None) -> dict:
    """The next experiment, validated: the champion against the retrained model (an arm named
    apart from the champion's), otherwise as before. A shadow experiment stays one (the
    challenger at weight 0, scoring beside the champion) unless `weight` gives it live traffic.
    SpecError names what the spec refuses."""
    from .ab_spec import ab_from_dict

    prior = args["spec"]
    if weight is not None:
        _check_weight(weight, champion_arm, challenger_arm(champion_arm))
    shadow = bool(prior.get("shadow")) and not weight  # an explicit --weight > 0 goes live
    weight = 0.0 if shadow else weight if weight is not None else _first_weight(prior)
    spec = {k: v for k, v in prior.items() if k not in ("name", "salt", "arms", "champion", "shadow")}
    if shadow:
        spec["shadow"] = True
    spec.update(name=re.sub(r"[^A-Za-z0-9_.-]", "-", name), champion=champion_arm, arms=[
        {"name": champion_arm, "weight": round(1.0 - weight, 6), "checkpoint": _where(champion)},
        {"name": challenger_arm(champion_arm), "weight": weight, "checkpoint": _where(challenger)},
    ])
    if spec.get("events", {}).get("url") is None:
        spec.get("events", {}).pop("url", None)
    ab_from_dict(spec)
    return spec


def _check_weight(weight: float, champion_arm: str, challenger: str) -> None:
    """--weight as the next A/B spec checks its arms' weights (`weight_issues`), named as given."""
    import math

    from .ab_spec import weight_issues
    from .errors import SpecError, SpecIssue

    if not (isinstance(weight, (int, float)) and math.isfinite(weight) and 0.0 <= weight <= 1.0):
        raise SpecError([SpecIssue("--weight", "the challenger's share of the traffic must be in [0, 1]", weight, True)])
    issues = weight_issues({champion_arm: round(1.0 - weight, 6), challenger: weight}, [champion_arm, challenger], champion_arm)
    if issues:
        raise SpecError([SpecIssue("--weight", i.message, weight, True) for i in issues])


def challenger_arm(champion_arm: str) -> str:
    """'retrained', or 'retrained-2' when the champion has that name already (the model of an
    earlier retrain, promoted): two arms of one experiment may not share a name."""
    return "retrained" if champion_arm != "retrained" else "retrained-2"


def write_ab_spec(out: str, args: dict, champion_arm: str, champion: str, challenger: str, name: str, weight: float | None) -> str:
    """`next_ab_spec` written to `out`/ab.yaml, ready for `rayload serve`."""
    spec = next_ab_spec(args, champion_arm, champion, challenger, name, weight)
    path = os.path.join(out, "ab.yaml")
    with open_private(path) as f:  # its events URL may hold a password
        f.write(f"# rayload serve {path}\n# written by rayload retrain: the champion against the model retrained on its feedback\n")
        yaml.safe_dump(spec, f, sort_keys=False)
    from .ab_spec import load_ab_spec

    load_ab_spec(path)  # what we hand over must load
    return path


def _first_weight(prior: dict) -> float:
    """The prior experiment's starting challenger weight: its ramp's first step, or its first
    challenger's weight (the champion: as the spec names it, else its first arm)."""
    ramp = prior.get("ramp") or {}
    if ramp.get("auto") and ramp.get("steps"):  # the controller ramps from its first step
        return float(ramp["steps"][0])
    champion = prior.get("champion") or prior["arms"][0]["name"]
    others = [a["weight"] for a in prior["arms"] if a["name"] != champion]
    if not others:
        return 0.5
    if not others[0] > 0:  # 0.5 sent half of all traffic to an untested model where the last one had none
        from .errors import SpecError, SpecIssue

        raise SpecError([SpecIssue("--weight", "the prior experiment's challenger had weight 0 (no traffic) and no ramp or "
                                   "shadow mode to start from; give --weight for the retrained model's share", None)])
    return float(others[0])
