# flashflex developer entry points. Every target sets itself up: a fresh machine needs only python3.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.flashflex-setup
PYTEST_ARGS ?=
# pytest-xdist worker processes for `make test` (0: one process). Two suit a 2-core machine: much of the suite waits
# on subprocesses, sockets and timeouts, which the other worker's tests fill (on the 2-core development VM, 2026-12-07:
# 1,280 s in one process, 895 s in two).
TEST_WORKERS ?= 2

.PHONY: setup demo demo-finetune test bench lint plans profiles clean

setup: $(STAMP)

# torch is pinned and installed first, so the package's unpinned torch requirement is already met
# (an unpinned torch would pull the CUDA build and gigabytes of packages).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: setup
	bash scripts/demo.sh

demo-finetune: setup
	bash scripts/demo_finetune.sh

test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

bench: setup
	bash scripts/bench.sh

lint: setup
	$(BIN)/ruff check src tests benchmarks

profiles: setup
	bash scripts/make_profiles.sh

plans: setup
	bash scripts/make_plans.sh

clean:
	rm -rf $(VENV) runs .pytest_cache
