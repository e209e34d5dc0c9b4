# ddpack: the front door. Logic lives in Python (entrypoint/, train/, ddpack/); this file only wires it.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON        ?= python3
VENV          ?= .venv
# The images' torch (ddpack/images/images.py holds the one definition), for the host venv too.
ifeq ($(origin TORCH_VERSION),undefined)
TORCH_VERSION := $(shell sed -n 's/^DEFAULT_TORCH_VERSION = "\(.*\)"$$/\1/p' ddpack/images/images.py)
endif
# Extra pip options for the host venv's torch, e.g. PIP_TORCH_OPTS='--index-url https://download.pytorch.org/whl/cpu'
PIP_TORCH_OPTS ?=
PYTEST_ARGS   ?=
BENCH_START_ARGS ?=
BENCH_GOODPUT_ARGS ?=
BENCH_LIFECYCLE_ARGS ?=
BENCH_EXPERIMENTS_ARGS ?=
# make report: the run folder (holding metrics.jsonl) and options (--png: also one summary image).
RUN           ?=
REPORT_ARGS   ?=
# e.g. --against ddpack:nocc (an image built with BUILD_ARGS='--build-arg WITH_COMPILER=0'); --only-against
BENCH_SQSH_ARGS ?=
BENCH_GPU_ARGS ?=
BENCH_HOST_ARGS ?=
BENCH_MEMBERS_ARGS ?=
# e.g. --rounds 3, --busy-ok (a loaded host: figures labelled), --sizes 2,16 --swap-sizes 3,16 (no 64), --pad-mb 64
BENCH_SCALE_ARGS ?=
GPU_CHECK_ARGS ?=

# Images: $(IMAGE):$(TAG) (CPU) and $(IMAGE):$(TAG)-gpu.
IMAGE         ?= ddpack
# Evaluated once per make run (not at each use, as ?= would): a commit during a long build must not give its
# image and its squashfs different names.
ifeq ($(origin TAG),undefined)
TAG           := $(shell git describe --always --dirty 2>/dev/null || echo dev)
endif
# Empty: python:3.11-slim-bookworm, or a base built from Debian's archive when that cannot be pulled.
BASE_IMAGE    ?=
# A folder of wheels (torch...) to install from; empty: pip's find-links folders (ddpack/images/build_inputs.py).
WHEELHOUSE    ?=
# A CA bundle for TLS to the package index during builds (a BuildKit secret: never stored in the image);
# empty: pip's cert (PIP_CERT or pip's config), else SSL_CERT_FILE.
CA_BUNDLE     ?=
BUILD_ARGS    ?=
# Your own project on top (make image APP=../myproj APP_CMD='python train.py'): its requirements, then its code
# at /opt/app. The image is named after the project's folder (APP_IMAGE) and built on $(IMAGE):$(TAG).
APP           ?=
APP_CMD       ?=
APP_IMAGE     ?= $(if $(APP),$(shell basename '$(abspath $(APP))' | tr 'A-Z' 'a-z'))
# 1: build with no network at all; torch and the app's requirements come from WHEELHOUSE alone.
OFFLINE       ?=
NAME          := $(or $(APP_IMAGE),$(IMAGE))
export APP_CMD
# Push: the ECR repository (created when missing) and, for stand-ins, a registry host to use instead
# (ddpack's own name: the common REGISTRY, set for something else, would send the ECR token there unseen).
ECR_REPOSITORY ?= $(NAME)
DDPACK_REGISTRY ?=
AWS_REGION    ?=
PUSH_ARGS     ?=
# Squashfs output (pyxis: srun --container-image=/fsx/.../x.sqsh) and converter (auto: layers, else enroot, else mksquashfs).
SQSH          ?= build/$(NAME)+$(TAG).sqsh
SQSH_GPU      ?= build/$(NAME)+$(TAG)-gpu.sqsh
SQSH_CONVERTER ?= auto
# e.g. --force: convert even when SQSH already holds this image
SQSH_ARGS     ?=

