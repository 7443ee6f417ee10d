"""The real-client question check through vLLM's own engine (issue #15): the 16-bit default
model answers eval/questions/factual.yaml with its chat template, greedy, as `vllm serve` would.
Needs the vLLM environment (`make vllm-env`; `make test` builds it), else skipped."""

from __future__ import annotations

from pathlib import Path

from fixtures.vllm import NEEDS_VLLM, VLLM_PYTHON

from quantize.report.answers import ask, load_questions
from quantize.vllm import host as vllm_host

pytestmark = NEEDS_VLLM


def test_the_16_bit_default_model_answers_through_vllm(default_model: Path,
                                                        tmp_path: Path) -> None:
    """Measured: 16 of 30 right (SmolLM2-135M from a Q4_1 GGUF is a small, weak model; eval/
    README.md has every export's count). A model vLLM decodes wrongly (bad scales, a wrong
    chat template, a prompt cut short) answers a few at most. Which questions a model this
    small gets right moves with the CPU's bf16 kernels and vLLM's environment: on an AMX host
    (2026-12-03, transformers 5.19 in vLLM's environment) the count was 16 again while "What
    is the capital of France?" turned into a French non-answer, so no single answer is
    asserted."""
    sheet = ask(default_model, tmp_path, vllm_host.detect(VLLM_PYTHON),
                load_questions())
    assert sheet.total == 30
    assert sheet.right >= 10, [(a.question, a.text) for a in sheet.answers]
    # every question got an answer of its own (a decode gone wrong repeats one or is empty)
    assert len({a.text for a in sheet.answers if a.text.strip()}) == sheet.total
