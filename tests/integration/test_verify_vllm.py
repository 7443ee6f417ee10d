"""verify against the real vLLM, in the separate environment `make vllm-env` builds.

Every test here is skipped, with the reason and the command that fixes it, when that
environment is absent. With it, the real default model (SmolLM2-135M-Instruct) is exported
and each export is loaded by vLLM in its own subprocess and compared with transformers.

Cost on the 2-core CI machine: `make vllm-env` ~2 min once; each verify 30-70 s (one fresh
vLLM process per checkpoint). The default run exports the data-free recipes only (fp8-dynamic
and an RTN W8A8: the same compressed-tensors INT8 format, and so the same vLLM kernels, as
w8a8-int8); the real w8a8-int8 recipe (SmoothQuant + GPTQ calibration) is marked slow.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from quantize import capabilities
from quantize.stages import verify as V

VLLM_PYTHON = capabilities.find_vllm_python()
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(VLLM_PYTHON is None, reason=(
        "no vLLM environment (.venv-vllm/ or $QUANTIZE_VLLM_PYTHON): create it with "
        "`make vllm-env` (about 2 minutes, 3.4 GB) to run the vLLM verify tests")),
]

W8A8_RTN = """name: w8a8-rtn
description: data-free INT8 W8A8 (the w8a8-int8 format without SmoothQuant/GPTQ)
method: rtn
scheme: W8A8
ignore: [lm_head]
"""


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory,
           default_model: Path) -> Callable[[str], Path]:
    """Export a recipe (a shipped name or YAML text) of the default model, once per module;
    returns the run folder."""
    from quantize.pipeline import RunOptions, run

    root = tmp_path_factory.mktemp("runs")
    done: dict[str, Path] = {}

    def make(recipe: str) -> Path:
        if recipe not in done:
            name = recipe.split("\n", 1)[0].removeprefix("name: ") if "\n" in recipe else recipe
            arg = recipe
            if "\n" in recipe:
                (root / f"{name}.yaml").write_text(recipe)
                arg = str(root / f"{name}.yaml")
            run(RunOptions(recipe=arg, out=root / name, until="export"))
            done[recipe] = root / name
        return done[recipe]

    return make


def _kernels(s: dict[str, Any]) -> str:
    return " ".join((s["vllm"]["layers"].get("linear") or {}).keys())


def test_probe_sees_this_host() -> None:
    host = capabilities.detect(VLLM_PYTHON, use_cache=False)
    assert host.problem is None and host.vllm_version
    assert host.device in ("cpu", "cuda")
    if host.device == "cpu":
        assert set(host.isa) >= {"avx512", "amx_tile"} and "cpu_gemm_wna16" in host.ops


def test_fp8_dynamic_export_loads_in_vllm_and_agrees(export: Callable[[str], Path]) -> None:
    run_dir = export("fp8-dynamic")
    s = V.verify(run_dir)
    assert (s["level"], s["verdict"]) == ("vllm", "pass"), s.get("error")
    assert s["vllm"]["quantization"] == "compressed-tensors"
    assert "CompressedTensorsW8A8Fp8" in _kernels(s)
    assert s["metrics"]["agreement"] >= V.Thresholds().min_agreement
    assert "vllm serve " in s["serve_command"] and "--max-model-len 512" in s["serve_command"]
    assert (run_dir / "verify" / "verify.json").is_file()


def test_int8_w8a8_export_loads_in_vllm_and_agrees(export: Callable[[str], Path]) -> None:
    s = V.verify(export(W8A8_RTN))
    assert (s["level"], s["verdict"]) == ("vllm", "pass"), s.get("error")
    assert "CompressedTensorsW8A8Int8" in _kernels(s)


@pytest.mark.slow
def test_w8a8_int8_recipe_export_loads_in_vllm_and_agrees(
        export: Callable[[str], Path]) -> None:
    s = V.verify(export("w8a8-int8"))
    assert (s["level"], s["verdict"]) == ("vllm", "pass"), s.get("error")
    assert "CompressedTensorsW8A8Int8" in _kernels(s)


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
    s = V.verify(bad, out=tmp_path / "v", timeout_s=600)
    assert s["verdict"] == "fail"
    assert s["error"] == ("vLLM could not load the checkpoint: RuntimeError: start (0) + "
                          "length (1536) exceeds dimension size (1000).")
    assert (tmp_path / "v" / s["vllm_log"]).is_file()
