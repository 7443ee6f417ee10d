"""quantize.backends._gpu_fast: the GPU Hessian path computes llm-compressor's Hessian.

The GEMM with an fp32 result exists only on a GPU; here it is stood in for by an fp32 matmul
of the same 16-bit values (what the GPU kernel computes), and the patched function is
checked against llm-compressor's own `accumulate_hessian` on the CPU.
"""

from __future__ import annotations

import torch
from llmcompressor.modifiers.gptq.helpers import accumulate_hessian

from quantize.backends._gpu_fast import fast_hessian, make_accumulate
from quantize.backends.llmcompressor import calibration_columns


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.float() @ b.float()


def _run(fn, inputs, modules):  # type: ignore[no-untyped-def]
    hs = {id(m): torch.zeros(m.in_features, m.in_features) for m in modules}
    ns = {id(m): torch.zeros(()) for m in modules}
    for x in inputs:
        for m in modules:  # q, k, v: the same input tensor object, as in a decoder layer
            hs[id(m)], ns[id(m)] = fn(x, m, hs[id(m)], ns[id(m)])
    return hs, ns


def test_same_hessian_as_llmcompressor_and_one_product_per_shared_input() -> None:
    torch.manual_seed(0)
    mods = [torch.nn.Linear(32, 8), torch.nn.Linear(32, 4), torch.nn.Linear(32, 4)]
    inputs = [torch.randn(2, 16, 32).to(torch.bfloat16) for _ in range(3)]
    calls = []

    def counting_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls.append(a.shape)
        return _mm(a, b)

    fast = make_accumulate(accumulate_hessian, counting_mm, on_device="cpu")
    got_h, got_n = _run(fast, inputs, mods)
    ref_h, ref_n = _run(accumulate_hessian, inputs, mods)
    assert len(calls) == len(inputs)  # one product per input, not one per module
    for m in mods:
        assert torch.equal(got_n[id(m)], ref_n[id(m)])
        ref = ref_h[id(m)]
        assert torch.linalg.norm(got_h[id(m)] - ref) / torch.linalg.norm(ref) < 1e-6


def test_a_new_tensor_is_never_taken_for_the_cached_one() -> None:
    m = torch.nn.Linear(16, 4)
    fast = make_accumulate(accumulate_hessian, _mm, on_device="cpu")
    x = torch.randn(1, 8, 16).to(torch.bfloat16)
    h, _ = fast(x, m, torch.zeros(16, 16), torch.zeros(()))
    x.mul_(2)  # changed in place: its version moves, so the product is recomputed
    h2, _ = fast(x, m, torch.zeros(16, 16), torch.zeros(()))
    assert torch.allclose(h2, 4 * h)


def test_fp32_inputs_and_other_devices_use_the_engine_function() -> None:
    seen = []

    def orig(inp, module, hessian, num_samples):  # type: ignore[no-untyped-def]
        seen.append(inp.dtype)
        return hessian, num_samples

    fast = make_accumulate(orig, _mm, on_device="cpu")
    fast(torch.randn(1, 4, 8), torch.nn.Linear(8, 2), torch.zeros(8, 8), torch.zeros(()))
    gpu_only = make_accumulate(orig, _mm)  # on_device cuda: a CPU Hessian is not touched
    gpu_only(torch.randn(1, 4, 8).to(torch.bfloat16), torch.nn.Linear(8, 2), torch.zeros(8, 8),
             torch.zeros(()))
    assert seen == [torch.float32, torch.bfloat16]


def test_cpu_calibration_is_untouched() -> None:
    from llmcompressor.modifiers.gptq import base

    before = base.accumulate_hessian
    with fast_hessian(False):
        assert base.accumulate_hessian is before
    with fast_hessian(True):  # no GPU here: the engine's function stays
        assert base.accumulate_hessian is before
    same = [[1, 2, 3], [4, 5, 6]]
    assert calibration_columns(same, gpu=False) == {
        "input_ids": same, "attention_mask": [[1, 1, 1], [1, 1, 1]]}
    assert calibration_columns(same, gpu=True) == {"input_ids": same}
    ragged = [[1, 2, 3], [4]]
    assert "attention_mask" in calibration_columns(ragged, gpu=True)


def test_sdpa_swap_is_opt_in_and_restored() -> None:
    import torch
    import transformers.models.llama.modeling_llama as ml
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantize.backends._gpu_fast import sdpa_in_traced_layers

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    eager = ml.eager_attention_forward
    with sdpa_in_traced_layers(model, True):  # fp32 calibration keeps eager attention
        assert ml.eager_attention_forward is eager
    model = model.to(torch.bfloat16)
    with sdpa_in_traced_layers(model, False):
        assert ml.eager_attention_forward is eager
    with sdpa_in_traced_layers(model, True):
        assert ml.eager_attention_forward is not eager
    assert ml.eager_attention_forward is eager
