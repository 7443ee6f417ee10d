"""Model resolution refuses a bad --model with a ModelError whose fields name the path, the
problem and the fix (the printed line is checked end to end in test_bad_inputs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantize.errors import ModelError
from quantize.model.config import ModelConfig
from quantize.model.source import check_architecture, check_model_dir, resolve_model


def _refused(folder: str | Path, **kwargs: bool) -> ModelError:
    with pytest.raises(ModelError) as info:
        resolve_model(str(folder), **kwargs)
    return info.value


def test_a_missing_folder(tmp_path: Path) -> None:
    err = _refused(tmp_path / "nope")
    assert err.problem == f"model folder {str(tmp_path / 'nope')!r} does not exist"
    assert err.hint is not None and "a Hub id, or `default`" in err.hint


def test_a_folder_without_config_or_weights(tmp_path: Path) -> None:
    err = _refused(tmp_path)
    assert (err.path, err.problem) == (str(tmp_path), "has no config.json")
    assert err.hint is not None and err.hint.startswith("point --model at the folder")
    assert str(err) == f"{tmp_path} has no config.json; {err.hint}"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    err = _refused(tmp_path)
    assert (err.path, err.problem, err.hint) == (str(tmp_path), "has no *.safetensors weights",
                                                 "download the weights too")


def test_pickle_only_weights_need_the_flag(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    err = _refused(tmp_path)
    assert err.problem == "holds only pickle weights (pytorch_model.bin)"
    assert err.hint is not None and "--allow-pickle" in err.hint


def test_a_truncated_safetensors_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"\x01")
    with pytest.raises(ModelError) as info:
        check_model_dir(tmp_path)
    err = info.value
    assert err.path == str(tmp_path / "model.safetensors")
    assert err.problem is not None and err.problem.startswith("is not a valid safetensors file")
    assert err.hint == "re-download or re-export it"


def test_unknown_architectures() -> None:
    with pytest.raises(ModelError) as info:
        check_architecture(ModelConfig.model_validate({"model_type": "nosuchformer"}),
                           trust_remote_code=False)
    assert info.value.problem == ("unsupported architecture: model_type 'nosuchformer' is "
                                  "unknown to transformers")
    with pytest.raises(ModelError) as info:
        check_architecture(ModelConfig.model_validate(
            {"model_type": "nosuchformer", "auto_map": {"A": "m.M"}}),
                           trust_remote_code=False)
    assert info.value.hint == "if you trust it set `trust_remote_code: true` in the recipe"


# --- #47: an empty --model, a model folder that is a file, links, headers, the fingerprint --
def _folder(path: Path, **extra: bytes | str) -> Path:
    """A model folder resolve_model accepts: config.json and one small safetensors file."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"a": torch.zeros(2, 3, dtype=torch.float16)}, path / "model.safetensors")
    for name, content in extra.items():
        f = path / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(content) if isinstance(content, bytes) else f.write_text(content)
    return path


@pytest.mark.parametrize("spec", ["", " ", "\t"])
def test_an_empty_model_is_refused_not_the_default(spec: str) -> None:
    err = _refused(spec)
    assert err.problem == f"--model {spec!r} is empty"
    assert err.hint is not None and "leave --model out for the default" in err.hint


def test_a_model_folder_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "m").write_text("x")
    err = _refused(tmp_path / "m")
    assert err.problem == f"model folder {str(tmp_path / 'm')!r} is a file, not a folder"


def test_a_link_leaving_the_folder_is_refused_naming_it(tmp_path: Path) -> None:
    m = _folder(tmp_path / "m")
    (tmp_path / "secret").write_text("root:x")
    (m / "chat_template.jinja").symlink_to(tmp_path / "secret")
    err = _refused(m)
    assert err.path == str(m / "chat_template.jinja")
    assert err.problem == f"is a symlink to {tmp_path / 'secret'}, outside the model folder"
    assert err.hint is not None and err.hint.startswith("copy the real file into the model")


def test_a_nested_link_and_a_link_to_a_folder_outside_are_refused(tmp_path: Path) -> None:
    m = _folder(tmp_path / "m", **{"additional_chat_templates/a.jinja": "{{ x }}"})
    (tmp_path / "etc").mkdir()
    (m / "additional_chat_templates" / "b.jinja").symlink_to("../../etc")
    assert _refused(m).path == str(m / "additional_chat_templates" / "b.jinja")
    (m / "additional_chat_templates" / "b.jinja").unlink()
    (m / "sub").symlink_to(tmp_path / "etc", target_is_directory=True)
    assert _refused(m).path == str(m / "sub")


def test_links_inside_the_folder_are_fine(tmp_path: Path) -> None:
    m = _folder(tmp_path / "m", **{"real/template.jinja": "{{ x }}"})
    (m / "chat_template.jinja").symlink_to("real/template.jinja")
    link = tmp_path / "link-to-m"
    link.symlink_to(m, target_is_directory=True)  # the folder itself may be a link
    assert resolve_model(str(link)).path == m.resolve()


