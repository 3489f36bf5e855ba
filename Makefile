# Thin wrappers over `python -m train`. Every target that fails prints the underlying exit code
# (make itself can only exit 2), and nothing here masks a failure.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
CONFIG ?= configs/default.yaml
NPROC ?= auto
RUN ?=
SET ?=
DRY_RUN ?=
PYTEST_ARGS ?=
BENCH_ARGS ?=
OUT ?=
INPUT ?=
STEPS ?=
TASK ?=
CHECKPOINT ?=
FORMAT ?= onnx
SWEEP ?=
NAME ?=
SLURM ?=
# Container targets: CPU=1 on hosts without GPUs (the -cpu services); BASE_IMAGE picks the image's base.
COMPOSE ?= docker compose
COMPOSE_FILES ?= compose.yaml
CPU ?=
BASE_IMAGE ?=
EXTRAS ?=
GPU_CHECKS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TRAIN_ARGS = --config $(CONFIG) --nproc $(NPROC) $(if $(RUN),--run $(RUN)) $(foreach s,$(SET),--set $(s)) $(if $(DRY_RUN),--dry-run)

# Run a command; on failure say which exit code it returned, then fail with it.
define checked
	@$(1) || { code=$$?; echo "make: '$(strip $(1))' exited with code $$code" >&2; exit $$code; }
endef

.PHONY: help install gpu-check train data cache fit evaluate doctor smoke-test shard push slurm skypilot kubernetes skypilot-parser sweep predict export consolidate bench test test-unit test-distributed test-integration test-load test-multinode test-slurm lint format clean build up docker-smoke docker-test

help: ## List the targets
	@echo "Usage: make TARGET [CONFIG=configs/x.yaml] [NPROC=auto|N] [RUN=name] [SET=\"key=value ...\"]"
	@echo "Environment: DEBUG=1 (NCCL/c10d debug, flight recorder, all ranks on the console), SKIP_DOCTOR=1"
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

install: $(STAMP) ## Create .venv with the package and its dev tools (idempotent)

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "make install: $(PYTHON) not found; install Python 3.10+" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	@touch $@

train: install ## All stages: data, cache, training under torchrun, evaluation and report
	$(call checked,$(BIN)/python -m train run $(TRAIN_ARGS))

data: install ## Generate or locate each task's HDF5 data
	$(call checked,$(BIN)/python -m train data $(TRAIN_ARGS))

cache: install ## Build the memory-mapped caches
	$(call checked,$(BIN)/python -m train cache $(TRAIN_ARGS))

fit: install ## Train only (resumes from the newest checkpoint)
	$(call checked,$(BIN)/python -m train fit $(TRAIN_ARGS))

evaluate: install ## Test metrics and report of the newest checkpoint
	$(call checked,$(BIN)/python -m train evaluate $(TRAIN_ARGS))

doctor: install ## Check this machine against CONFIG: GPUs, /dev/shm, SLURM, ports, disk, data (exit 4 on a fail)
	$(call checked,$(BIN)/python -m train doctor --config $(CONFIG) --nproc $(NPROC) $(foreach s,$(SET),--set $(s)))

smoke-test: install ## Collectives, 5 DDP steps vs one process, checkpoint round trip, torch.compile (seconds)
	$(call checked,$(BIN)/python -m train smoke --config $(CONFIG) --nproc $(NPROC) $(foreach s,$(SET),--set $(s)))

shard: install ## Each task's data as a shard set to stream (data.stream: true): OUT=folder (default shards/) [SHARD_MB=256] [PUBLISHED=1: the files as published are the shards]
	$(call checked,$(BIN)/python -m train shard --config $(CONFIG) $(foreach s,$(SET),--set $(s)) $(if $(OUT),--output $(OUT)) $(if $(SHARD_MB),--shard-mb $(SHARD_MB)) $(if $(PUBLISHED),--published))

push: install ## Mirror runs/<name> to run.remote now, what a launch could not send (exit 4 naming what is missing)
	$(call checked,$(BIN)/python -m train push --config $(CONFIG) $(if $(RUN),--run $(RUN)) $(foreach s,$(SET),--set $(s)))

slurm: install ## Render an sbatch file from CONFIG's slurm section (SET="slurm.nodes=2 ..."; OUT=file)
	$(call checked,$(BIN)/python -m train slurm --config $(CONFIG) $(foreach s,$(SET),--set $(s)) $(if $(OUT),--output $(OUT)))

skypilot: install ## Render a SkyPilot task (a managed job) from CONFIG's skypilot section (SET="skypilot.nodes=2 run.remote=..."; OUT=file)
	$(call checked,$(BIN)/python -m train skypilot --config $(CONFIG) $(foreach s,$(SET),--set $(s)) $(if $(OUT),--output $(OUT)))

kubernetes: install ## Render an Indexed Job, its headless Service and a ConfigMap from CONFIG's kubernetes section (OUT=file)
	$(call checked,$(BIN)/python -m train kubernetes --config $(CONFIG) $(foreach s,$(SET),--set $(s)) $(if $(OUT),--output $(OUT)))

sweep: install ## Search many runs: CONFIG plus the search space SWEEP=space.yaml, each trial a run in runs/<sweep>/ [NAME= SET= SLURM=1]
	$(call checked,$(BIN)/python -m train sweep --config $(CONFIG) --space $(SWEEP) $(if $(NAME),--name $(NAME)) $(foreach s,$(SET),--set $(s)) $(if $(SLURM),--slurm))

predict: install ## A trained run's predictions on an HDF5 file: RUN=name|folder INPUT=file.h5 OUT=pred.h5 [STEPS=N TASK=name CHECKPOINT=best]
	$(call checked,$(BIN)/python -m train predict --run $(RUN) --input $(INPUT) --output $(OUT) $(if $(STEPS),--steps $(STEPS)) $(if $(TASK),--task $(TASK)) $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)))

