# Two entry points (see README): `make run` and `make test`. Both bootstrap .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test lint typecheck unit bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

## run: simulate the paper's trace1 on the default cluster with the hexgen-flow policy
run: $(BIN)/.installed
	$(BIN)/hexgen-flow simulate

## test: lint, type-check and the whole test suite (what .ci/run runs)
test: lint typecheck unit

lint: $(BIN)/.installed
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

typecheck: $(BIN)/.installed
	$(BIN)/mypy

unit: $(BIN)/.installed
	$(BIN)/python -m pytest

## bench: the paper's matrix, goodput, sweeps and plots into results/
bench: $(BIN)/.installed
	$(BIN)/hexgen-flow bench --out results

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache results
