"""The native-format engines (backend: gptqmodel / autoawq) without running them: what recipes
may ask of each, the errors when an extra is missing, the model types AutoAWQ refuses, how
verify reads native checkpoints, and our decode of the GPTQ and AWQ GEMM layouts against
packers written here from the engines' packing code."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from quantize.backends import check_model
from quantize.errors import BackendUnavailable, NotImplementedFeature, RecipeError
from quantize.model.config import ModelConfig
from quantize.recipe.engines import ENGINE_SCHEMES
from quantize.recipe.recipe import load_recipe
from quantize.vllm import host as H
from quantize.vllm import support as caps

BASE = """\
name: x
description: test recipe
backend: {backend}
method: {method}
scheme: {scheme}
"""


def recipe(recipe_file: Any, extra: str = "", **fields: str) -> Any:
    values = {"backend": "gptqmodel", "method": "gptq", "scheme": "W4A16", **fields}
    return load_recipe(str(recipe_file(BASE.format(**values) + extra)))


LLMC = "or set backend: llmcompressor"
GPTQ_SYM = "backend gptqmodel: vLLM loads native GPTQ only symmetric with 4 or 8 bits"
AWQ_ZP = "vLLM's AWQ Marlin kernel needs 4-bit weights with zero points"


@pytest.mark.parametrize(("fields", "extra", "problem", "hint"), [
    ({"method": "rtn"}, "", "backend gptqmodel runs method gptq/awq only, not rtn",
     f"change the method {LLMC}"),
    ({"backend": "autoawq"}, "", "backend autoawq runs method awq only, not gptq",
     f"change the method {LLMC}"),
    ({"scheme": "W4A16_ASYM"}, "", GPTQ_SYM, f"use scheme W4A16 or W8A16 for method gptq {LLMC}"),
    ({"method": "awq"}, "", f"backend gptqmodel: {AWQ_ZP}",
     f"use scheme W4A16_ASYM for method awq {LLMC}"),
    ({"backend": "autoawq", "method": "awq"}, "", f"backend autoawq: {AWQ_ZP}",
     f"use scheme W4A16_ASYM for method awq {LLMC}"),
    ({"scheme": "W8A8"}, "", GPTQ_SYM, f"use scheme W4A16 or W8A16 for method gptq {LLMC}"),
    ({"scheme": "W3A16"}, "", GPTQ_SYM, f"use scheme W4A16 or W8A16 for method gptq {LLMC}"),
    ({"method": "rtn", "scheme": "FP8_DYNAMIC"}, "",
     "backend gptqmodel runs method gptq/awq only, not rtn", f"change the method {LLMC}"),
    ({}, "overrides:\n  - targets: ['re:.*down_proj']\n    scheme: W8A16\n",
     "`overrides` is supported on backend llmcompressor only", f"remove it {LLMC}"),
    ({"scheme": "W4A16"}, "kv_cache: fp8\n",
     "`kv_cache` is supported on backend llmcompressor only", f"remove it {LLMC}"),
    ({}, "ignore: [lm_head, 're:.*down_proj']\n",
     "backend gptqmodel quantizes every Linear of the decoder layers and never lm_head",
     f"use targets: [Linear] and ignore: [lm_head] {LLMC}"),
    ({}, "gptq:\n  block_size: 64\n", "gptqmodel's GPTQ block size is fixed at 128",
     f"remove gptq.block_size {LLMC}"),
    ({"method": "awq", "scheme": "W4A16_ASYM"}, "awq:\n  n_grid: 10\n",
     "gptqmodel's AWQ scale search uses a fixed grid of 20", f"remove awq.n_grid {LLMC}"),
    ({"method": "awq", "scheme": "W4A16_ASYM"}, "awq:\n  duo_scaling: false\n",
     "gptqmodel's AWQ always uses duo scaling", f"set awq.duo_scaling: true {LLMC}"),
    ({"backend": "autoawq", "method": "awq", "scheme": "W4A16_ASYM"},
     "awq:\n  duo_scaling: both\n", "autoawq cannot search both scalings",
     f"set awq.duo_scaling to true or false {LLMC}"),
])
def test_recipes_ask_only_what_the_engine_does(recipe_file: Any, tmp_path: Path,
                                               fields: dict[str, str], extra: str,
                                               problem: str, hint: str) -> None:
    """The engine's rule is a recipe-level check: pydantic reports it on the whole document
    (line 1), after its own "Value error, " prefix."""
    with pytest.raises(RecipeError) as info:
        recipe(recipe_file, extra, **fields)
    err = info.value
    assert (err.path, err.line) == (str(tmp_path / "x.yaml"), 1)
    assert err.problem is not None and err.problem.endswith(f", {problem}")
    assert err.hint == hint


def test_unknown_backend_names_the_known_ones(recipe_file: Any) -> None:
    with pytest.raises(RecipeError) as info:
        recipe(recipe_file, backend="vllm")
    assert (info.value.line, info.value.problem) == (
        3, "backend: Input should be 'llmcompressor', 'gptqmodel' or 'autoawq'")


@pytest.mark.parametrize(("backend", "method", "scheme"), [
    (b, m, s) for b, methods in ENGINE_SCHEMES.items() for m, schemes in methods.items()
    for s in schemes])
def test_every_supported_combination_validates(recipe_file: Any, backend: str, method: str,
                                               scheme: str) -> None:
    r = recipe(recipe_file, backend=backend, method=method, scheme=scheme)
    assert (r.backend, r.method, r.scheme) == (backend, method, scheme)


def test_shipped_engine_recipes_match_their_llmcompressor_twins() -> None:
    """Same scheme, group, calibration, suite, ignore: the engines compare on equal terms."""
    for name, twin in (("gptq-int4-gptqmodel", "gptq-int4"), ("awq-int4-gptqmodel", "awq-int4"),
                       ("awq-int4-autoawq", "awq-int4")):
        r, t = load_recipe(name), load_recipe(twin)
        assert r.backend != "llmcompressor" and t.backend == "llmcompressor"
        keys = ("method", "scheme", "group_size", "calibration", "eval", "ignore", "targets")
        assert {k: getattr(r, k) for k in keys} == {k: getattr(t, k) for k in keys}


# --- a missing extra ------------------------------------------------------------------------
@pytest.mark.parametrize(("backend", "missing"), [
    ("gptqmodel", "gptqmodel"), ("gptqmodel", "optimum"), ("autoawq", "awq")])
def test_missing_extra_names_the_install_command(monkeypatch: pytest.MonkeyPatch,
                                                 backend: str, missing: str) -> None:
    from quantize.backends import get_backend

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == missing else real(name, *a))
    monkeypatch.delitem(sys.modules, f"quantize.backends.{backend}", raising=False)
    with pytest.raises(BackendUnavailable) as info:
        get_backend(backend)
    assert info.value.problem == f"backend {backend!r} is not installed ({missing})"
    assert info.value.hint == f"install it with `pip install -e .[{backend}]`"


def test_missing_extra_fails_preflight_before_calibration(
        monkeypatch: pytest.MonkeyPatch) -> None:

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gptqmodel" else real(name, *a))
    monkeypatch.delitem(sys.modules, "quantize.backends.gptqmodel", raising=False)
    with pytest.raises(BackendUnavailable) as info:
        check_model(load_recipe("gptq-int4-gptqmodel"), {"model_type": "llama"})
    assert info.value.hint is not None and "pip install -e .[gptqmodel]" in info.value.hint


def test_loading_a_native_checkpoint_without_the_extra_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from quantize.backends._native import require_loader

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "optimum" else real(name, *a))
    with pytest.raises(BackendUnavailable) as info:
        require_loader("gptq")
    assert info.value.problem == "loading a native gptq checkpoint in transformers needs optimum"
    assert info.value.hint == "install with `pip install -e .[gptqmodel]`"


@pytest.mark.skipif(importlib.util.find_spec("awq") is None,
                    reason="the autoawq extra is not installed (pip install -e .[autoawq])")
def test_autoawq_refuses_by_default_because_its_output_is_broken_here(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from quantize.backends.autoawq import UNVERIFIED_ENV, VERIFIED_MODEL_TYPES, check_model

    monkeypatch.delenv(UNVERIFIED_ENV, raising=False)
    with pytest.raises(NotImplementedFeature) as info:
        check_model(ModelConfig(model_type="llama"))
    problem = info.value.problem or ""
    assert re.fullmatch(r"backend autoawq does not work with transformers 5\.[\d.]+: .* broken "
                        r"checkpoint of the default model here \(perplexity 17\.9 -> 194,000, "
                        r"garbage in vLLM too\)", problem)
    assert info.value.hint is not None
    assert info.value.hint.startswith("use awq-int4-gptqmodel or awq-int4")
    assert UNVERIFIED_ENV in info.value.hint
    monkeypatch.setenv(UNVERIFIED_ENV, "1")  # to reproduce: model types it at least runs with
    check_model(ModelConfig(model_type="llama"))
    with pytest.raises(NotImplementedFeature) as info:
        check_model(ModelConfig(model_type="gpt2"))
    assert re.fullmatch(r"backend autoawq \(archived upstream, tested by its authors only up to "
                        r"transformers 4\.51\) runs here with transformers 5\.[\d.]+ for "
                        r"model_type llama, .* only, not 'gpt2'", info.value.problem or "")
    assert info.value.hint == "use backend: gptqmodel or llmcompressor"
    assert "llama" in VERIFIED_MODEL_TYPES


@pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is None,
                    reason="the gptqmodel extra is not installed")
@pytest.mark.parametrize("model_type", ["deepseek_v3", "gpt_oss"])
def test_gptqmodel_awq_is_refused_before_calibration_where_it_fails(model_type: str) -> None:
    """GPTQModel 7.6.0's AWQ failed on these MoE architectures after calibrating
    (bench/moe_matrix.py); pre-flight says so first. Its GPTQ on them, and its AWQ on
    Qwen3-MoE and Mixtral, are not refused."""

    awq, gptq = load_recipe("awq-int4-gptqmodel"), load_recipe("gptq-int4-gptqmodel")
    with pytest.raises(NotImplementedFeature) as info:
        check_model(awq, ModelConfig(model_type=model_type))
    assert (info.value.problem or "").startswith(
        f"backend gptqmodel 7.6.0 cannot run AWQ on model_type '{model_type}': ")
    assert info.value.hint is not None
    assert info.value.hint.startswith("use backend: llmcompressor (recipe awq-int4)")
    check_model(gptq, ModelConfig(model_type=model_type))
    for ok in ("qwen3_moe", "mixtral", "llama"):
        check_model(awq, ModelConfig(model_type=ok))


def test_autoawq_refuses_unpacked_calibration_samples() -> None:
    from quantize.backends._native import require_packed_samples

    require_packed_samples([[1, 2, 3], [4, 5, 6]], "autoawq")
    with pytest.raises(NotImplementedFeature) as info:
        require_packed_samples([[1, 2, 3], [4, 5]], "autoawq")
    assert (info.value.problem or "").startswith("backend autoawq concatenates calibration")
    assert info.value.hint == "use a calibration spec with packing: true"


# --- verify: native formats -----------------------------------------------------------------
GPTQ_QC = {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True, "desc_act": False,
           "checkpoint_format": "gptq", "format": "gptq"}
AWQ_QC = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
          "version": "gemm", "format": "gemm"}
AVX512 = H.Host("/x/python", "0.32.0", "cpu", {"avx512": True}, {"cpu_gemm_wna16": True})
AVX2 = H.Host("/x/python", "0.32.0", "cpu", {"avx2": True}, {})


@pytest.mark.parametrize(("qc", "label"), [
    (GPTQ_QC, "native GPTQ INT4 weight-only (group 64)"),
    (AWQ_QC, "native AWQ INT4 asymmetric weight-only (group 64)"),
    ({**GPTQ_QC, "bits": 8, "group_size": -1}, "native GPTQ INT8 weight-only (channel)"),
    # AutoAWQ's keys
    ({"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "zero_point": True,
      "version": "gemm"}, "native AWQ INT4 asymmetric weight-only (group 128)"),
])
def test_native_checkpoint_formats(qc: dict[str, Any], label: str) -> None:
    assert caps.checkpoint_format(ModelConfig(quantization_config=qc)).label == label


@pytest.mark.parametrize(("host", "qc", "reason"), [
    (AVX512, {**GPTQ_QC, "sym": False}, r"vLLM loads native GPTQ only symmetric with 4 or 8"),
    (AVX512, {**GPTQ_QC, "bits": 3}, r"vLLM loads native GPTQ only symmetric with 4 or 8"),
    (AVX512, {**AWQ_QC, "bits": 8}, r"vLLM loads native AWQ only with 4 bits"),
    (AVX512, {**GPTQ_QC, "bits": 8}, r"CPU kernel takes 4-bit integer weights only"),
    (AVX2, GPTQ_QC, r"needs AVX-512 or a GPU \(the CPU build lacks cpu_gemm_wna16\)"),
])
def test_native_formats_vllm_refuses(host: H.Host, qc: dict[str, Any], reason: str) -> None:
    fmt = caps.checkpoint_format(ModelConfig(quantization_config=qc))
    support = caps.supported(fmt, host)
    assert not support.ok
    assert re.search(reason, support.reason), support.reason


@pytest.mark.parametrize("qc", [GPTQ_QC, AWQ_QC])
def test_native_4bit_runs_on_an_avx512_cpu(qc: dict[str, Any]) -> None:
    assert caps.supported(caps.checkpoint_format(ModelConfig(quantization_config=qc)), AVX512).ok


# Packers written from the engines' own packing code (not from our decoder), for a known
# integer matrix: GPTQ packs 32/bits input rows per int32 word in standard bit order and v1
# stores zero points minus one (gptqmodel/nn_modules/qlinear PackableQuantLinear.pack);
# AWQ GEMM packs 8 output columns per word in the order 0,2,4,6,1,3,5,7
# (awq/modules/linear/gemm.py WQLinear_GEMM.from_linear).
def _pack_gptq(q: Any, zeros: Any) -> tuple[Any, Any]:
    import numpy as np

    q, zeros = q.numpy().astype(np.int64), zeros.numpy().astype(np.int64)  # [in,out], [g,out]
    qweight = np.zeros((q.shape[0] // 8, q.shape[1]), dtype=np.int64)
    for row in range(qweight.shape[0]):
        for j in range(8):
            qweight[row] |= q[row * 8 + j] << (4 * j)
    z = zeros - 1
    qzeros = np.zeros((z.shape[0], z.shape[1] // 8), dtype=np.int64)
    for col in range(qzeros.shape[1]):
        for j in range(8):
            qzeros[:, col] |= (z[:, col * 8 + j] & 0xF) << (4 * j)
    return _i32(qweight), _i32(qzeros)


def _pack_awq(q: Any, zeros: Any, order_map: tuple[int, ...] = (0, 2, 4, 6, 1, 3, 5, 7)
              ) -> tuple[Any, Any]:
    import numpy as np


    def pack(x: Any) -> Any:
        out = np.zeros((x.shape[0], x.shape[1] // 8), dtype=np.int64)
        for col in range(out.shape[1]):
            for i in range(8):
                out[:, col] |= x[:, col * 8 + order_map[i]] << (i * 4)
        return out

    return _i32(pack(q.numpy().astype(np.int64))), _i32(pack(zeros.numpy().astype(np.int64)))


def _i32(a: Any) -> Any:
    import numpy as np
    import torch

    return torch.from_numpy((a & 0xFFFFFFFF).astype(np.uint32).view(np.int32))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_native_decode_reads_the_engines_layouts(method: str) -> None:
    import torch

    from quantize.model import decode as D
    from quantize.model.qconfig import parse

    torch.manual_seed(0)
    in_f, out_f, gs = 128, 64, 32
    q = torch.randint(0, 16, (in_f, out_f))
    zeros = torch.randint(1, 16, (in_f // gs, out_f)) if method == "awq" else \
        torch.full((in_f // gs, out_f), 8)
    scales = torch.rand(in_f // gs, out_f, dtype=torch.float16) + 0.01
    expected = ((q - zeros.repeat_interleave(gs, 0)) * scales.float().repeat_interleave(gs, 0)).T
    qc = GPTQ_QC if method == "gptq" else AWQ_QC
    qweight, qzeros = (_pack_gptq if method == "gptq" else _pack_awq)(q, zeros)
    got = D.decode_native({"qweight": qweight, "qzeros": qzeros, "scales": scales},
                          D.native_args(parse({**qc, "group_size": gs})))
    assert got.shape == (out_f, in_f)
    assert torch.equal(got, expected.float())
    # a misread layout is caught: the AWQ order read as GPTQ's standard order, or v1 zero
    # points read without their offset
    if method == "awq":
        wrong = _pack_awq(q, zeros, order_map=tuple(range(8)))[0]  # standard bit order
        bad = D.decode_native({"qweight": wrong, "qzeros": qzeros, "scales": scales},
                              D.native_args(parse({**qc, "group_size": gs})))
    else:
        bad = D.decode_native({"qweight": qweight, "qzeros": qzeros, "scales": scales},
                              D.native_args(parse({**qc, "group_size": gs,
                                                   "checkpoint_format": "gptq_v2"})))
    assert not torch.allclose(bad, expected.float())


def test_native_formats_verify_does_not_decode_are_refused() -> None:
    from quantize.errors import VerifyError
    from quantize.model import decode as D
    from quantize.model.qconfig import parse

    with pytest.raises(VerifyError) as err:
        D.native_args(parse({**GPTQ_QC, "checkpoint_format": "gptq_p"}))
    assert err.value.problem == "native GPTQ checkpoint_format 'gptq_p' has no reference decode"
    assert err.value.hint == "verify handles gptq and gptq_v2"
    with pytest.raises(VerifyError) as err:
        D.native_args(parse({**AWQ_QC, "version": "gemv", "format": "gemv"}))
    assert err.value.problem == "native AWQ 'gemv' 4-bit has no reference decode"
    assert err.value.hint == "verify handles 4-bit GEMM"


def test_effective_weight_of_a_kernel_module_is_its_action_on_the_identity() -> None:
    import torch

    from quantize.model import decode as D

    class Kernel(torch.nn.Module):  # a quantized-kernel stand-in: no float `weight`
        in_features = 16

        def __init__(self, w: torch.Tensor, b: torch.Tensor) -> None:
            super().__init__()
            self.w, self.bias = w, b

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w.T + self.bias

    w, b = torch.randn(8, 16), torch.randn(8)
    assert torch.allclose(D.effective_weight(Kernel(w, b)), w, atol=1e-6)
    lin = torch.nn.Linear(16, 8)
    assert torch.equal(D.effective_weight(lin), lin.weight.detach())


def test_source_dtype_is_sixteen_bit(tmp_path: Path) -> None:
    import json

    import torch

    from quantize.backends._native import source_dtype

    for name, want in (("float16", torch.float16), ("bfloat16", torch.bfloat16),
                       ("float32", torch.bfloat16)):
        (tmp_path / "config.json").write_text(json.dumps({"dtype": name}))
        assert source_dtype(tmp_path) == want


def test_native_engines_refuse_what_they_do_not_do_here() -> None:
    from quantize.backends import QuantizeJob
    from quantize.backends._native import check_job

    r = load_recipe("gptq-int4-gptqmodel")
    check_job(QuantizeJob(Path("m"), r, 64, [[1, 2]], "cpu"), "gptqmodel")
    with pytest.raises(NotImplementedFeature) as info:
        check_job(QuantizeJob(Path("m"), r, 64, [[1, 2]], "cuda", world_size=2), "gptqmodel")
    assert info.value.problem == "backend gptqmodel runs in one process here"
    assert info.value.hint is not None and info.value.hint.startswith("drop --gpus 2")
    with pytest.raises(NotImplementedFeature) as info:
        check_job(QuantizeJob(Path("m"), r, 64, [[1, 2]], "cpu", host_tier="disk"), "autoawq")
    assert (info.value.problem or "").startswith(
        "the model does not fit in host RAM and backend autoawq keeps it there")
    assert info.value.hint is not None and "backend: llmcompressor" in info.value.hint


def test_gptqmodel_kernels_are_kept_on_their_fp32_dequantize_path() -> None:
    import torch

    from quantize.stages import verify as V

    class Kernel(torch.nn.Module):  # GPTQModel's CPU kernels before their first forward
        def __init__(self) -> None:
            super().__init__()
            self.linear_mode = None
            self.register_buffer("scales", torch.ones(2, 4, dtype=torch.float16))

    model = torch.nn.Sequential(Kernel(), torch.nn.Linear(2, 2), Kernel())
    assert V.unfuse_native_kernels(model) == 2
    assert model[0].linear_mode == "train" and model[0].scales.dtype == torch.float32
    assert V.unfuse_native_kernels(model) == 0  # already switched: nothing to do


@pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is None, reason="gptqmodel not installed")
@pytest.mark.e2e  # a fresh interpreter importing GPTQModel (~7 CPU s)
def test_importing_the_gptqmodel_backend_leaves_the_hub_cache_where_the_user_keeps_it() -> None:
    """tokenicer (a GPTQModel dependency) sets HF_HOME=/tmp/tokenicer_hf_home at import; a
    publish or download later in the same process (or a child) would use it."""
    code = ("import os\nimport quantize.backends.gptqmodel\nimport gptqmodel, tokenicer\n"
            "print([k for k in ('HF_HOME', 'HF_HUB_CACHE', 'TRANSFORMERS_CACHE', "
            "'HF_MODULES_CACHE') if k in os.environ])")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_an_engine_failure_is_one_line_naming_its_log(tmp_path: Path) -> None:
    from quantize.backends._native import engine_run
    from quantize.errors import QuantizationError

    log = tmp_path / "logs" / "gptqmodel.log"
    with pytest.raises(QuantizationError) as err, engine_run("gptqmodel", log):
        os.write(1, b"engine chatter\n")  # as C++ and tqdm write: to the descriptor
        raise ValueError("bad shape\n  at layer 3")
    assert err.value.problem == f"gptqmodel failed: bad shape (full log: {log})"
    assert "\n" not in str(err.value)
    assert "engine chatter" in log.read_text()
    # not an engine failure: passes through unchanged
    with pytest.raises(MemoryError), engine_run("autoawq", log):
        raise MemoryError


def test_autoround_without_its_package_is_refused_before_calibration(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from quantize.backends import check_model

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "auto_round" else real(name, *a))
    from quantize.recipe.recipe import Recipe

    r = Recipe(name="ar", description="d", method="autoround", scheme="W4A16",
               group_size=64)
    with pytest.raises(BackendUnavailable) as exc:
        check_model(r, {})
    assert exc.value.problem == ("method autoround needs the package 'auto-round==0.15.1', "
                                 "which is not installed")
    assert exc.value.hint is not None and "`pip install auto-round==0.15.1`" in exc.value.hint
    assert exc.value.exit_code == 2 and "\n" not in str(exc.value)
    gptq = Recipe(name="g", description="d", method="gptq", scheme="W4A16", group_size=64)
    check_model(gptq, {})  # other methods do not need it