VPY := $(VENV)/bin/python
CPU_REF := $(NAME):$(TAG)
GPU_REF := $(NAME):$(TAG)-gpu
# With APP: the project's build options (the bundle's image under it keeps the name $(IMAGE)).
APP_OPTS = $(if $(APP),--app '$(APP)' --app-cmd "$$APP_CMD" --bundle-tag $(IMAGE):$(TAG)$(1)) $(if $(OFFLINE),--offline)
AWS_ENV := AWS_REGION='$(AWS_REGION)' DDPACK_REGISTRY='$(DDPACK_REGISTRY)'
IMAGE_ENV := BASE_IMAGE='$(BASE_IMAGE)' WHEELHOUSE='$(WHEELHOUSE)' CA_BUNDLE='$(CA_BUNDLE)' TORCH_VERSION='$(TORCH_VERSION)'

.PHONY: help venv test test-quick lint bench bench-members bench-images bench-sqsh bench-start bench-goodput bench-lifecycle bench-experiments bench-restart bench-scale bench-gpu bench-host gpu-check clean engine base image image-gpu smoke push push-gpu enroot-credentials sqsh sqsh-gpu report

help: ## list targets and variables
	@echo "ddpack - build, ship and launch PyTorch DDP in containers on Slurm"
	@echo
	@echo "Targets:"
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'
	@echo
	@echo "Variables (make VAR=value or environment):"
	@echo "  IMAGE=$(IMAGE) TAG=$(TAG)  ->  $(CPU_REF), $(GPU_REF)"
	@echo "  APP=$(APP) APP_CMD=$(APP_CMD) APP_IMAGE=$(APP_IMAGE) (your project on top; the image is named after its folder) OFFLINE=$(OFFLINE)"
	@echo "  BASE_IMAGE=$(BASE_IMAGE) (empty: python:3.11-slim-bookworm, else a Debian-archive base)"
	@echo "  WHEELHOUSE=$(WHEELHOUSE) (empty: pip's find-links) CA_BUNDLE=$(CA_BUNDLE) (empty: pip's cert, else SSL_CERT_FILE)"
	@echo "  BUILD_ARGS=$(BUILD_ARGS) (e.g. --build-arg INSTALL_EFA=1 for image-gpu)"
	@echo "  DDPACK_REGISTRY=$(DDPACK_REGISTRY) AWS_REGION=$(AWS_REGION) ECR_REPOSITORY=$(ECR_REPOSITORY) PUSH_ARGS=$(PUSH_ARGS)"
	@echo "  SQSH=$(SQSH) SQSH_GPU=$(SQSH_GPU) SQSH_CONVERTER=$(SQSH_CONVERTER) SQSH_ARGS=$(SQSH_ARGS) ENROOT_SQUASH_OPTIONS=$(ENROOT_SQUASH_OPTIONS)"
	@echo "  PYTHON=$(PYTHON) VENV=$(VENV) TORCH_VERSION=$(TORCH_VERSION) PIP_TORCH_OPTS=$(PIP_TORCH_OPTS)"
	@echo "  PYTEST_ARGS=$(PYTEST_ARGS) BENCH_START_ARGS=$(BENCH_START_ARGS) (--baseline-image IMG, --journaled-data DIR, --rounds N)"
	@echo "  BENCH_GOODPUT_ARGS=$(BENCH_GOODPUT_ARGS) (--rounds N, --fsx-mbps MB/s)"
	@echo "  BENCH_EXPERIMENTS_ARGS=$(BENCH_EXPERIMENTS_ARGS) (--rounds N, --runs N: run folders for ls)"
	@echo "  BENCH_SQSH_ARGS=$(BENCH_SQSH_ARGS) (--against IMG [--only-against]: what IMAGE:TAG costs over IMG)"
	@echo "  BENCH_GPU_ARGS=$(BENCH_GPU_ARGS) (--steps N, --seconds S, --dry-run-on-cpu)"
	@echo "  RUN=$(RUN) REPORT_ARGS=$(REPORT_ARGS) (make report: the run folder holding metrics.jsonl; --png: also one summary image)"

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet $(PIP_TORCH_OPTS) "torch==$(TORCH_VERSION)"
	$(VPY) -m pip install --quiet -e '.[dev]'
	touch $@

