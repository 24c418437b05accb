# kiln — two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch (a plain `pip install torch` pulls several GB of CUDA).
TORCH := torch==2.13.0

.PHONY: demo test lint bench install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev,bench]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/kiln demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy kiln

test: install lint
	$(BIN)/pytest -q -rs --durations=15 tests

bench: install
	$(BIN)/kiln bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
