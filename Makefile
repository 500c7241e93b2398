# Set-up and everyday commands. Every target installs what it needs into .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

COMPOSE_VENV := .venv-compose
COMPOSE_STAMP := $(COMPOSE_VENV)/.installed

.PHONY: serve test test-fast lint protos setup deploy-check fresh-check

# The runtime: CPU torch and the project, as deploy/install-runtime.sh (the one recipe, shared with the
# Dockerfiles) installs them. The embedded model is no package here: its first start fetches its GGUF.
$(STAMP): pyproject.toml deploy/install-runtime.sh deploy/editable_namespace.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	EXTRAS='[bench]' sh deploy/install-runtime.sh $(BIN)/python --editable
	touch $(STAMP)

# The test extra, apart so `make serve` never waits for it: its llama-cpp-python (MiniCPM's parity
# reference) builds llama.cpp from source once per machine (~4 min on 2 cores; pip keeps the wheel),
# without its multimodal library (unused by the tests): 140 compile steps instead of 193.
$(TEST_STAMP): $(STAMP)
	CMAKE_ARGS="-DLLAVA_BUILD=OFF" EXTRAS='[test,bench]' sh deploy/install-runtime.sh $(BIN)/python --editable
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

# The README's first command on a fresh machine (a new venv, runtime only, an empty model cache):
# installed, started, asked one question, stopped with Ctrl-C. make test runs it first.
fresh-check:
	bash tests/fresh_machine.sh

# Two pytest-xdist workers, each module whole on one, the longest handed out first (tests/conftest.py:
# MODULE_SECONDS); TEST_WORKERS=0 runs the suite in one process, one module after another.
TEST_WORKERS ?= 2
PACKAGE_DIRS := baton serving router prefill_service decode_service engine kvtransfer models benchmarks protos
test: fresh-check $(TEST_STAMP) $(COMPOSE_STAMP)
	$(BIN)/python -m protos.generate --check
	$(BIN)/ruff check .
	@# the sources' bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (CI's box), each of the
	@# suite's few hundred processes would compile the modules it imports again (~0.17 s of CPU an engine)
	$(BIN)/python -m compileall -q -j 2 $(PACKAGE_DIRS) > /dev/null
	$(BIN)/python -m pytest -q -x -rs --durations=15 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The inner loop (745 tests, ~2.5 min of CI's 2-core durations): every test but the modules that start served
# stacks or run long parity checks (tests/conftest.py: SLOW_MODULES), the tests that use a shared stack and
# the ones marked slow. Not a substitute for make test.
test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -x -m "not slow" --durations=5

lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests/test_layering.py

protos: $(TEST_STAMP)
	$(BIN)/python -m protos.generate
