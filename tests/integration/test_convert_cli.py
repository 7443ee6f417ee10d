"""`quantize convert` end to end through the CLI on tiny models built in code, and on the
shipped GGUF (the one real file this machine has)."""

# ruff: noqa: F811  (session fixtures imported from fixtures.convert_models)
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from fixtures.convert_models import (  # noqa: F401 (fixtures)
    GEN,
    bf16_dir,
    bf16_mtp_dir,
    fp8_dir,
    tiny_bf16,
    to_gptq,
)

from quantize.cli import main


def test_fp8_block_to_bf16(fp8_dir: tuple, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(fp8_dir[0]), "--to", "hf-bf16", "--out",
                                  str(out), "--no-smoke"])
    assert r.exit_code == 0, r.output
    assert f"fp8-block (block 48x48) → hf-bf16: {out}" in r.output
    assert "preserved: yes" in r.output
    report = json.loads((out / "convert_report.json").read_text())
    assert report["preserved"] and report["tensors"]["tensors"] == len(fp8_dir[1])
    assert (out / "convert_report.md").is_file()


def test_an_unknown_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.ckpt").write_bytes(b"x")
    r = CliRunner().invoke(main, ["convert", str(tmp_path / "m"), "--to", "hf-bf16", "--out",
                                  str(tmp_path / "out")])
    assert r.exit_code == 2
    (line,) = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert "format found: pickle weights only (model.ckpt)" in line and "supported:" in line


def test_gptq_to_gguf_reads_back_with_the_dequantized_values(tmp_path: Path,
                                                             default_tokenizer: Path) -> None:
    """GPTQ -> GGUF f32: the GGUF writer (quantize.convert.gguf_out) fed the dequantized
    weights; gguf's reader gets the source's dequantized values back. The generation config
    holds only token ids here: GGUF has no key for do_sample."""
    import gguf

    src = tiny_bf16(tmp_path / "bf16", tokenizer=default_tokenizer)
    (src / "generation_config.json").write_text(json.dumps(
        {k: GEN[k] for k in ("bos_token_id", "eos_token_id")}))
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(bos_token_id=GEN["bos_token_id"], eos_token_id=GEN["eos_token_id"])
    (src / "config.json").write_text(json.dumps(cfg))
    ref = to_gptq(src, tmp_path / "gptq")
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(tmp_path / "gptq"), "--to", "gguf",
                                  "--gguf-type", "f32", "--out", str(out)])
    if r.exit_code != 0 and "lost" in r.output:
        pytest.fail(r.output)
    assert r.exit_code == 0, r.output
    (path,) = out.glob("*.gguf")
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    down = torch.from_numpy(by_name["blk.0.ffn_down.weight"].data.copy()).reshape(64, 128)
    torch.testing.assert_close(down, ref["model.layers.0.mlp.down_proj.weight"], rtol=0,
                               atol=1e-6)


@pytest.mark.slow
def test_shipped_gguf_to_bf16(tmp_path: Path) -> None:
    from quantize.model.source import gguf_path

    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(gguf_path()), "--to", "hf-bf16", "--out",
                                  str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads((out / "convert_report.json").read_text())
    assert report["source_format"] == "gguf (Q4_1)" and report["preserved"]
    assert report["smoke"]["skipped"] is None and report["smoke"]["top1"] > 0.9
