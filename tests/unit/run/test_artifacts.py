from __future__ import annotations

from pathlib import Path

import pytest

from quantize.errors import ExportError
from quantize.run.files import atomic_dir, atomic_write_json, check_tree, hash_tree, tmp_dir_for
from tests.fixtures.manifests import read_manifest


def test_atomic_write_replaces_whole_file(tmp_path: Path) -> None:
    p = tmp_path / "a.json"
    atomic_write_json(p, {"x": 1})
    atomic_write_json(p, {"x": 2})
    assert p.read_text().strip().endswith("}") and '"x": 2' in p.read_text()
    assert [f.name for f in tmp_path.iterdir()] == ["a.json"]  # no temp files left


def test_atomic_dir_failure_leaves_nothing_and_keeps_old(tmp_path: Path) -> None:
    final = tmp_path / "export"
    with atomic_dir(final) as tmp:
        (tmp / "f").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(final) as tmp:
        (tmp / "f").write_text("half")
        raise RuntimeError("crash mid-write")
    assert (final / "f").read_text() == "old"
    assert not tmp_dir_for(final).exists()


def test_atomic_dir_discards_a_killed_runs_partial(tmp_path: Path) -> None:
    final = tmp_path / "export"
    partial = tmp_dir_for(final)
    partial.mkdir()
    (partial / "stale").write_text("from a killed run")
    old = tmp_path / ".export.old"  # a crash between atomic_dir's two renames
    old.mkdir()
    with atomic_dir(final) as tmp:
        assert not (tmp / "stale").exists()
        (tmp / "new").write_text("x")
    assert sorted(p.name for p in final.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_check_tree_refuses_tampered_truncated_missing(tmp_path: Path) -> None:
    (tmp_path / "w.safetensors").write_bytes(b"0123456789")
    (tmp_path / "config.json").write_text("{}")
    hashes = hash_tree(tmp_path)
    check_tree(tmp_path, hashes, "export")
    (tmp_path / "w.safetensors").write_bytes(b"01234")
    with pytest.raises(ExportError) as err:
        check_tree(tmp_path, hashes, "export")
    assert err.value.path == str(tmp_path / "w.safetensors")
    assert err.value.problem == "does not match its recorded sha256 (changed or truncated)"
    assert str(err.value).startswith(f"export: {tmp_path / 'w.safetensors'} does not match")
    (tmp_path / "w.safetensors").unlink()
    with pytest.raises(ExportError) as err:
        check_tree(tmp_path, hashes, "export")
    assert (err.value.path, err.value.problem) == (str(tmp_path), "lacks ['w.safetensors']")
    assert err.value.hint is not None and "re-run" in err.value.hint
    with pytest.raises(ExportError) as err:
        check_tree(tmp_path / "nope", hashes, "export")
    assert (err.value.path, err.value.problem) == (str(tmp_path / "nope"), "is missing")


def test_corrupt_manifest_is_a_clear_error(tmp_path: Path) -> None:
    assert read_manifest(tmp_path) == {"schema": 1, "stages": {}}
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ExportError) as err:
        read_manifest(tmp_path)
    assert (err.value.path, err.value.problem) == (str(tmp_path / "manifest.json"), "is corrupt")
    assert err.value.hint is not None and "re-run" in err.value.hint


