"""verify against the real vLLM on a mixture-of-experts export, where this host has a kernel
for its experts: a tiny random Qwen3-MoE (fused experts in transformers 5), quantized by the
pipeline with `rtn-int4` (symmetric INT4 weights, group 64, data-free: the check is vLLM
against transformers on the same weights, so calibration does not matter to it).

vLLM 0.32's CPU build runs symmetric INT4 experts with `CPUExpertsInt4`, which needs AMX
(docs/moe.md); on a host without it the same export takes the exact-decode fallback, which
tests/unit/stages/test_verify_moe.py covers. Cost: one vLLM process, about a minute on the
2-core CI machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.moe import build_moe
from fixtures.vllm import NEEDS_VLLM, VLLM_PYTHON

from quantize.model.config import read_config
from quantize.pipeline import RunOptions, run
from quantize.stages import verify as V
from quantize.vllm import host as vllm_host
from quantize.vllm.moe_support import moe_problem
from quantize.vllm.support import checkpoint_format

pytestmark = NEEDS_VLLM


def test_symmetric_int4_moe_export_loads_in_vllm_and_agrees(tmp_path: Path,
                                                            default_tokenizer: Path) -> None:
    model = build_moe("qwen3_moe", tmp_path / "dense", default_tokenizer)
    run(RunOptions(recipe="rtn-int4", model=str(model), out=tmp_path / "run", until="export",
                   device="cpu"))
    host = vllm_host.detect(VLLM_PYTHON)
    cfg = read_config(tmp_path / "run" / "export")
    limit = moe_problem(checkpoint_format(cfg), cfg, host)
    if limit is not None:
        pytest.skip(f"this host's vLLM has no kernel for these experts: {limit}")
    s = V.verify(tmp_path / "run")
    assert (s.level, s.verdict) == ("vllm", "pass"), s.error or s.get(
        "why_not_vllm")
    layers = s.vllm.layers["linear"]
    # both MoE layers on vLLM's INT4 fused-MoE method; the routers dense (measured: 2 and 2)
    assert layers["CompressedTensorsWNA16MoEMethod"].count == 2, layers
    assert layers["UnquantizedLinearMethod"].example.endswith("mlp.gate"), layers
    m = s.metrics
    assert m.agreement >= V.Thresholds().min_agreement
    assert m.mean_abs_dlogprob <= V.Thresholds().max_mean_abs_dlogprob
    assert m.steps == len(V.PROMPTS) * V.MAX_TOKENS
