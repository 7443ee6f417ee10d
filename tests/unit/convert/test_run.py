"""quantize.convert.run: refusals before any work, a crashed run resumed from its finished
shards, an existing output kept unless --force, and a preservation loss failing the run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from quantize.convert.run import Options, convert, work_dir
from quantize.convert.writer import PROGRESS
from quantize.errors import ExportError, ModelError

SMALL = 40_000  # bytes per output shard: the tiny model writes several


def test_an_unknown_format_is_refused_in_one_line_before_any_work(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "weights.pt").write_bytes(b"\x80\x04")
    with pytest.raises(ModelError) as exc:
        convert(tmp_path / "m", "hf-bf16", tmp_path / "out")
    assert "format found: pickle weights only (weights.pt)" in str(exc.value)
    assert "\n" not in str(exc.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_an_unsupported_pair_is_refused_naming_the_format(bf16_dir: Path, tmp_path: Path
                                                          ) -> None:
    with pytest.raises(ModelError, match=r"format found: hf-bf16; converting it to "
                       r"compressed-tensors is not supported; supported: "):
        convert(bf16_dir, "compressed-tensors", tmp_path / "out")
    with pytest.raises(ModelError, match="unknown target format 'onnx'"):
        convert(bf16_dir, "onnx", tmp_path / "out")


def test_a_truncated_shard_is_refused_before_any_work(fp8_dir: tuple, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(fp8_dir[0], src)
    shard = src / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ModelError, match=r"model-00001-of-00002\.safetensors: is truncated"):
        convert(src, "hf-bf16", tmp_path / "out")
    assert not work_dir(tmp_path / "out").exists()


class Crash(RuntimeError):
    pass


def test_a_crashed_run_resumes_from_its_finished_shards(fp8_dir: tuple, tmp_path: Path
                                                        ) -> None:
    out = tmp_path / "out"

    def crash_after_first(i: int) -> None:
        if i == 0:
            raise Crash

    with pytest.raises(Crash):
        convert(fp8_dir[0], "hf-bf16", out,
                Options(smoke=False, max_shard_bytes=SMALL, on_shard=crash_after_first))
    work = work_dir(out)
    assert not out.exists()
    record = json.loads((work / PROGRESS).read_text())
    (first,) = record["shards"]
    before = (work / first).stat()

    written: list[int] = []
    r = convert(fp8_dir[0], "hf-bf16", out,
                Options(smoke=False, max_shard_bytes=SMALL, on_shard=written.append))
    assert r.preserved and 0 not in written and written  # the first shard was not redone
    after = (out / first).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert not work.exists() and not (out / PROGRESS).exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == {p.name for p in out.glob("*.safetensors")}

    # the resumed output is the one an uninterrupted run writes, byte for byte
    clean = tmp_path / "clean"
    convert(fp8_dir[0], "hf-bf16", clean, Options(smoke=False, max_shard_bytes=SMALL))
    for f in clean.glob("*.safetensors"):
        assert f.read_bytes() == (out / f.name).read_bytes()


def test_an_existing_output_needs_force(fp8_dir: tuple, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    with pytest.raises(ExportError, match="already exists; pass --force"):
        convert(fp8_dir[0], "hf-bf16", tmp_path / "out")
    r = convert(fp8_dir[0], "hf-bf16", tmp_path / "out", Options(smoke=False, force=True))
    assert r.preserved and (tmp_path / "out" / "config.json").is_file()


def test_a_lost_chat_template_fails_the_run_and_keeps_the_work(fp8_dir: tuple, tmp_path: Path,
                                                               monkeypatch) -> None:
    from quantize.convert import stream

    real = stream.aux_files
    monkeypatch.setattr(stream, "aux_files", lambda folder: [
        p for p in real(folder) if not p.name.startswith("chat_template")])
    with pytest.raises(ExportError, match=r"the conversion lost chat template"):
        convert(fp8_dir[0], "hf-bf16", tmp_path / "out", Options(smoke=False))
    assert not (tmp_path / "out").exists()
    assert (work_dir(tmp_path / "out") / "convert_report.md").is_file()
