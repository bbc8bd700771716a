# The two commands: `make demo` and `make test`. Each sets up .venv on first use.
# `make test-fast`: the pure and hostile-input tests only (no `slow` ones: multi-process, servers, long trials).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch 2.13.0 is a CPU build on these machines; a looser pin downloads a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m zarrckpt.demo

lint: $(STAMP)
	$(BIN)/ruff check zarrckpt zarrckpt_dtypes tests benchmarks
	$(BIN)/ruff format --check zarrckpt zarrckpt_dtypes tests benchmarks
	$(BIN)/mypy --strict zarrckpt zarrckpt_dtypes  # exceptions: pyproject [tool.mypy]

test: lint
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py --out benchmarks/results/latest.md

clean:
	rm -rf $(VENV) demo-checkpoints .pytest_cache .mypy_cache .ruff_cache
