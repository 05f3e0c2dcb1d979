# paperline: two commands.
#   make run [PIPELINE=<slug>]   install if needed, dvc repro the pipeline(s) at the params.yaml profile, print results
#   make test                    install if needed, run the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIPELINE ?=

# Tools write inside the work tree, never in $HOME.
export PREFECT_HOME := $(CURDIR)/.paperline/prefect
export HF_HOME := $(CURDIR)/.paperline/hf
export DVC_SITE_CACHE_DIR := $(CURDIR)/.paperline/dvc-site
export MPLCONFIGDIR := $(CURDIR)/.paperline/mpl
export SB3_LOGDIR := $(CURDIR)/.paperline/sb3
export TORCHINDUCTOR_CACHE_DIR := $(CURDIR)/.paperline/torchinductor
export MLFLOW_DISABLE_TELEMETRY := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: run test install clean-venv

$(BIN)/.installed: pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $@

install: $(BIN)/.installed

run: install
	$(BIN)/paperline repro $(if $(PIPELINE),$(PIPELINE),--all)

# Unit and pipeline tests on two pytest workers, each test file whole on one worker (its module
# fixtures, e.g. a pipeline's smoke repro, built once; each worker builds the session's smoke repo
# once). Not `--dist loadgroup`: with pytest 9 xdist 3.8 cannot tag node ids, and the groups are
# silently ignored. TEST_WORKERS=0: one process.
# The server tests (Prefect, MLflow, S3, Postgres, workers) run in one process of their own, in
# file order (they share module state and servers), at the same time as the others: they mostly
# wait on servers (328 CPU-s in 434 s of wall, measured), so side by side they save most of their
# wall time (pytest's numbered temp dirs are locked while in use, so two sessions are safe). The
# servers' log is printed after the first part's. TEST_SERIAL=1: one part after the other.
TEST_WORKERS ?= 2
TEST_SERIAL ?=
PART1 = $(BIN)/python -m pytest -ra $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) tests/pipelines tests/unit $(PYTEST_ARGS)
PART2 = PAPERLINE_TEST_STATE=servers PREFECT_HOME=$(CURDIR)/.paperline/test-state/servers/prefect $(BIN)/python -m pytest -ra -p no:cacheprovider tests/prefect tests/stack $(PYTEST_ARGS)
test: install
	@mkdir -p .paperline/pytest
ifeq ($(TEST_SERIAL),1)
	$(PART1)
	$(PART2)
else
	@rm -f .paperline/pytest/part2.log .paperline/pytest/part2.rc
	@echo "server tests (tests/prefect tests/stack) in the background: .paperline/pytest/part2.log"
	@( $(PART2) > .paperline/pytest/part2.log 2>&1; echo $$? > .paperline/pytest/part2.rc ) & \
	$(PART1); rc1=$$?; wait; \
	echo "===== server tests (tests/prefect tests/stack) ====="; cat .paperline/pytest/part2.log; \
	rc2=$$(cat .paperline/pytest/part2.rc 2>/dev/null || echo 1); \
	echo "unit+pipeline tests: exit $$rc1; server tests: exit $$rc2"; \
	test $$rc1 -eq 0 && test $$rc2 -eq 0
endif

clean-venv:
	rm -rf $(VENV)
