"""What verify looks at: the checkpoint a target names, its config, the source model it came
from, and the fixed prompts both engines decode from."""

from __future__ import annotations

from pathlib import Path

from quantize.errors import ExportError, VerifyError
from quantize.model.config import ModelConfig, config_path, read_config
from quantize.run.manifest import MANIFEST, read_export_manifest

NAME = "verify"

# Fixed prompts: prose, code, a list, a question, a chat-like turn, digits. Short, so that a
# CPU run stays cheap; the tokens are scored in both engines from the same ids.
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Here are three tips for staying healthy:\n1.",
    "Q: Why is the sky blue?\nA:",
    "User: Write a haiku about the sea.\nAssistant:",
    "1, 2, 3, 5, 8, 13,",
)


def resolve_target(path: Path) -> tuple[Path, Path | None]:
    """A run folder (uses <run>/export, writes <run>/verify) or a checkpoint folder."""
    path = Path(path)
    if config_path(path / "export").is_file():
        return path / "export", path
    if config_path(path).is_file():
        return path, None
    raise VerifyError(path=path, path_sep=" ",
                      problem="is neither a run folder (with export/) nor a checkpoint folder "
                              "(with config.json)",
                      hint="give `runs/<name>` or an export folder")


def checkpoint_config(ckpt: Path) -> ModelConfig:
    """config.json of a checkpoint that has weights to verify."""
    if not list(ckpt.glob("*.safetensors")):
        raise VerifyError(path=ckpt, path_sep=" ", problem="has no *.safetensors weights",
                          hint="re-run the export")
    return read_config(ckpt)


def source_model(ckpt: Path) -> Path | None:
    """The unquantized model the export came from, from the export's manifest."""
    path = ckpt / MANIFEST
    if not path.is_file():
        return None
    try:
        model = read_export_manifest(path).model
    except ExportError:
        return None
    p = Path(model.path) if model is not None and model.path else None
    return p if p is not None and config_path(p).is_file() else None


def prompt_ids(ckpt: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    return [list(tok(p)["input_ids"]) for p in PROMPTS]
