"""Does a faster calibration setting change quality? Checked on the REAL default model
(SmolLM2-135M-Instruct), on the CPU, since its weights cannot travel to the GPU machine.

For each setting it runs plain llm-compressor GPTQ (the gptq-int4 recipe's modifiers, fp32
on CPU as the backend does there), then measures wiki-eval perplexity of the quantized model
in memory, and sums GPTQ's per-module losses.

  python -m bench.quality_cpu --json-out /tmp/q.json [--settings bs1,bs8,nopack]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from bench import profiler
from bench.quant_run import calibration_samples

SETTINGS: dict[str, tuple[str, int]] = {  # name: (calibration spec, batch size)
    "bs1": ("bench/calib-cpu-8x512.yaml", 1),
    "bs8": ("bench/calib-cpu-8x512.yaml", 8),
    "bs1-32x512": ("wiki", 1),
    "bs8-32x512": ("wiki", 8),
    "nopack": ("bench/calib-nopack-64x512.yaml", 1),
}


def eval_windows(tokenizer: Any, seq: int, count: int) -> Any:
    import torch

    from quantize.spec.texts import BUILTIN_TEXT

    lines = [x.strip() for x in BUILTIN_TEXT["wiki-eval"].read_text().splitlines() if x.strip()]
    ids = tokenizer("\n\n".join(lines), add_special_tokens=False)["input_ids"]
    body = seq - 1
    rows = [[tokenizer.bos_token_id, *ids[i * body:(i + 1) * body]] for i in range(count)]
    return torch.tensor(rows)


def perplexity(model: Any, windows: Any) -> float:
    import torch

    nll, n = 0.0, 0
    with torch.inference_mode():
        for w in windows.split(4):
            out = model(input_ids=w, labels=w)
            k = w.shape[0] * (w.shape[1] - 1)
            nll, n = nll + float(out.loss) * k, n + k
    return math.exp(nll / n)


def run_setting(name: str, model_dir: Path, windows: Any) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantize.backends.llmcompressor import build_modifiers, prepare_engine
    from quantize.spec.recipe import load_recipe

    prepare_engine()
    spec, bs = SETTINGS[name]
    recipe = load_recipe("gptq-int4")
    samples = calibration_samples("gptq-int4", spec, str(model_dir))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prof = profiler.Prof()
    profiler._capture_gptq_losses(prof)
    ds = Dataset.from_dict({"input_ids": samples,
                            "attention_mask": [[1] * len(s) for s in samples]})
    t0 = time.perf_counter()
    group_size = recipe.group_size if isinstance(recipe.group_size, int) else None
    oneshot(model=model, processor=tok,  # type: ignore[arg-type]
            recipe=build_modifiers(recipe, group_size),
            dataset=ds, num_calibration_samples=len(samples),
            max_seq_length=max(len(s) for s in samples), shuffle_calibration_samples=False,
            batch_size=bs)
    secs = time.perf_counter() - t0
    return {"setting": name, "calibration": spec, "batch_size": bs,
            "samples": len(samples), "tokens": sum(len(s) for s in samples),
            "oneshot_s": round(secs, 1), "ppl": round(perplexity(model, windows), 3),
            "gptq_loss_sum": round(sum(prof.gptq_losses), 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json-out", type=Path, required=True)
    p.add_argument("--settings", default="bs1,bs8")
    p.add_argument("--eval-windows", type=int, default=8)
    a = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantize.model.source import resolve_model

    model_dir = resolve_model(None).path
    tok = AutoTokenizer.from_pretrained(model_dir)
    windows = eval_windows(tok, 512, a.eval_windows)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows: list[dict[str, Any]] = [{"setting": "fp16 baseline (no quantization)",
                                   "ppl": round(perplexity(base, windows), 3)}]
    del base
    print(json.dumps(rows[0]), flush=True)
    for name in a.settings.split(","):
        rows.append(run_setting(name, model_dir, windows))
        print(json.dumps(rows[-1]), flush=True)
        a.json_out.write_text(json.dumps({"eval_tokens": int(windows.numel()), "rows": rows}))


if __name__ == "__main__":
    main()
