"""verify against the real vLLM, in the separate environment `make vllm-env` builds.

`make test` (and so CI) builds that environment first when it is missing, so these tests run
there. Run directly without it (plain `pytest`), every test here is skipped with the reason
and the command that fixes it.

What they prove: the `w8a8-int8` (SmoothQuant + GPTQ) and `fp8-dynamic` exports of the real
default model (SmolLM2-135M-Instruct) load in vLLM, each in its own fresh subprocess, and
agree with transformers; a broken export fails with vLLM's own error line.

Cost: the exports are the session's (fixtures/default_runs.py: started in the background
when the session starts; fp8-dynamic is shared with test_eval_vllm). w8a8-int8 calibrates on
8 x 256 tokens of the shipped text instead of the recipe's 32 x 512 (the check is vLLM vs
transformers on the same weights, so calibration quality does not matter to it); one vLLM
process per checkpoint, 30-70 s each on the 2-core CI machine. Measured added time in
docs/verify.md.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixtures.vllm import NEEDS_VLLM, VLLM_PYTHON

from quantize.stages import verify as V
from quantize.vllm import host as vllm_host
from quantize.vllm.support import fp8_gemm_emulated

pytestmark = NEEDS_VLLM

DEFAULT_RUNS = {"fp8-dynamic": "export", "w8a8-int8": "export"}  # fixtures/default_runs.py


@pytest.fixture
def export(default_model: Path, default_runs: Any) -> Callable[[str], Path]:
    """A shipped recipe exported from the default model, once per session; the run folder."""
    return default_runs  # type: ignore[no-any-return]


def _kernels(s: Any) -> str:
    return " ".join((s.vllm.layers.get("linear") or {}).keys())


def _assert_full_pass(s: Any, scheme_class: str) -> None:
    assert (s.level, s.verdict) == ("vllm", "pass"), s.error or s.why_not_vllm
    assert s.vllm.quantization == "compressed-tensors"
    # every quantized Linear bound to the scheme: 30 layers x 4 (vLLM fuses q/k/v and gate/up)
    layers = s.vllm.layers["linear"]
    assert sum(e.count for k, e in layers.items() if scheme_class in k) == 30 * 4, layers
    m = s.metrics
    assert m.agreement >= V.Thresholds().min_agreement
    assert m.mean_abs_dlogprob <= V.Thresholds().max_mean_abs_dlogprob
    assert m.steps == len(V.PROMPTS) * V.MAX_TOKENS
    assert "vllm serve " in s.serve_command and "--max-model-len 512" in s.serve_command


def test_probe_sees_this_host() -> None:
    host = vllm_host.detect(VLLM_PYTHON)
    assert host.problem is None and host.vllm_version
    assert host.device in ("cpu", "cuda")
    if host.device == "cpu":
        assert set(host.isa) >= {"avx512", "amx_tile"} and "cpu_gemm_wna16" in host.ops


def test_fp8_dynamic_export_loads_in_vllm_and_agrees(export: Callable[[str], Path]) -> None:
    """On a CPU whose torch runs FP8 GEMMs emulated (vLLM's CPU FP8 kernel would take hours),
    verify says so and decides by the exact decode check instead, and passes."""
    run_dir = export("fp8-dynamic")
    s = V.verify(run_dir)
    slow = fp8_gemm_emulated(vllm_host.detect(VLLM_PYTHON))
    if slow is None:
        _assert_full_pass(s, "CompressedTensorsW8A8Fp8")
    else:
        assert (s.level, s.verdict) == ("decode", "pass"), s
        assert slow in s.why_not_vllm
    assert (run_dir / "verify" / "verify.json").is_file()


def test_w8a8_int8_export_loads_in_vllm_and_agrees(export: Callable[[str], Path]) -> None:
    """The shipped recipe itself: SmoothQuant + GPTQ, INT8 weights and dynamic INT8
    activations, on vLLM's INT8 kernel (oneDNN on CPU)."""
    run_dir = export("w8a8-int8")
    cfg = (run_dir / "export" / "recipe.yaml").read_text()
    assert "smoothquant" in cfg and "method: gptq" in cfg
    s = V.verify(run_dir)
    _assert_full_pass(s, "CompressedTensorsW8A8Int8")


def test_a_broken_export_fails_with_vllms_own_error(export: Callable[[str], Path],
                                                    tmp_path: Path) -> None:
    """One weight cut to the wrong shape: vLLM refuses the load, and the verdict quotes its
    own error line. (A *missing* tensor is not refused: vLLM 0.32 checks for unloaded
    weights only in unquantized models - which is why verify compares outputs too.)"""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(export("fp8-dynamic") / "export", bad)
    (f,) = bad.glob("*.safetensors")
    tensors = load_file(str(f))
    key = "model.layers.3.mlp.down_proj.weight"
    tensors[key] = tensors[key][:, :1000].contiguous()
    save_file(tensors, str(f), metadata={"format": "pt"})
    # level vllm: the load is tried even where FP8 GEMMs run emulated (it fails before any)
    s = V.verify(bad, out=tmp_path / "v", timeout_s=600, level="vllm")
    assert s.verdict == "fail"
    assert s.error == ("vLLM could not load the checkpoint: RuntimeError: start (0) + "
                          "length (1536) exceeds dimension size (1000).")
    assert (tmp_path / "v" / s.vllm_log).is_file()
