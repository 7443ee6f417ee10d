"""config.json typed (quantize.model.config.ModelConfig) and the one writer of its quantization
block (quantize.model.qconfig.with_quant_config): what is read is given back exactly, so
exports stay byte-identical; a mistyped field is one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantize.errors import ModelError
from quantize.model.config import ModelConfig, read_config, write_config
from quantize.model.qconfig import (
    raw_quant_config,
    read_quant_config,
    with_quant_config,
    without_quant_config,
)

CONFIGS = Path(__file__).resolve().parents[3] / "quantize" / "data" / "model_configs"
GPTQ = {"bits": 4, "group_size": 128, "sym": True, "desc_act": False, "quant_method": "gptq",
        "checkpoint_format": "gptq", "meta": {"quantizer": ["gptqmodel:7.6.0"]},
        "damp_percent": 0.05}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.json")), ids=lambda p: p.stem)
def test_shipped_configs_round_trip_exactly(path: Path) -> None:
    raw = json.loads(path.read_text())
    assert ModelConfig.model_validate(raw).to_json() == raw


def test_read_then_write_is_byte_identical(tmp_path: Path) -> None:
    raw = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
           "num_key_value_heads": None, "rope_scaling": {"type": "linear", "factor": 2.0},
           "torch_dtype": "bfloat16", "_name_or_path": "x", "text_config": {"head_dim": 8}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    write_config(tmp_path, read_config(tmp_path))
    assert (tmp_path / "config.json").read_text() == \
        json.dumps(raw, indent=2, sort_keys=True) + "\n"


def test_the_writer_declares_dtype_and_the_engines_block_as_before(tmp_path: Path) -> None:
    source = {"model_type": "llama", "torch_dtype": "float32", "hidden_size": 64}
    written = with_quant_config(ModelConfig.model_validate(source), GPTQ, "bfloat16")
    write_config(tmp_path, written)
    before = dict(source)  # what backends/_native.finish wrote before the typed config
    before.pop("torch_dtype", None)
    before.update({"dtype": "bfloat16", "quantization_config": GPTQ})
    assert (tmp_path / "config.json").read_text() == \
        json.dumps(before, indent=2, sort_keys=True) + "\n"
    assert raw_quant_config(written) == GPTQ
    qc = read_quant_config(written)
    assert qc is not None and qc.method == "gptq" and qc.weight_bits == 4
    assert without_quant_config(written).to_json() == {"model_type": "llama",
                                                       "hidden_size": 64, "dtype": "bfloat16"}


def test_a_mistyped_field_is_kept_and_reads_as_absent(tmp_path: Path) -> None:
    # refusing it here would change which check names the problem (transformers does, in
    # pre-flight: tests/integration/test_bad_inputs.py config-wrong-types)
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": "two"}))
    cfg = read_config(tmp_path)
    assert cfg.num_hidden_layers is None and cfg.to_json() == {"num_hidden_layers": "two"}


def test_a_missing_or_broken_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ModelError) as err:
        read_config(tmp_path)
    assert (err.value.path, err.value.problem) == (str(tmp_path), "has no config.json")
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ModelError) as err:
        read_config(tmp_path)
    assert (err.value.path, err.value.problem) == (str(tmp_path / "config.json"),
                                                   "expected a JSON object")


def test_text_config_is_the_language_part() -> None:
    cfg = ModelConfig.model_validate({"model_type": "llava", "text_config": {
        "model_type": "llama", "num_hidden_layers": 3}})
    assert cfg.text.num_hidden_layers == 3
    assert ModelConfig.model_validate({"num_hidden_layers": 2, "text_config": {}}).text \
        .num_hidden_layers == 2


def test_a_mistyped_quantization_key_is_one_line_naming_it() -> None:
    from quantize.errors import QuantizeError
    from quantize.model.qconfig import parse

    with pytest.raises(QuantizeError) as err:
        parse({"quant_method": "gptq", "bits": "four"})
    assert err.value.problem is not None and err.value.problem.startswith(
        "config.json quantization_config.bits: ")
    assert err.value.hint is not None and err.value.hint.startswith("this project reads")
    with pytest.raises(QuantizeError) as err:
        parse({"quant_method": "bitsandbytes", "bits": "four"})  # the method is named first
    assert err.value.problem == "quantization_config.quant_method is 'bitsandbytes'"
