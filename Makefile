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

# Two pytest workers on two cores: the pipeline tests (one shared smoke repo) in one, the rest
# (unit, Prefect, servers) in the other. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
test: install
	$(BIN)/python -m pytest -ra $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup) $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
