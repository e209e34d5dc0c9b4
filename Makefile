# ddpack: the front door. Logic lives in Python (entrypoint/, train/, ddpack/); this file only wires it.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON        ?= python3
VENV          ?= .venv
TORCH_VERSION ?= 2.13.0
# Extra pip options for the host venv's torch, e.g. PIP_TORCH_OPTS='--index-url https://download.pytorch.org/whl/cpu'
PIP_TORCH_OPTS ?=
PYTEST_ARGS   ?=

VPY := $(VENV)/bin/python

.PHONY: help venv test test-quick lint bench clean

help: ## list targets and variables
	@echo "ddpack - build, ship and launch PyTorch DDP in containers on Slurm"
	@echo
	@echo "Targets:"
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'
	@echo
	@echo "Variables (make VAR=value or environment):"
	@echo "  PYTHON=$(PYTHON) VENV=$(VENV) TORCH_VERSION=$(TORCH_VERSION)"
	@echo "  PIP_TORCH_OPTS=$(PIP_TORCH_OPTS) PYTEST_ARGS=$(PYTEST_ARGS)"

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet $(PIP_TORCH_OPTS) "torch==$(TORCH_VERSION)"
	$(VPY) -m pip install --quiet -e '.[dev]'
	touch $@

venv: $(VENV)/.installed ## create the host virtual environment (torch CPU, test and host tools)

test: venv ## run every test tier available on this machine
	$(VPY) -m pytest $(PYTEST_ARGS)

test-quick: venv ## run the fast tier only (no multi-process, Docker or Slurm tests)
	$(VPY) -m pytest -m 'not dist and not docker and not slurm' $(PYTEST_ARGS)

lint: venv ## ruff over the whole tree
	$(VENV)/bin/ruff check .

bench: venv ## print trainer throughput and launcher start-up figures
	$(VPY) bench/bench_train.py
	$(VPY) bench/bench_launcher.py

clean: ## remove the venv, caches and build outputs
	rm -rf $(VENV) .pytest_cache .ruff_cache build out *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