venv: $(VENV)/.installed ## create the host virtual environment (torch CPU, test and host tools)

test: venv ## run every test tier available on this machine
	$(VPY) -m pytest $(PYTEST_ARGS)

test-quick: venv ## run the fast tier only (no multi-process, Docker, Slurm or pyxis tests)
	$(VPY) -m pytest -m 'not dist and not docker and not slurm and not pyxis' $(PYTEST_ARGS)

# The product's folders, whose every file `make lint` holds to ruff's format as well as its rules (the whole tree's);
# tests/test_lint.py runs these same commands, read from here, so CI checks what the Makefile promises.
LINT_PATHS := ddpack train entrypoint enroot ddpack_run
lint: venv ## ruff check over the whole tree, ruff format --check over every product file (LINT_PATHS)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

bench: venv ## print trainer throughput, snapshot stall vs a synchronous write, preflight vs direct all-reduce, launcher start-up, the Lightning callback's cost, recovery table (Slurm)
	$(VPY) bench/bench_train.py
	$(VPY) bench/bench_snapshot.py
	$(VPY) bench/bench_preflight.py
	$(VPY) bench/bench_launcher.py
	$(VPY) bench/bench_frameworks.py
	$(VPY) bench/bench_recovery.py

engine: venv ## make sure a Docker engine answers (starts Debian's dockerd when root)
	@$(VPY) -m ddpack.images.engine --start

base: engine ## build the offline base image from Debian's archive (debootstrap)
	$(VPY) -m ddpack.images.base

image: engine ## build the CPU image IMAGE:TAG (gloo); APP=DIR: your project on it, as APP_IMAGE:TAG
	$(IMAGE_ENV) $(VPY) -m ddpack.images.images --variant cpu --tag $(CPU_REF) --version $(TAG) $(call APP_OPTS,) $(BUILD_ARGS)

image-gpu: engine ## build the CUDA image IMAGE:TAG-gpu (nccl); APP=DIR: your project on it
	$(IMAGE_ENV) $(VPY) -m ddpack.images.images --variant gpu --tag $(GPU_REF) --version $(TAG) $(call APP_OPTS,-gpu) $(BUILD_ARGS)

smoke: image ## two-container gloo DDP run (pair, then torchrun 2x2), each after its preflight, with plain docker; APP=DIR: your program
	$(VPY) -m ddpack.jobs.smoke --image $(CPU_REF)

bench-gpu: venv ## print the preflight's bf16 matmul vs a bare loop and the trainer's GPT (~92M, bf16) step vs a bare DDP loop, on one GPU
	$(VPY) bench/bench_gpu.py $(BENCH_GPU_ARGS)

bench-host: venv ## print the GPU step's host work on a CPU: the trainer's CUDA path vs a bare DDP loop, one core, A B A B (goal: <= 150 µs/step more)
	$(VPY) bench/bench_host.py $(BENCH_HOST_ARGS)

# On a lent GPU machine: torch and pytest are all it needs (no venv, Docker, Slurm or network); the figures and logs land in GPU_CHECK_DIR.
GPU_CHECK_DIR ?= build/gpu-check
gpu-check: ## on a GPU machine (torch + pytest alone): the GPU tier, bench_gpu eager/--compile/bare A B A B, a profile, a GPU-bound batch; into GPU_CHECK_DIR
	$(PYTHON) bench/gpu_check.py --out '$(GPU_CHECK_DIR)' --commit '$(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)' $(GPU_CHECK_ARGS)

bench-images: engine ## print image size vs floor, cold and one-line-change build times, GPU image size
	$(IMAGE_ENV) $(VPY) bench/bench_images.py --gpu

bench-sqsh: image ## print make sqsh next to enroot import, the floors, and size/convert/unpack per compression
	$(VPY) bench/bench_sqsh.py --image $(CPU_REF) $(BENCH_SQSH_ARGS)

