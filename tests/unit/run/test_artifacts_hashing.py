from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from quantize.run.files import copy_hashed, hash_files, hash_tree, link_or_copy, sha256_file


def _truth(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_copy_hashed_gives_the_true_hash_whether_or_not_the_source_was_hashed(
        tmp_path: Path) -> None:
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"x" * 3_000_001)
    b.write_bytes(b"y" * 10)
    assert copy_hashed(a, tmp_path / "a2.bin") == _truth(a)  # not hashed before: one pass
    assert sha256_file(b) == _truth(b)
    assert copy_hashed(b, tmp_path / "b2.bin") == _truth(b)  # known: kernel copy, hash reused
    assert (tmp_path / "b2.bin").read_bytes() == b.read_bytes()


def test_parallel_hashes_match_one_by_one(tmp_path: Path) -> None:
    files = []
    for i in range(5):
        f = tmp_path / f"shard-{i}.bin"
        f.write_bytes(bytes([i]) * (1_000_000 + i))
        files.append(f)
    assert hash_files(files) == [_truth(f) for f in files]
    assert hash_tree(tmp_path) == {f.name: _truth(f) for f in files}


def test_link_or_copy_links_on_one_file_system(tmp_path: Path) -> None:
    src = tmp_path / "w.safetensors"
    src.write_bytes(b"weights")
    link_or_copy(src, tmp_path / "linked.safetensors")
    assert (tmp_path / "linked.safetensors").stat().st_ino == src.stat().st_ino
    assert sha256_file(tmp_path / "linked.safetensors") == _truth(src)


def _rewrite_same_stat(path: Path, data: bytes) -> None:
    """New bytes, same size, and the old mtime put back (as copystat/copytree would)."""
    st = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_rewrite_that_keeps_size_and_mtime_is_hashed_again(tmp_path: Path) -> None:
    f = tmp_path / "shard.bin"
    f.write_bytes(b"a" * 2_000_000)
    time.sleep(0.06)  # out of the racy window, so the first hash is remembered
    assert sha256_file(f) == _truth(f)
    time.sleep(0.02)
    _rewrite_same_stat(f, b"b" * 2_000_000)
    assert sha256_file(f) == _truth(f)  # ctime moved: the remembered hash is not used


def test_a_file_hashed_as_it_is_written_is_not_remembered(tmp_path: Path) -> None:
    f = tmp_path / "shard.bin"
    f.write_bytes(b"a" * 2_000_000)
    first = sha256_file(f)  # within the racy window: read, not remembered
    _rewrite_same_stat(f, b"b" * 2_000_000)  # possibly in the same tick: same stat
    assert first != sha256_file(f) == _truth(f)


def test_small_files_are_always_read(tmp_path: Path) -> None:
    f = tmp_path / "export-manifest.json"
    f.write_bytes(b"1" * 100)
    time.sleep(0.06)
    assert sha256_file(f) == _truth(f)
    _rewrite_same_stat(f, b"2" * 100)
    assert sha256_file(f) == _truth(f)
