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
# silently ignored. TEST_WORKERS=0: one process. Then the server tests (Prefect, MLflow, S3,
# Postgres, workers) in one process, in file order: they share module state and servers.
TEST_WORKERS ?= 2
test: install
	$(BIN)/python -m pytest -ra $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) tests/pipelines tests/unit $(PYTEST_ARGS)
	$(BIN)/python -m pytest -ra tests/prefect tests/stack $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
