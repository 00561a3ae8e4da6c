# fsdp-sim: `make run` and `make test` work from a fresh clone with only Python 3.11.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
# The CPU wheel of torch 2.13.0 lies on this machine's disk; pyproject.toml accepts a range.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
SCENARIO ?= scenarios/llama2-7b-8xh100-zero3.toml

.PHONY: install run test lint bench validate validate-published validate-gpu device-wheels validate-gpu-device clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

install: $(BIN)/.installed

run: install
	$(BIN)/fsdpsim run $(SCENARIO) --timeline out/step.html --trace out/step.json

lint: install
	$(BIN)/ruff check sim calibrate validation hfmodel tests bench
	$(BIN)/ruff format --check sim calibrate validation hfmodel tests bench
	$(BIN)/mypy

# two workers, one test file each (a file's module fixtures, e.g. its calibrated profile, run once),
# in collection order: the longest files first (tests/conftest.py, LONGEST_FIRST)
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

bench: install
	$(BIN)/python -m bench

# SYSTEMS=fsdp1,deepspeed: only those rows, written between markers in VALIDATION.md; ROUNDS=1: one round
validate: install
	$(BIN)/fsdpsim validate --matrix --out VALIDATION.md $(if $(SYSTEMS),--systems $(SYSTEMS)) $(if $(ROUNDS),--rounds $(ROUNDS))

validate-published: install
	$(BIN)/fsdpsim validate --published --out VALIDATION.md

# on a machine with NVIDIA GPUs only (never in CI): about ten minutes
validate-gpu: install
	timeout 600 $(BIN)/python -m validation.gpu --out VALIDATION.md

# The lent GPU machine (the `device` tool): no network, no venv; its python3 holds torch with CUDA,
# transformers and peft but not simpy. Here, first: `make device-wheels` (simpy's wheel into .whl/,
# git-ignored, which the call carries). There: `make validate-gpu-device`, or without make
# `bash validation/validate_gpu_device.sh` (VALIDATION.md and the LoRA row's trace into $$OUT).
SIMPY_WHEEL ?= simpy==4.1.2
device-wheels: install
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl "$(SIMPY_WHEEL)"

validate-gpu-device:
	bash validation/validate_gpu_device.sh

clean:
	rm -rf $(VENV) out .pytest_cache .mypy_cache .ruff_cache *.egg-info
