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


class _Writer:
    """A stand-in for the module whose save function the engine calls per shard."""

    @staticmethod
    def save(data: bytes, filename: str) -> None:
        Path(filename).write_bytes(data)


def test_files_hashed_while_written_are_known_and_true(tmp_path: Path) -> None:
    from quantize.run.files import _HASHED, _known, hashed_while_written

    original = _Writer.save
    with hashed_while_written(_Writer, "save"):
        for i in range(3):
            _Writer.save(bytes([i + 1]) * (2_000_000 + i), str(tmp_path / f"s{i}.bin"))
        _Writer.save(b"small", str(tmp_path / "config.json"))  # under the cache size: skipped
    assert _Writer.save is original  # the writer is put back
    for i in range(3):
        f = tmp_path / f"s{i}.bin"
        assert _known(f) == _truth(f)  # remembered from the child, not read here
    assert _known(tmp_path / "config.json") is None
    assert hash_tree(tmp_path) == {f.name: _truth(f) for f in tmp_path.iterdir()}
    _HASHED.clear()


def test_a_file_changed_before_its_hash_is_collected_is_not_remembered(tmp_path: Path
                                                                        ) -> None:
    from quantize.run.files import HashWhileWriting, _known

    f = tmp_path / "s.bin"
    f.write_bytes(b"a" * 2_000_000)
    hashes = HashWhileWriting()
    hashes.add(f)
    time.sleep(0.02)
    f.write_bytes(b"b" * 2_000_001)  # another size: another stat key
    assert hashes.finish() == 0
    assert _known(f) is None
    assert sha256_file(f) == _truth(f)


def test_an_error_in_the_writer_puts_it_back_and_stops_the_children(tmp_path: Path) -> None:
    from quantize.run.files import hashed_while_written

    original = _Writer.save
    try:
        with hashed_while_written(_Writer, "save"):
            _Writer.save(b"x" * 2_000_000, str(tmp_path / "a.bin"))
            raise OSError("disk full")
    except OSError:
        pass
    assert _Writer.save is original


def test_a_missing_writer_means_hashing_later(tmp_path: Path) -> None:
    from quantize.run.files import hashed_while_written

    with hashed_while_written(_Writer, "no_such_function") as hashes:
        assert hashes.finish() == 0
