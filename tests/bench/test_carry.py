"""bench/carry.py: files cut into parts here, put back together there, every byte checked."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

from bench import carry


def _files(tmp: Path) -> list[Path]:
    rng = random.Random(0)
    out = []
    for name, size in (("a.tar.xz", 1000), ("b.whl", 1), ("c.gguf", 2500)):
        p = tmp / "src" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(bytes(rng.randrange(256) for _ in range(size)))
        out.append(p)
    return out


def test_parts_in_any_order_twice_give_back_every_member(tmp_path: Path) -> None:
    files = _files(tmp_path)
    manifest = carry.pack(files, tmp_path / "carry", 700)
    assert [p["name"] for p in manifest["parts"]] == [f"p{k}" for k in range(1, 7)]
    assert sum(p["size"] for p in manifest["parts"]) == 3501
    into = tmp_path / "there"
    order = ["p4", "p1", "p4", "p6", "p2", "p3"]  # p4 twice: a repeated call changes nothing
    for name in order:
        res = carry.receive(tmp_path / "carry" / name, into)
        assert res["state"] == "waiting"
        # a.tar.xz spans p1-p2, b.whl sits in p2: usable once those are in, before the rest
        early = set(res["members"])
        assert early == ({"a.tar.xz", "b.whl"} if {"p1", "p2"} <= set(res["have"]) else set())
    assert res["missing"] == ["p5"]
    assert Path(res["members"]["a.tar.xz"]).read_bytes() == files[0].read_bytes()
    res = carry.receive(tmp_path / "carry" / "p5", into)
    assert res["state"] == "complete"
    for f in files:
        assert Path(res["members"][f.name]).read_bytes() == f.read_bytes()
    assert carry.status(into)["state"] == "complete"  # resumes: already put together


def test_a_damaged_part_is_refused_and_can_be_sent_again(tmp_path: Path) -> None:
    files = _files(tmp_path)
    carry.pack(files, tmp_path / "carry", 2000)
    good = (tmp_path / "carry" / "p1" / "part").read_bytes()
    (tmp_path / "carry" / "p1" / "part").write_bytes(b"x" + good[1:])
    into = tmp_path / "there"
    with pytest.raises(carry.ChecksumError, match="p1"):
        carry.receive(tmp_path / "carry" / "p1", into)
    assert not (into / "parts" / "p1").exists()
    (tmp_path / "carry" / "p1" / "part").write_bytes(good)
    carry.receive(tmp_path / "carry" / "p1", into)
    assert carry.receive(tmp_path / "carry" / "p2", into)["state"] == "complete"


def test_a_member_that_does_not_match_its_checksum_is_not_kept(tmp_path: Path) -> None:
    files = _files(tmp_path)
    carry.pack(files, tmp_path / "carry", 5000)
    mf = tmp_path / "carry" / "p1" / carry.MANIFEST
    m = json.loads(mf.read_text())
    m["members"][2]["sha256"] = "0" * 64
    mf.write_text(json.dumps(m))
    with pytest.raises(carry.ChecksumError, match=r"c\.gguf"):
        carry.receive(tmp_path / "carry" / "p1", tmp_path / "there")
    assert not (tmp_path / "there" / "members" / "c.gguf").exists()


def test_cli_prints_one_json_line_and_exits_1_on_a_bad_part(tmp_path: Path, capsys) -> None:
    files = _files(tmp_path)
    assert carry.main(["pack", "--out", str(tmp_path / "c"), "--part-mib", "0.001",
                       *map(str, files)]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["total"] == 3501 and len(first["parts"]) == 4
    part = tmp_path / "c" / "p2" / "part"
    os.truncate(part, 10)
    assert carry.main(["receive", "--part", str(part.parent), "--into",
                       str(tmp_path / "t")]) == 1
    assert json.loads(capsys.readouterr().out)["state"] == "error"
    shutil.rmtree(tmp_path / "t")
