"""Peak memory of putting a fused-expert MoE checkpoint into llm-compressor's per-expert form:
plain `from_pretrained` and then `linearize_moe` (what `oneshot` falls back to, with a warning,
when it is handed a fused model) against loading under llm-compressor's own
`load_quantizable_moe` (the checkpoint's 2-D expert tensors loaded straight into per-expert
Linears), each in its own process so the peaks are their own.

  python -m bench.moe_load --out DIR [--layers 8 --experts 64 --hidden 512 --moe-inter 384]

The H200 run of issue #18 (Qwen3-30B-A3B architecture, 56.9 GiB bf16) peaked at 110.97 GiB on
the GPU in the pipeline and in plain oneshot alike: linearize_moe holds every fused module
until the last one is replaced, so the experts are in memory twice. This measures the same on
the CPU (resident set) with a random Qwen3-MoE written to DIR, and checks that both paths give
the same tensors under the same names.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any


def build(out: Path, a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    if (out / "config.json").is_file():
        return json.loads((out / "built.json").read_text())
    cfg = Qwen3MoeConfig(vocab_size=4096, hidden_size=a.hidden, num_hidden_layers=a.layers,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                         intermediate_size=4 * a.hidden, moe_intermediate_size=a.moe_inter,
                         num_experts=a.experts, num_experts_per_tok=8, norm_topk_prob=True,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    info = {"params": sum(p.numel() for p in model.parameters()),
            "bytes": sum(p.stat().st_size for p in out.glob("*.safetensors"))}
    (out / "built.json").write_text(json.dumps(info))
    return info


def load(path: Path, how: str) -> dict[str, Any]:
    """Runs in a child process: load one way, report the peak resident set and a digest."""
    import hashlib

    import torch
    from transformers import AutoModelForCausalLM

    if how == "linearize_after_load":
        from llmcompressor.modeling.moe.linearize import linearize_moe

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        linearize_moe(model)
    else:
        from quantize.model.moe import linearize

        model = linearize(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
    digest = hashlib.sha256()
    names = sorted(n for n, _ in model.named_parameters())
    params = dict(model.named_parameters())
    for n in names:
        digest.update(n.encode())
        digest.update(params[n].detach().float().contiguous().numpy().tobytes())
    return {"how": how, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            / 2**20, "tensors": len(names), "sha256": digest.hexdigest()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--moe-inter", type=int, default=384)
    p.add_argument("--child", default=None)
    a = p.parse_args()
    model_dir = a.out / "model"
    if a.child:
        print(json.dumps(load(model_dir, a.child)))
        return
    info = build(model_dir, a)
    rows = []
    for how in ("linearize_after_load", "quantize_linearize"):
        res = subprocess.run([sys.executable, "-m", "bench.moe_load", "--out", str(a.out),
                              "--child", how], capture_output=True, text=True, check=True)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    result = {"model": info, "rows": rows,
              "same_tensors": rows[0]["sha256"] == rows[1]["sha256"],
              "checkpoint_gib": info["bytes"] / 2**30}
    (a.out / "moe_load.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