export: install ## A trained run as files that run without this package: RUN=name|folder [FORMAT=onnx|torchscript OUT=folder TASK=name]
	$(call checked,$(BIN)/python -m train export --run $(RUN) --format $(FORMAT) $(if $(OUT),--output $(OUT)) $(if $(TASK),--task $(TASK)) $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)))

consolidate: install ## A sharded checkpoint (a .dcp folder of every rank's shards) as one .pt file: RUN=name|folder [CHECKPOINT=latest|best|name OUT=file]
	$(call checked,$(BIN)/python -m train consolidate --run $(RUN) $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)) $(if $(OUT),--output $(OUT)))

bench: install ## Benchmarks -> runs/bench/: data loading (cache-io), trainer vs bare DDP step time (trainer), models and objectives (models), slow remote (remote), streaming from a throttled store (stream), the Well demo (well), fine-tuning vs scratch (finetune), pretraining (pretrain), its transfer to held-out physics over seeds (transfer), published-size data in 4 GB (scale, only when named); BENCH_ARGS="well"
	$(call checked,$(BIN)/python -m train.bench $(BENCH_ARGS))

gpu-check: ## On one GPU (~12 min): samples/s + GPU busy, no host sync, time to accuracy, FSDP2, NCCL smoke, bf16, bitwise resume -> runs/gpu-check/ (exit 0 without a GPU)
	$(call checked,scripts/gpu-check.sh $(GPU_CHECKS))

test: install skypilot-parser ## Every tier, two at a time from one queue (tests/tiers.py); a table of their times
	$(call checked,$(BIN)/python -m tests.tiers $(PYTEST_ARGS))

SKYPILOT_VENV ?= .venv-skypilot
skypilot-parser: $(SKYPILOT_VENV)/.installed ## SkyPilot's own task parser, which the tests load rendered tasks with (a venv of its own: it pins click<8.2, which wandb outgrew)

$(SKYPILOT_VENV)/.installed:
	$(PYTHON) -m venv $(SKYPILOT_VENV)
	$(SKYPILOT_VENV)/bin/python -m pip install --quiet 'skypilot==0.14.1'
	@touch $@

test-unit: install ## Unit tests only
	$(call checked,$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS))

test-distributed: install ## Tests with 2 gloo ranks
	$(call checked,$(BIN)/python -m pytest tests/distributed $(PYTEST_ARGS))

test-integration: install ## torchrun end-to-end tests
	$(call checked,$(BIN)/python -m pytest tests/integration $(PYTEST_ARGS))

LOAD ?= 2
test-load: install ## The integration tier beside LOAD (2) busy processes, as on a shared machine (slow: not in CI)
	$(call checked,$(BIN)/python -m pytest tests/integration --cpu-load=$(LOAD) $(PYTEST_ARGS))

test-multinode: install ## Two launchers on two network namespaces without a shared disk (root and iproute2; skipped with the reason elsewhere)
	$(call checked,$(BIN)/python -m pytest tests/multinode $(PYTEST_ARGS))

test-slurm: install ## sbatch jobs on a SLURM cluster (skipped, with the reason, when none answers; scripts/ci/provision-slurm.sh makes one)
	$(call checked,$(BIN)/python -m pytest tests/slurm $(PYTEST_ARGS))

lint: install ## ruff lint and format check, hadolint on the Dockerfiles
	$(call checked,$(BIN)/ruff check .)
	$(call checked,$(BIN)/ruff format --check .)
	$(call checked,$(BIN)/hadolint Dockerfile scripts/ci/base-cpu.Dockerfile)

format: install ## Apply ruff's fixes and formatting
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

COMPOSE_CMD = $(COMPOSE) $(foreach f,$(COMPOSE_FILES),-f $(f)) $(if $(CPU),--profile cpu)
SUFFIX = $(if $(CPU),-cpu)
COMPOSE_ENV = $(if $(BASE_IMAGE),BASE_IMAGE=$(BASE_IMAGE)) $(if $(EXTRAS),EXTRAS=$(EXTRAS)) CONFIG=$(CONFIG) NPROC=$(NPROC) \
	TRAIN_ARGS="$(if $(RUN),--run $(RUN)) $(foreach s,$(SET),--set $(s))"

build: ## Build the image (BASE_IMAGE=... picks the base; EXTRAS=wandb bakes in W&B; wheels/ for an offline build)
	$(call checked,$(COMPOSE_ENV) $(COMPOSE_CMD) build train$(SUFFIX))

up: ## Train CONFIG in the container (docker compose up train; CPU=1: train-cpu)
	@mkdir -p data cache runs
	@# The container runs as uid 1000: as root, hand it the mounted folders (another user's own are theirs).
	@if [ "$$(id -u)" = 0 ]; then chown 1000:1000 data cache runs; fi
	$(call checked,$(COMPOSE_ENV) $(COMPOSE_CMD) up --abort-on-container-exit --exit-code-from train$(SUFFIX) train$(SUFFIX))

docker-smoke: ## The smoke test in the container (docker compose run --rm smoke-test; CPU=1: smoke-test-cpu)
	$(call checked,$(COMPOSE_ENV) $(COMPOSE_CMD) run --rm smoke-test$(SUFFIX))

docker-test: install ## Container tests against the Docker engine (skipped, with the reason, when there is none)
	$(call checked,$(BIN)/python -m pytest tests/container $(PYTEST_ARGS))

clean: ## Remove generated data, caches and runs (keeps .venv)
	rm -rf data cache runs