bench-start: image ## print srun -> first training step under pyxis: make sqsh vs enroot import (root, Slurm+pyxis)
	$(VPY) bench/bench_start.py --image $(CPU_REF) $(BENCH_START_ARGS)

bench-goodput: sqsh ## print sbatch -> first step and failure -> training again under pyxis, today's path vs ddpack's, and the model at 2-1,024 nodes (root, Slurm+pyxis)
	$(VPY) bench/bench_goodput.py --sqsh $(SQSH) $(BENCH_GOODPUT_ARGS)

bench-lifecycle: venv ## print ddpack submit with nothing changed vs plain sbatch, and ddpack status on 100,000 progress records vs tail (Slurm, Docker)
	$(VPY) bench/bench_lifecycle.py $(BENCH_LIFECYCLE_ARGS)

bench-experiments: venv ## print a 100-point sweep's own cost beyond one submit, and ddpack ls on 1,000 runs (fake Slurm: ddpack's own work)
	$(VPY) bench/bench_experiments.py $(BENCH_EXPERIMENTS_ARGS)

bench-members: venv ## print in-process recovery's protocol with simulated members against one store on this host: the store's capacity, heartbeat writes/s and death -> decision p50/p99 (BENCH_MEMBERS_ARGS: --nodes N --ranks R --trials T)
	$(VPY) bench/bench_members.py $(BENCH_MEMBERS_ARGS)

bench-restart: venv ## print a killed rank's restart in place, the job program at fa34be6 against now, A B A B, and where the seconds go (root, Slurm); BENCH_RESTART_ARGS=--standbys: today's path against in-process recovery on the cluster, --local: on this host
	$(VPY) bench/bench_restart.py $(BENCH_RESTART_ARGS)

bench-scale: venv ## print a start's and a spare swap's time at 2, 16 and 64 emulated nodes (a second Slurm instance), where it goes, corrected for this host's CPUs, and the job's Slurm calls (root, Slurm+pyxis; under the cluster lock)
	flock /tmp/ddpack-cluster.lock $(VPY) bench/bench_scale.py $(BENCH_SCALE_ARGS)

push: engine ## push IMAGE:TAG to ECR (boto3 + docker SDK; AWS_REGION, ECR_REPOSITORY, PUSH_ARGS)
	$(AWS_ENV) $(VPY) -m ddpack.images.push --image $(CPU_REF) --repository $(ECR_REPOSITORY) --tag $(TAG) $(PUSH_ARGS)

push-gpu: engine ## push IMAGE:TAG-gpu to ECR
	$(AWS_ENV) $(VPY) -m ddpack.images.push --image $(GPU_REF) --repository $(ECR_REPOSITORY) --tag $(TAG)-gpu $(PUSH_ARGS)

enroot-credentials: venv ## write enroot's ECR credential line ($$ENROOT_CONFIG_PATH/.credentials, mode 600)
	$(AWS_ENV) $(VPY) -m ddpack.images.credentials

sqsh: engine ## convert IMAGE:TAG to an Enroot squashfs at SQSH (atomic, validated)
	@mkdir -p build
	$(VPY) -m ddpack.images.sqsh --image $(CPU_REF) --output $(SQSH) --converter $(SQSH_CONVERTER) $(SQSH_ARGS)

sqsh-gpu: engine ## convert IMAGE:TAG-gpu to an Enroot squashfs at SQSH_GPU
	@mkdir -p build
	$(VPY) -m ddpack.images.sqsh --image $(GPU_REF) --output $(SQSH_GPU) --converter $(SQSH_CONVERTER) $(SQSH_ARGS)

report: venv ## write RUN/report.html (loss, throughput and MFU, per-rank step times, segments, preflight) from a run folder; REPORT_ARGS=--png
	@[ -n "$(RUN)" ] || { echo "make report: error: RUN is not set; give the run folder, e.g. make report RUN=runs/ddp-1234" >&2; exit 2; }
	$(VPY) -m ddpack.jobs.report '$(RUN)' $(REPORT_ARGS)

clean: ## remove the venv, caches and build outputs
	rm -rf $(VENV) .pytest_cache .ruff_cache build out *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
