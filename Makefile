# One entry point for users and CI. `make setup` is idempotent: a second run takes seconds.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
PYTHON ?= python3
PIP_VERSION := 25.2
OPS := .venv
TRAIN := .venv-train
MLFLOW := .venv-mlflow
CHECKOV := .venv-checkov
# The GPU targets run on a GPU machine's own torch when the training venv is not there
# (`make bench-gpu GPU_PYTHON=python3`); they need neither Horovod nor `make setup`.
GPU_PYTHON ?= $(if $(wildcard $(TRAIN)/bin/python),$(TRAIN)/bin/python,python3)
# More flags for python -m bench.gpu: `make bench-gpu BENCH_GPU_ARGS="--only decode --budget-s 200"`
BENCH_GPU_ARGS ?=

.PHONY: help setup system test test-infra test-training test-scripts test-boot test-boot-vm test-gpu lint format demo bench bench-gpu bench-gpu-smoke clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

setup: system $(OPS)/.installed $(TRAIN)/.installed $(TRAIN)/.checkout-on-path $(MLFLOW)/.installed $(CHECKOV)/.installed node_modules/.installed  ## install everything (the venvs, Horovod, Azurite, MLflow, Checkov)
	@echo 'set up. The command line is $(OPS)/bin/dtrain: export PATH="$(CURDIR)/$(OPS)/bin:$$PATH" to run it as dtrain'

system:  ## apt packages (cloud-init, shellcheck, openssh, iproute2, npm, Slurm, munge, QEMU...) and the test VM's kernel
	@tools/setup_system.sh
	@tools/fetch_vm_kernel.sh

# The CLI is installed as `dtrain` (editable: the checkout is the code), runnable from any directory.
# Each environment waits for the system packages (compilers, npm) but not for the others: `make -j3
# setup` installs them three at a time (.ci/run does: their downloads are most of a fresh setup's time).
$(OPS)/.installed: requirements.txt requirements-cli.txt pyproject.toml | system
	test -x $(OPS)/bin/python || $(PYTHON) -m venv $(OPS)
	$(OPS)/bin/pip install -q --disable-pip-version-check pip==$(PIP_VERSION)
	$(OPS)/bin/pip install -q -r requirements.txt
	$(OPS)/bin/pip install -q --no-deps -e .
	touch $@

# Horovod compiles against the installed torch and TensorFlow, so it comes after them; the
# script reuses a wheel cached under ~/.cache when one was built for the same versions.
$(TRAIN)/.installed: requirements-train.txt tools/build_horovod.sh | system
	test -x $(TRAIN)/bin/python || $(PYTHON) -m venv $(TRAIN)
	$(TRAIN)/bin/pip install -q --disable-pip-version-check pip==$(PIP_VERSION)
	$(TRAIN)/bin/pip install -q -r requirements-train.txt
	tools/build_horovod.sh $(TRAIN)
	touch $@

# `python -m training.predict` from any directory: the checkout on the environment's path (a .pth file,
# not `pip install -e .`, which would add the operator CLI and its dependencies to this environment)
$(TRAIN)/.checkout-on-path: $(TRAIN)/.installed
	$(TRAIN)/bin/python -c 'import site, sys; open(site.getsitepackages()[0] + "/azure-horovod.pth", "w").write(sys.argv[1] + "\n")' "$(CURDIR)"
	touch $@

# The local cluster's MLflow server, in an environment of its own (requirements-mlflow.txt says why)
$(MLFLOW)/.installed: requirements-mlflow.txt | system
	test -x $(MLFLOW)/bin/python || $(PYTHON) -m venv $(MLFLOW)
	$(MLFLOW)/bin/pip install -q --disable-pip-version-check pip==$(PIP_VERSION)
	$(MLFLOW)/bin/pip install -q -r requirements-mlflow.txt
	touch $@

# Checkov's secrets scanner, which the infrastructure tests run over the custom data, in an environment
# of its own (requirements-checkov.txt says why)
$(CHECKOV)/.installed: requirements-checkov.txt | system
	test -x $(CHECKOV)/bin/python || $(PYTHON) -m venv $(CHECKOV)
	$(CHECKOV)/bin/pip install -q --disable-pip-version-check pip==$(PIP_VERSION)
	$(CHECKOV)/bin/pip install -q -r requirements-checkov.txt
	touch $@

node_modules/.installed: package.json package-lock.json | system
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

test: setup  ## run every test suite (infrastructure and operator workflow, beside training and benchmarks)
	tools/run_tests.sh $(OPS)/bin/python $(TRAIN)/bin/python

test-infra: $(OPS)/.installed $(CHECKOV)/.installed system  ## Pulumi program under mocks, cloud-init validation, the custom data's secrets scan
	$(OPS)/bin/python -m pytest tests/infra

# Part of `make test` (tools/run_tests.sh runs it beside the other suites). Root; the image and
# Slurm's packages are built once and cached (docs/infrastructure.md says what that costs).
test-boot: $(OPS)/.installed  ## the Azure custom data booted by systemd and cloud-init in system containers, Azure's endpoints emulated (root)
	tools/build_boot_image.sh container >/dev/null
	DTRAIN_BOOT_TEST=1 $(OPS)/bin/python -m pytest -s -p no:cacheprovider tests/boot/test_boot.py

# Opt-in: what containers cannot show (the NFS server role, RAID, real mounts); VMs under software
# emulation, up to half an hour on 2 cores.
test-boot-vm: $(OPS)/.installed  ## the same custom data with the NFS server in QEMU VMs (root; slow, opt-in)
	tools/build_boot_image.sh vm >/dev/null
	DTRAIN_BOOT_VM=1 $(OPS)/bin/python -m pytest -s -p no:cacheprovider tests/boot/test_boot_vm.py tests/boot/test_nvme_raid_vm.py

test-training: $(TRAIN)/.installed  ## Horovod jobs over gloo, several processes
	$(TRAIN)/bin/python -m pytest tests/training

test-scripts: setup  ## staging, launcher and local cluster against Azurite, sshd and Slurm
	$(OPS)/bin/python -m pytest tests/scripts

demo: setup  ## the whole operator workflow on a 2-node local cluster (as root; about 2 minutes)
	$(OPS)/bin/python -m dtrain demo

bench: setup  ## benchmarks beside their baselines -> bench/results/results.{json,md,png} (under 15 minutes)
	$(TRAIN)/bin/python -m bench

bench-gpu:  ## our GPU jobs beside plain PyTorch on one CUDA GPU -> bench/results/results-gpu.{json,md}; stops at --budget-s (330 s), skipping what does not fit
	$(GPU_PYTHON) -m bench.gpu $(BENCH_GPU_ARGS)

bench-gpu-smoke:  ## bench-gpu's every section at tiny sizes: under 90 s on a GPU, eager on a CPU-only machine (CI)
	$(GPU_PYTHON) -m bench.gpu --smoke $(BENCH_GPU_ARGS)

test-gpu:  ## the tests marked gpu (compiled vs eager, layouts on the GPU); skipped with the reason printed without CUDA
	$(GPU_PYTHON) -m pytest -m gpu -rs tests/training

lint: $(OPS)/.installed  ## ruff
	$(OPS)/bin/ruff check .
	$(OPS)/bin/ruff format --check .

format: $(OPS)/.installed
	$(OPS)/bin/ruff format .
	$(OPS)/bin/ruff check --fix .

clean:  ## remove the environments and caches (the Horovod wheel cache stays)
	rm -rf $(OPS) $(TRAIN) $(MLFLOW) $(CHECKOV) node_modules .pytest_cache .ruff_cache
