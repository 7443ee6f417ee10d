"""A model folder with the real Llama-3.1-8B architecture and RANDOM bf16 weights.

No weights can be downloaded on the GPU machine, and timing does not depend on weight
values, so the benchmark builds the public Llama-3.1-8B config with random weights
(initialised on the GPU, saved as safetensors) and a tokenizer borrowed from the default
model (SmolLM2: 49152 ids, all valid in the 128256-entry vocabulary). Perplexities of this
model mean nothing; times, FLOPs and memory are those of the real architecture.

  python -m bench.make_model --preset llama3.1-8b --tokenizer DIR --out /tmp/llama8b
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

# Public config of meta-llama/Llama-3.1-8B (config.json), with the dtype it ships in.
LLAMA31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
    "initializer_range": 0.02,
}
PRESETS: dict[str, dict[str, Any]] = {
    "llama3.1-8b": LLAMA31_8B,
    # Same code path at toy size, for CPU checks of the benchmark scripts.
    "tiny": {**LLAMA31_8B, "hidden_size": 256, "intermediate_size": 512,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 64, "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2},
}
# Presets read from a shipped public config (quantize/data/model_configs/), built through
# AutoModelForCausalLM: the MoE architecture of issue #18 (30.5 B parameters, 56.9 GiB bf16).
# "-12l": the same layers, 12 of its 48 (14.3 GiB): the placement rows that must fit one call;
# "-2l": 2 of them (3.5 GiB), for profiling the same code path on a CPU
SHIPPED: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-30b-a3b": ("Qwen--Qwen3-30B-A3B.json", {}),
    "qwen3-30b-a3b-12l": ("Qwen--Qwen3-30B-A3B.json", {"num_hidden_layers": 12}),
    "qwen3-30b-a3b-2l": ("Qwen--Qwen3-30B-A3B.json", {"num_hidden_layers": 2}),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def build(preset: str, out: Path, tokenizer: Path, device: str, seed: int = 0) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    marker = out / ".complete"
    if marker.is_file():
        info: dict[str, Any] = json.loads(marker.read_text())
        if info.get("preset") == preset:
            return {**info, "reused": True}
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    if preset in SHIPPED:
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg_file = Path(__file__).resolve().parent.parent / "quantize" / "data" / \
            "model_configs" / SHIPPED[preset][0]
        raw = {k: v for k, v in json.loads(cfg_file.read_text()).items()
               if not k.startswith("_") and k != "torch_dtype"} | SHIPPED[preset][1]
        config = AutoConfig.for_model(**raw)
        make: Any = AutoModelForCausalLM.from_config
    else:
        config = LlamaConfig(**PRESETS[preset])
        make = LlamaForCausalLM
    config.dtype = torch.bfloat16
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = make(config)
    finally:
        torch.set_default_dtype(default)
    if device == "cuda":
        torch.cuda.synchronize()
    t_init = time.perf_counter() - t0
    model.save_pretrained(out, max_shard_size="5GB")
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy2(tokenizer / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    del model
    info = {"preset": preset, "params": params, "init_s": round(t_init, 1),
            "total_s": round(time.perf_counter() - t0, 1),
            "bytes": sum(p.stat().st_size for p in out.glob("*.safetensors")),
            "weights": "random (normal, std 0.02), not a trained model"}
    marker.write_text(json.dumps(info))
    return {**info, "reused": False}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", choices=sorted([*PRESETS, *SHIPPED]), default="llama3.1-8b")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokenizer", type=Path, required=True,
                   help="folder with tokenizer.json/tokenizer_config.json to copy")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    print(json.dumps(build(a.preset, a.out, a.tokenizer, a.device)))


if __name__ == "__main__":
    main()
