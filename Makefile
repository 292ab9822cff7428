# Tandem developer entry points. `make test` is what CI runs (via .ci/run).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: test lint bench-scheduler clean

$(BIN)/activate: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(BIN)/activate

lint: $(BIN)/activate
	$(BIN)/ruff check scheduler kv_transfer tests bench
	$(BIN)/ruff format --check scheduler kv_transfer
	$(BIN)/mypy scheduler kv_transfer

test: lint
	$(BIN)/python -m pytest -q

bench-scheduler: $(BIN)/activate
	$(BIN)/python bench/scheduler_overhead.py --out bench/results/scheduler_overhead.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
