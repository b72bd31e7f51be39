# The README's two commands: `make demo` and `make test`. Both create .venv when absent and
# install with the tested pins in constraints.txt (torch 2.13.0 resolves to the CPU wheel here).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rayload-installed

.PHONY: demo test test-unit test-integration bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m compileall -q platform
	$(BIN)/rayload demo

# Two pytest workers, one test file each at a time (module fixtures such as a module's local Ray
# or Ray head stay in one worker): a single worker left a quarter of the two cores idle while
# Ray, Serve and subprocesses start up (CPU busy 68% -> 91%, 22.5 -> 16.8 min measured).
# Files go out in collection order (e2e, integration, then the many short unit files that fill
# the end); xdist's default reorder by test count sent the two-test, two-minute A/B decision
# file last, to run alone while the other worker sat idle.
# compileall first: this machine (and CI) sets PYTHONDONTWRITEBYTECODE=1, so without it each of
# the hundreds of Python processes a run starts (Ray workers, CLI calls, jobs) compiled rayload
# from source again (~0.3 s each; site-packages were compiled by pip at install).
test: $(STAMP)
	$(BIN)/python -m compileall -q platform
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=20 tests

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit tests/test_specs.py

test-integration: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests/integration

bench: $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -e '.[bench]'
	$(BIN)/python benchmarks/bench_preprocess.py
	$(BIN)/python benchmarks/bench_training.py
	$(BIN)/python benchmarks/bench_train_floor.py
	$(BIN)/python benchmarks/bench_movielens_accuracy.py
	$(BIN)/python benchmarks/bench_serve.py --client aiohttp
	$(BIN)/python benchmarks/bench_serve.py --client aiohttp --ingress direct
	$(BIN)/python benchmarks/bench_serve_parts.py
	$(BIN)/python benchmarks/bench_tune.py overhead
	$(BIN)/python benchmarks/bench_tune.py branin
	$(BIN)/python benchmarks/bench_tune.py asha-stream --target 0.8056 --budget 360
	$(BIN)/python benchmarks/bench_compress.py
	$(BIN)/python benchmarks/bench_demo.py

clean:
	rm -rf runs .pytest_cache
