"""Typed job specs and `load_spec`, which reports every problem of a spec file at once.

Every section forbids unknown keys (`extra="forbid"`): a typo in a YAML key is an error with
its field path, never a silently ignored setting.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from ._quantities import GpuQuantity, RayQuantity
from ._spec_base import _Spec
from .data.builtin import builtin_columns, builtin_label
from .errors import FieldValueError
from .feature_spec import (BucketSpec, CategoricalFeature, ClipSpec, CrossFeature, DerivedFeature, FeatureSpec,  # noqa: F401
                           NumericFeature)
from .paths import JOB_NAME_MAX, NAME_PATTERN, RUN_NAME_MAX

Role = Literal["numeric", "categorical", "multi_categorical", "label", "id", "timestamp"]


# ---------------------------------------------------------------- data


class ColumnSpec(_Spec):
    name: str = Field(min_length=1)
    role: Role
    separator: str = Field(default="|", min_length=1)
    required: bool = False
    # A timestamp column of plain numbers counts from the Unix epoch in this unit (default: s).
    # Typed timestamps and date texts carry their own.
    unit: Literal["s", "ms", "us", "ns"] | None = None


class LabelSpec(_Spec):
    column: str
    task: Literal["binary", "regression"] = "binary"
    # binary: label = value >= threshold; without a threshold the values must already be 0/1.
    threshold: float | None = None
    # regression: values outside [low, high] are quarantined.
    domain: tuple[float, float] | None = None

    @model_validator(mode="after")
    def _ordered_domain(self) -> "LabelSpec":
        if self.domain is not None and self.domain[0] > self.domain[1]:  # every row would be quarantined, after a full pass
            raise ValueError(f"domain is [low, high] with low <= high (got {list(self.domain)})")
        return self


# Not empty: [] failed in the reader, "" read every file under the working directory
_SourcePath = Annotated[str, Field(min_length=1, pattern=r"\S")]


class FileSource(_Spec):
    kind: Literal["parquet", "csv", "jsonl"]
    path: _SourcePath | Annotated[list[_SourcePath], Field(min_length=1)] = Field(
        description="files, directories or globs; local or a pyarrow URI")


class MovieLensSource(_Spec):
    kind: Literal["movielens"]


class SyntheticSource(_Spec):
    kind: Literal["synthetic-ctr"]
    rows: int = Field(default=100_000, gt=0)
    numeric: int = Field(default=13, ge=0)
    categorical: int = Field(default=26, ge=0)
    cardinalities: list[int] | None = None
    zipf: float = Field(default=1.1, gt=1.0)
    missing_rate: float = Field(default=0.05, ge=0.0, lt=1.0)
    shard_rows: int = Field(default=250_000, gt=0)
    seed: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _generator_accepts(self) -> "SyntheticSource":
        """The generator's own checks, here: they failed inside the data checks as a bare
        ValueError (a traceback from the CLI) naming no spec field."""
        if self.numeric + self.categorical == 0:
            raise FieldValueError("categorical", "numeric + categorical must be > 0: a table needs a feature column", 0)
        cards = self.cardinalities
        if cards is not None and len(cards) != self.categorical:
            raise FieldValueError("cardinalities", f"one per categorical column: {self.categorical}, got {len(cards)}", cards)
        if cards is not None and any(not 1 <= c < 2**32 for c in cards):
            raise FieldValueError("cardinalities", "each must be in [1, 2**32)", cards)
        return self


Source = Annotated[Union[FileSource, MovieLensSource, SyntheticSource], Field(discriminator="kind")]


class DataSpec(_Spec):
    source: Source
    # None means the built-in source's own schema; file sources must declare theirs.
    columns: list[ColumnSpec] | None = None
    label: LabelSpec | None = None
    max_bad_fraction: float = Field(default=0.01, ge=0.0, le=1.0)

    def resolved_columns(self) -> list[ColumnSpec]:
        if self.columns is not None:
            return list(self.columns)
        return [ColumnSpec(**c) for c in builtin_columns(self.source)]

    def resolved_label(self) -> LabelSpec:
        if self.label is not None:
            return self.label
        return LabelSpec(**builtin_label(self.source))


# ---------------------------------------------------------------- split and rebalance


class SplitSpec(_Spec):
    kind: Literal["random", "stratified", "temporal", "group", "kfold"] = "random"
    train: float = Field(default=0.8, gt=0.0, le=1.0)
    val: float = Field(default=0.1, ge=0.0, lt=1.0)
    test: float = Field(default=0.1, ge=0.0, lt=1.0)
    seed: int = 0
    # Columns that identify a row; the split hashes them. None: every declared column.
    key: list[str] | None = None
    group: str | None = Field(default=None, description="column whose rows stay together (kind=group; kind=kfold: group k-fold)")
    time_column: str | None = Field(default=None, description="kind=temporal: the timestamp column to cut on (needed when "
                                    "data.columns declares more than one)")
    k: int = Field(default=5, ge=2)
    fold: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _fractions(self) -> "SplitSpec":
        total = self.train + self.val + self.test
        if self.kind == "kfold":
            if self.fold >= self.k:
                raise ValueError(f"fold must be in [0, k), got fold={self.fold} with k={self.k}")
        elif abs(total - 1.0) > 1e-6:
            raise ValueError(
                f"train + val + test must sum to 1.0, got {self.train} + {self.val} + {self.test} = {total:g}"
            )
        return self


class RebalanceSpec(_Spec):
    method: Literal["none", "downsample", "upsample", "class_weights"] = "none"
    # minority:majority ratio after resampling (1.0 = balanced).
    target_ratio: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int = 0


# ---------------------------------------------------------------- model, training, resources


class ModelSpec(_Spec):
    name: Literal["mlp", "wide_deep", "deepfm", "dlrm", "dcn"] = "deepfm"
    embedding_dim: int = Field(default=16, ge=1, le=1024)
    # sizes >= 1: a 0 built a layer of no units (every score the same), a negative one failed when built
    hidden: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [256, 128])
    bottom: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [64], description="DLRM bottom MLP for dense features")
    cross_layers: int = Field(default=2, ge=1, le=16, description="DCN-v2 cross layers before the deep MLP (model dcn)")
    cross_rank: int = Field(default=0, ge=0, description="DCN-v2 low-rank cross layers: W = U V^T of this rank; 0: full matrix")
    dropout: float = Field(default=0.1, ge=0.0, lt=1.0)
    batch_norm: bool = False
    # Sparse gradients for embedding tables (SparseAdam) while the dense part uses AdamW:
    # dense Adam over large tables touches every row every step.
    sparse_embeddings: bool = False
    # The MLPs' input widths (concatenated embeddings and dense features, DLRM's interactions)
    # are zero-padded to a multiple of this: GPU tensor cores need multiples of 8 for bf16/fp16
    # and 4 for TF32 (benchmarks/RESULTS.md: an unaligned first layer ran on 3-4x slower
    # kernels). 1 turns padding off.
    align: int = Field(default=8, ge=1, le=128)


# The validation metrics an early-stopping rule can follow, by data.label.task.
EARLY_STOPPING_METRICS = {"binary": ("auc", "logloss"), "regression": ("rmse",)}


class EarlyStopping(_Spec):
    metric: Literal["auc", "logloss", "rmse"] | None = Field(
        default=None, description="None: the task's own, auc for a binary label, rmse for regression")
    patience: int = Field(default=2, ge=1)
    min_delta: float = Field(default=0.0, ge=0.0)


class TrainSpec(_Spec):
    epochs: int = Field(default=5, ge=1)
    batch_size: int = Field(default=1024, ge=1, description="per worker, per optimizer step")
    accumulation: int = Field(default=1, ge=1, description="micro-batches per optimizer step")
    lr: float = Field(default=1e-3, gt=0.0)
    sparse_lr: float | None = Field(default=None, gt=0.0, description="lr of the sparse embedding optimizer; default: lr")
    # Adam gives a rare ID's row a full-size step whenever it appears, so rare rows overfit;
    # Adagrad's steps shrink with how often a row was updated (the DLRM reference's choice).
    sparse_optimizer: Literal["adam", "adagrad"] = "adam"
    weight_decay: float = Field(default=0.0, ge=0.0)
    embedding_l2: float = Field(default=0.0, ge=0.0, description="L2 on the embedding rows a batch uses")
    # embedding_l2 weighs every occurrence of an ID alike, so an ID seen n times is pulled n
    # times as hard and a rare ID hardly at all: rare rows overfit after an epoch or so. The
    # prior weighs each row a batch uses by 1 / its ID's training count, so over an epoch every
    # ID gets the same pull toward 0 (a Gaussian prior per ID): a rare ID's row stays near 0
    # until its data outweighs the prior, a frequent one follows its data (benchmarks/RESULTS.md).
    embedding_prior: float = Field(default=0.0, ge=0.0, description="Gaussian prior on every embedding row, per ID: each "
                                   "row a batch uses is penalised by embedding_prior x squared norm / its ID's count in "
                                   "the training split / batch size; 0: off")
    precision: Literal["fp32", "bf16", "fp16", "auto"] = "auto"
    # fp32 matrix products on CUDA GPUs (Ampere and later) run on the tensor cores in TF32
    # (10-bit mantissa, fp32 range); false keeps them exact fp32. No effect on CPU.
    tf32: bool = True
    grad_clip: float | None = Field(default=None, gt=0.0)
    warmup_steps: int = Field(default=0, ge=0)
    lr_decay: Literal["none", "cosine", "linear"] = "none"
    # Whether the sparse embedding optimizer's lr follows the warmup and decay too (it does by
    # default) or stays at sparse_lr for the whole run.
    sparse_lr_schedule: Literal["follow", "constant"] = "follow"
    sync_bn: bool = False
    # numpy's generators (each epoch's batch order) take no negative seed; torch's none past 2**64.
    seed: int = Field(default=0, ge=0, lt=2**64)
    early_stopping: EarlyStopping | None = None
    keep_checkpoints: int = Field(default=2, ge=1)
    max_failures: int = Field(default=0, ge=-1, description="-1: retry forever")
    run_name: str | None = Field(default=None, pattern=NAME_PATTERN, max_length=RUN_NAME_MAX)
    storage_path: str | None = None
    prefetch_batches: int = Field(default=2, ge=0)
    shuffle_buffer: int = Field(default=0, ge=0, description="rows in each worker's local shuffle buffer")
    # Keep the decoded training rows in Ray's object store after one read (spilled to disk when
    # they do not fit): later epochs skip Parquet decoding, which competes with training for CPU.
    cache_dataset: bool = True
    # Each worker keeps its collated training batches in its own memory after the first epoch
    # when they fit in this many MiB: later epochs read nothing (no Ray Data execution, no
    # collation) and deal the kept rows out anew in an order seeded per rank and epoch. 0
    # streams every epoch from Ray Data; so does shuffle_buffer > 0 (Ray Data's local shuffle
    # over the stream). A worker restarted after a failure reads the cache again before its
    # first epoch and trains in that epoch's seeded order, as the run would have uninterrupted.
    worker_cache_mb: int = Field(default=1024, ge=0, description="per-worker in-memory batch cache after epoch 1 (0: stream every epoch)")
    # Transfer learning: start from this checkpoint's weights and fitted features (its IDs and
    # scales keep their meaning); `freeze` names the parts that stay fixed (feature extraction).
    init_from: str | None = None
    freeze: list[Literal["embeddings", "first_order", "dense_vectors", "deep", "bottom", "top", "cross"]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _freeze_needs_init(self) -> "TrainSpec":
        if self.freeze and not self.init_from:
            raise ValueError(f"freeze={self.freeze} needs init_from: a checkpoint whose weights are kept fixed")
        return self


class ElasticWorkers(_Spec):
    min: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _order(self) -> "ElasticWorkers":
        if self.min > self.max:
            raise ValueError(f"min must be <= max, got min={self.min}, max={self.max}")
        return self


class ResourcesSpec(_Spec):
    workers: Annotated[int, Field(ge=1)] | ElasticWorkers = Field(default=1)
    cpus_per_worker: RayQuantity = Field(default=1.0, gt=0.0)
    gpus_per_worker: GpuQuantity = Field(default=0.0, ge=0.0)
    accelerator_type: str | None = None
    # A job that asks for more than the cluster has fails after this long instead of hanging.
    # None: 60 s, or 15 minutes where an autoscaler can add nodes (train/resources.placement_timeout).
    placement_timeout_s: float | None = Field(default=None, gt=0.0, le=86_400)
    # GPU workers whose GPUs CUDA cannot see (logical GPUs of a fake multi-node cluster) train
    # on CPU with a warning, over gloo; without this they stop with an error.
    cpu_fallback: bool = False


class EvalSpec(_Spec):
    split: Literal["val", "test"] = "test"
    batch_size: int = Field(default=8192, ge=1)
    calibration_bins: int = Field(default=10, ge=2)


# ---------------------------------------------------------------- job


class JobSpec(_Spec):
    name: str = Field(min_length=1, pattern=NAME_PATTERN, max_length=JOB_NAME_MAX)
    data: DataSpec
    split: SplitSpec = Field(default_factory=SplitSpec)
    rebalance: RebalanceSpec = Field(default_factory=RebalanceSpec)
    features: FeatureSpec = Field(default_factory=FeatureSpec)
    model: ModelSpec = Field(default_factory=ModelSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)


def load_spec(path: str, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """Read a job spec YAML, apply dotted `key=value` overrides, and validate it.

    Raises `SpecError` listing every problem (field path, value given, what is allowed, file).
    """
    from ._spec_checks import check_job
    from ._spec_load import load_model

    return load_model(JobSpec, path, overrides, check=check_job)
