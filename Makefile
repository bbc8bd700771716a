# The two commands: `make demo` and `make test`. Each sets up .venv on first use.
# `make test-fast`: the pure and hostile-input tests only (no `slow` ones: multi-process, servers, long trials).
# `make docs`: the documentation site (mkdocs.yml, docs/) into site/, a warning being an error.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast lint docs bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# a re-run (pyproject.toml newer than the stamp: `make bench`, `make test` after a change) first takes
	# torchtitan out: installed, it makes pip check every install that resolves one of its dependencies
	# (safetensors, in the test extra) and print its left-out ones (below) as an ERROR
	! $(BIN)/pip show -q torchtitan 2>/dev/null || $(BIN)/pip uninstall -q -y torchtitan
	# torch 2.13.0 is a CPU build on these machines; a looser pin downloads a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,dev,docs,lightning,ray,accelerate]'
	# torchtitan without datasets, wandb, tensorboard (0.7 GB, and datasets would hold fsspec back at
	# 2026.2): only what its checkpointer, optimizers and data loader import (tests/test_torchtitan.py);
	# installed last, so that no later pip run reports its missing dependencies as an ERROR
	$(BIN)/pip install -q torchdata tyro spmd_types==0.2.3
	$(BIN)/pip install -q --no-deps torchtitan==0.3.0
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m zarrckpt.demo

lint: $(STAMP)
	$(BIN)/ruff check zarrckpt zarrckpt_dtypes tests benchmarks
	$(BIN)/ruff format --check zarrckpt zarrckpt_dtypes tests benchmarks
	$(BIN)/mypy --strict zarrckpt zarrckpt_dtypes  # exceptions: pyproject [tool.mypy]
	$(BIN)/lint-imports  # the layers: pyproject [tool.importlinter]

# two workers, a test file each at a time: about 13 min on 2 cores instead of 18-19 (many tests wait
# on servers and process start-up); TEST_WORKERS=0 runs everything in one process
TEST_WORKERS ?= 2
test: lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]' torch==2.13.0  # s3torchconnector: a baseline of the S3 rows
	$(BIN)/python benchmarks/run.py --out benchmarks/results/latest.md --json benchmarks/results/latest.json --charts-dir docs/img
	$(BIN)/python benchmarks/tier.py --out benchmarks/results/tier.md --json benchmarks/results/tier.json  # the local tier (issue 42): restore after a node loss
	$(BIN)/python benchmarks/s3_floor.py --json benchmarks/results/s3_floor.json  # the floor under a save to S3 (issue 39)

clean:
	rm -rf $(VENV) demo-checkpoints site .pytest_cache .mypy_cache .ruff_cache
