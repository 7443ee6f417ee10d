"""verify: prove that an export loads in vLLM and computes what transformers computes.

Two levels, and verify.json says which one a checkpoint got:

- `vllm` (full): vLLM, in its own environment and a fresh subprocess, loads the checkpoint
  and decodes greedily from fixed prompts, returning each chosen token's log-probability and
  the top-k. transformers (+ compressed-tensors, which fake-quantizes activations the way the
  scheme says) then scores the same token sequences in fp32. Compared: greedy agreement (the
  fraction of steps where transformers' argmax is vLLM's token; the first disagreement is
  where free-running greedy decoding would part) and |Δ log-prob| of vLLM's tokens.
- `decode` (fallback, when this host's vLLM cannot run the format): the export is
  decompressed by transformers + compressed-tensors and compared with a reference that
  quantize.model.decode rebuilds on its own from the raw safetensors (bit-unpacking,
  W = (q - zp) * scale per group or channel, the scheme's activation quantization
  re-implemented as hooks) in a plain dense model. Both are the same fp32 arithmetic over the
  same integers and scales, so they must agree to float tolerance. This checks the stored
  integers, scales, zero points and packing layout, not the quantization quality (the gate
  does that). Native GPTQ/AWQ exports (backend gptqmodel/autoawq) get the same check against
  GPTQModel's kernels, which is what transformers loads them with, decoded from their own
  layouts (GPTQ v1/v2, AWQ GEMM).
  It is preferred to comparing with the dense model's logits under a scheme-derived
  tolerance, because that tolerance must be loose enough for 2-bit recipes (RTN INT2 of the
  default model agrees with it on 0.4% of next tokens) and so would pass a corrupt 8-bit
  export. The source model is still compared, weight by weight (column cosine, floor by
  bits), to catch a decode that is consistent but wrong: both sides misreading a layout the
  same way.

On a run folder the stage is recorded in the manifest (`stages.verify`, its inputs naming the
export's key) and reused while nothing changed. The package, by job: target (what is
verified, the prompts), scoring (transformers' side and the comparison), vllm_run (the full
level), decode_check (the fallback level), report (verify.md, the one-line result), stage
(choosing the level, recording the stage).
"""

from __future__ import annotations

from quantize.stages.verify.decode_check import DecodeTolerance, eval_text_ids, verify_decode
from quantize.stages.verify.report import dtype_note, one_line, render
from quantize.stages.verify.scoring import (
    Thresholds,
    compare,
    load_hf,
    log_probs,
    score,
    unfuse_native_kernels,
)
from quantize.stages.verify.stage import VerifyOptions, run, stage_inputs, verify
from quantize.stages.verify.target import (
    NAME,
    PROMPTS,
    checkpoint_config,
    prompt_ids,
    resolve_target,
    source_model,
)
from quantize.stages.verify.vllm_run import (
    MAX_TOKENS,
    TOP_K,
    engine_request,
    serve_command,
    verify_vllm,
)

__all__ = [
    "MAX_TOKENS",
    "NAME",
    "PROMPTS",
    "TOP_K",
    "DecodeTolerance",
    "Thresholds",
    "VerifyOptions",
    "checkpoint_config",
    "compare",
    "dtype_note",
    "engine_request",
    "eval_text_ids",
    "load_hf",
    "log_probs",
    "one_line",
    "prompt_ids",
    "render",
    "resolve_target",
    "run",
    "score",
    "serve_command",
    "source_model",
    "stage_inputs",
    "unfuse_native_kernels",
    "verify",
    "verify_decode",
    "verify_vllm",
]
