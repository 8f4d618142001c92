# `make test` and `make demo` are the two commands a fresh clone needs (see README.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo lint unit soak clean prepare

# (Re)install when the package metadata changes; the editable install picks up code edits.
$(STAMP): setup.cfg pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check slurm_cdgpc tests
	$(BIN)/ruff format --check slurm_cdgpc tests
	$(BIN)/mypy

# what the tests need on this machine (PostgreSQL, munged, Slurm, sshd, iproute2): installed
# and started as root, named in one line each otherwise (those tests then skip)
prepare:
	@bash tests/prepare.sh

test: prepare lint
	$(BIN)/pytest

unit: $(STAMP)
	$(BIN)/pytest tests/unit

# the daemons on loopback replaying a trace slice (root, or a running munged); plots in demo-out/
demo: $(STAMP)
	$(BIN)/cdgpc-admin demo --out demo-out

# the full load and soak run (make test runs a short one): 1,000 simulated nodes, 8,000 GPUs,
# job churn for 30 simulated minutes (about 6 minutes here); JSON on stdout
soak: $(STAMP)
	$(BIN)/cdgpc-admin bench soak --nodes 1000 --gpus-per-node 8 --minutes 30 --accel 6 --json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
