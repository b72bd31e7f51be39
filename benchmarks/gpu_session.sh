#!/usr/bin/env bash
# The GPU checks in one go, for a lent CUDA machine that has PyTorch but not this project's
# other dependencies and no package registry: the `gpu`-marked tests, the training loop's unit
# tests on that machine's PyTorch, bench_gpu.py, and `rayload train` of the shipped DLRM job on
# one GPU worker.
#
# BUNDLE (default .gpu/) holds what the machine lacks, made on a machine with a registry:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .gpu pydantic pydantic_core annotated-types \
#     typing-inspection typing_extensions jsonschema jsonschema-specifications referencing rpds-py \
#     SQLAlchemy optuna alembic Mako colorlog tensorboardX sniffio      # versions: constraints.txt
#   ray: its wheel is 79 MB, so it travels as .gpu/ray_trim.tar.xz (26 MB): the wheel unpacked
#   without ray/jars, ray/rllib, ray/llm and the dashboard's web client, binaries stripped.
# Ray runs in its minimal mode there (no dashboard extras), which Ray Train and Data support.
#
# Usage: benchmarks/gpu_session.sh OUTDIR
set -uo pipefail
OUT_DIR=${1:?usage: gpu_session.sh OUTDIR}
BUNDLE=${BUNDLE:-.gpu}
SITE=${SITE:-/tmp/rayload-site}
mkdir -p "$OUT_DIR" "$SITE"
if [ -f "$BUNDLE/ray_trim.tar.xz" ]; then
  tar xJf "$BUNDLE/ray_trim.tar.xz" -C "$SITE" || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$BUNDLE"/*.whl || exit 1
export PYTHONPATH="$SITE:$PWD/platform" PYTHONUNBUFFERED=1 RAYLOAD_HOME=/tmp/rayload-home
nvidia-smi -L
python3 -c "import torch, ray, pydantic; print('torch', torch.__version__, 'ray', ray.__version__, torch.cuda.get_device_name())" || exit 1
# Modules the bundle does not carry because the machine image had them on 2026-11-24 (the CLI's
# typer and rich, the data plane's pyarrow and pandas, the tests' psutil and pytest): a new image
# may not. Say which are missing, so they join the bundle's pip download line, before any check runs.
python3 - <<'PY' || exit 1
import importlib.util, sys
missing = [m for m in ("typer", "rich", "yaml", "pyarrow", "pandas", "numpy", "psutil", "pytest") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"this machine lacks {missing}: add them to the bundle (pip download line above; versions: constraints.txt)")
PY

echo "== gpu-marked tests"
python3 -m pytest -q -p no:cacheprovider tests/integration/test_gpu.py 2>&1 | tee "$OUT_DIR/gpu_tests.log" | tail -25
echo "== training loop unit tests on this PyTorch"
python3 -m pytest -q -p no:cacheprovider tests/unit/test_train_loop.py tests/unit/test_models.py > "$OUT_DIR/unit_tests.log" 2>&1
tail -5 "$OUT_DIR/unit_tests.log"
echo "== bench_gpu.py"
python3 benchmarks/bench_gpu.py --precisions tf32,bf16,fp32 --out "$OUT_DIR/bench_gpu.json" --profile "$OUT_DIR/profile.txt" 2>&1 | tee "$OUT_DIR/bench_gpu.log" | tail -20
echo "== bench_gpu.py, the dense AdamW's kernel choice (fused vs foreach)"
python3 benchmarks/bench_gpu.py --models dlrm-shipped,dlrm-large --precisions tf32:foreach,tf32:fused --out "$OUT_DIR/bench_gpu_adamw.json" 2>&1 | tail -8
if [ "${TRAIN:-1}" = 1 ]; then
  echo "== rayload train jobs/synthetic_dlrm.yaml on one GPU worker"
  timeout "${TRAIN_TIMEOUT:-300}" python3 -m rayload train jobs/synthetic_dlrm.yaml \
    --set resources.workers=1 --set resources.gpus_per_worker=1 --set resources.cpus_per_worker=8 \
    --set model.sparse_embeddings=false \
    > "$OUT_DIR/train_gpu.log" 2>&1
  echo "exit $?"; grep -v "^\s*$" "$OUT_DIR/train_gpu.log" | grep -iv "warn" | tail -25
fi