def test_loops_and_broken_links_are_named(tmp_path: Path) -> None:
    m = _folder(tmp_path / "m")
    (m / "config.json").unlink()
    (m / "config.json").symlink_to("config.json")
    err = _refused(m)
    assert (err.path, err.problem) == (str(m / "config.json"), "is a symlink loop")
    (m / "config.json").unlink()
    (m / "config.json").symlink_to("a.json")
    (m / "a.json").symlink_to("config.json")
    assert _refused(m).problem == "is a symlink loop"
    for f in ("config.json", "a.json"):
        (m / f).unlink()
    (m / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (m / "tokenizer.json").symlink_to("nowhere.json")
    assert _refused(m).problem == "is a broken symlink (to nowhere.json)"


def test_a_hub_snapshot_may_link_into_its_own_repo_only(tmp_path: Path) -> None:
    """huggingface_hub's layout: models--org--name/snapshots/REV/f -> ../../blobs/SHA."""
    repo = tmp_path / "hub" / "models--org--m"
    src = _folder(tmp_path / "src")
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "rev1"
    snap.mkdir(parents=True)
    for f in src.iterdir():
        (repo / "blobs" / f"sha-{f.name}").write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(f"../../blobs/sha-{f.name}")
    assert resolve_model(str(snap)).path == snap
    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    (other / "x").write_text("{}")
    (snap / "tokenizer.json").symlink_to("../../../models--org--other/blobs/x")
    assert _refused(snap).path == str(snap / "tokenizer.json")


def _header_file(path: Path, header: object, data: bytes) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


@pytest.mark.parametrize(("header", "data", "phrase"), [
    ({"a": {"dtype": "F16", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4,
     "tensor 'a' (F16 [4]) needs 8 bytes, its data_offsets [0, 4] hold 4"),
    ({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
      "b": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4,
     "starts at byte 0, not 4 (tensors overlap or leave a gap)"),
    ({"a": {"dtype": "F16", "shape": [2], "data_offsets": [4, 8]}}, b"\0" * 8,
     "tensor 'a' starts at byte 4, not 0"),
    ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}}, b"\0", "unknown dtype 'Q4'"),
    ({"a": {"dtype": "F16", "shape": [-2], "data_offsets": [0, 0]}}, b"", "not a list of sizes"),
    ({"a": {"dtype": "F16", "shape": [1], "data_offsets": [2]}}, b"\0\0", "data_offsets [2]"),
    ({"a": "F16"}, b"", "tensor 'a' has no dtype/shape/offsets"),
    (["a"], b"", "the header is not a JSON object"),
])
def test_a_header_that_lies_is_refused(tmp_path: Path, header: object, data: bytes,
                                       phrase: str) -> None:
    from quantize.model.source import safetensors_header

    with pytest.raises(ModelError) as info:
        safetensors_header(_header_file(tmp_path / "w.safetensors", header, data))
    assert info.value.problem is not None and phrase in info.value.problem
    assert info.value.path == str(tmp_path / "w.safetensors")


def test_sub_byte_dtypes_count_bits(tmp_path: Path) -> None:
    from quantize.model.source import safetensors_header

    ok = {"a": {"dtype": "F4", "shape": [3, 2], "data_offsets": [0, 3]},
          "b": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [3, 5]}}
    assert set(safetensors_header(_header_file(tmp_path / "w.safetensors", ok, b"\0" * 5))) \
        == {"a", "b"}


def test_a_shard_index_must_name_shards_that_are_there(tmp_path: Path) -> None:
    from quantize.model.source import weight_files

    m = _folder(tmp_path / "m", **{"consolidated.safetensors": b"ignored by transformers"})
    index = {"weight_map": {"a": "model.safetensors"}}
    (m / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weight_files(m) == [m / "model.safetensors"]  # what the index names, only
    index["weight_map"]["b"] = "model-2.safetensors"
    (m / "model.safetensors.index.json").write_text(json.dumps(index))
    err = _refused(m)
    assert err.problem == "names the shard 'model-2.safetensors', which is not in the folder"


def test_the_fingerprint_covers_every_file_that_reaches_the_export(tmp_path: Path) -> None:
    """The stage keys hash the model through its fingerprint: a changed chat template,
    generation config or tokenizer file is a changed model (the export is rebuilt)."""
    from quantize.model.source import model_files, model_fingerprint

    m = _folder(tmp_path / "m", **{"chat_template.jinja": "{{ a }}", "tokenizer.json": "{}",
                                   "generation_config.json": "{}", "vocab.txt": "a\n",
                                   "additional_chat_templates/tool.jinja": "{{ t }}",
                                   "README.md": "not read", ".complete": "{}"})
    ref = resolve_model(str(m))
    assert [p.relative_to(m).as_posix() for p in model_files(m)] == [
        "additional_chat_templates/tool.jinja", "chat_template.jinja", "config.json",
        "generation_config.json", "model.safetensors", "tokenizer.json", "vocab.txt"]
    seen = {model_fingerprint(ref)}
    for name in ("chat_template.jinja", "generation_config.json", "vocab.txt",
                 "additional_chat_templates/tool.jinja"):
        (m / name).write_text((m / name).read_text() + " ")
        seen.add(model_fingerprint(ref))
    assert len(seen) == 5
    (m / "README.md").write_text("edited")
    assert model_fingerprint(ref) in seen


def test_the_tokenizer_files_keep_the_keys_order(tmp_path: Path) -> None:
    from quantize.model.source import tokenizer_files

    m = _folder(tmp_path / "m", **{"tokenizer.json": "{}", "tokenizer_config.json": "{}",
                                   "chat_template.jinja": "x", "merges.txt": "",
                                   "special_tokens_map.json": "{}"})
    assert [p.name for p in tokenizer_files(m)] == [
        "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "merges.txt",
        "special_tokens_map.json"]


def test_hashing_stops_when_cancelled(tmp_path: Path) -> None:
    import threading
    from concurrent.futures import CancelledError

    from quantize.model.source import model_fingerprint

    ref = resolve_model(str(_folder(tmp_path / "m", **{"big.json": b"x" * (3 << 20)})))
    stop = threading.Event()
    stop.set()
    with pytest.raises(CancelledError):
        model_fingerprint(ref, stop)
