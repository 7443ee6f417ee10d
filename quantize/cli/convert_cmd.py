"""`quantize convert SRC --to FORMAT --out DIR`: one model format to another, streamed,
checked for what it must preserve, and proven by a round trip (docs/convert.md)."""

from __future__ import annotations

from pathlib import Path

import click

from quantize.cli.app import handle_errors, main


def _targets() -> list[str]:
    """The formats `--to` takes: the targets of convert's registry. Read when the CLI is
    imported (click needs the choices at declaration): quantize.convert.run imports no torch,
    about 25 ms."""
    from quantize.convert.run import REGISTRY

    return sorted({t.value for _, t in REGISTRY})


@main.command("convert")
@click.argument("src", type=click.Path(path_type=Path, exists=True))
@click.option("--to", "to", type=click.Choice(_targets()), required=True,
              help="the format to write (hf-bf16 / hf-fp16: dense safetensors; "
                   "compressed-tensors: W4A16 from GPTQ/AWQ; gguf: llama.cpp)")
@click.option("--out", "-o", type=click.Path(path_type=Path), required=True,
              help="output folder (appears only once complete)")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]),
              default="bfloat16", show_default=True, help="dense outputs' dtype")
@click.option("--gguf-type", default="q8_0", show_default=True,
              help="GGUF output tensor type: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1")
@click.option("--shard-size", type=click.FloatRange(min=0.01), default=4.0,
              show_default=True, help="largest output shard, GiB")
@click.option("--no-smoke", is_flag=True, help="skip the logits smoke test (it loads both "
                                               "models in transformers)")
@click.option("--force", is_flag=True, help="replace an existing --out")
@handle_errors
def convert_cmd(src: Path, to: str, out: Path, dtype: str, gguf_type: str,
                shard_size: float, no_smoke: bool, force: bool) -> None:
    """Convert SRC (a model folder or a .gguf file) to FORMAT in OUT. The format of SRC is
    detected from its headers; an unknown or unsupported one is refused before any work.
    A crashed run resumes: re-run the same command. Exit status 0 only when nothing was
    lost (tensor names, MTP layers, tied embeddings, rope, tokenizer, chat template,
    generation config, special tokens)."""
    from quantize.convert.run import Options, convert
    from quantize.progress import console

    r = convert(src, to, out, Options(dtype=dtype, gguf_type=gguf_type, force=force,
                                      smoke=not no_smoke,
                                      max_shard_bytes=int(shard_size * (1 << 30))))
    t, s = r.tensors, r.smoke
    smoke = (f"skipped ({s.skipped})" if s.skipped else
             f"KL {s.kl:.3g} nats, top-1 {100 * (s.top1 or 0):.1f} %")
    console.print(f"{r.source_format} → {r.target_format}: {out}")
    console.print(f"  tensors checked {t.tensors}: worst max-abs {t.worst_max_abs:.3g}, "
                  f"lowest cosine {t.min_cosine:.6f}")
    console.print(f"  logits smoke test: {smoke}")
    console.print(f"  preserved: {'yes' if r.preserved else 'NO'} "
                  f"({len(r.preservation)} checks; convert_report.md)")
    console.print(f"  time {r.seconds:.1f} s, peak RSS {r.peak_rss_bytes / (1 << 30):.2f} GiB")
