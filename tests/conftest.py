"""Shared fixtures. Tests run offline: any socket connection outside loopback fails."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_real_connect = socket.socket.connect


def _loopback_only(self: socket.socket, address: object) -> None:
    host = address[0] if isinstance(address, tuple) else None
    if host is not None:
        try:
            ok = ipaddress.ip_address(host).is_loopback
        except ValueError:
            ok = host == "localhost"
        if not ok:
            raise OSError(f"tests may not reach the network ({host}); only loopback")
    _real_connect(self, address)  # type: ignore[arg-type]


socket.socket.connect = _loopback_only  # type: ignore[method-assign]


@pytest.fixture(scope="session", autouse=True)
def quantize_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache per test session (the default model is converted into it once).
    QUANTIZE_TEST_CACHE reuses a cache across sessions when set (local iteration)."""
    path = Path(os.environ.get("QUANTIZE_TEST_CACHE") or tmp_path_factory.mktemp("cache"))
    os.environ["QUANTIZE_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def default_model(quantize_cache: Path) -> Path:
    """The real pretrained default model (SmolLM2-135M-Instruct) as a bf16 folder."""
    from quantize.model.source import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def default_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the default model's tokenizer (the one the conversion writes), read from
    the GGUF's metadata in about a second: for tests that need the real tokenizer and not the
    model (tests/fixtures/tokenizer.py)."""
    from fixtures.tokenizer import save_default_tokenizer

    return save_default_tokenizer(tmp_path_factory.mktemp("default-tokenizer"))


@pytest.fixture(scope="session")
def tiny_model(default_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (2 layers, hidden 128) with the default model's tokenizer:
    real mechanics in seconds. Quality claims use the real default model instead."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    tok = AutoTokenizer.from_pretrained(default_tokenizer)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, dtype=torch.float16)
    model = LlamaForCausalLM(cfg).to(torch.float16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture
def recipe_file(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Write YAML text to a recipe file named after its `name:` (or x.yaml)."""

    def write(text: str, name: str = "x") -> Path:
        p = tmp_path / f"{name}.yaml"
        p.write_text(text)
        return p

    return write
