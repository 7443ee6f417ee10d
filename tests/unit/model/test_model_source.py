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
