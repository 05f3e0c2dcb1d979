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

# Unit and pipeline tests on two pytest workers (two groups of pipeline tests, each with its own
# smoke repo; TEST_WORKERS=0: one process); then the server tests (Prefect, MLflow, S3, Postgres,
# workers) in one process, in file order: they share module state and servers.
TEST_WORKERS ?= 2
test: install
	$(BIN)/python -m pytest -ra $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup) tests/unit tests/pipelines $(PYTEST_ARGS)
	$(BIN)/python -m pytest -ra tests/prefect tests/stack $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
