"""Round-trip proof of a conversion: the per-tensor numbers (max-abs, cosine of each output
tensor against the source's own dequantized value) summarised, and a logits smoke test that
loads the source and the output in transformers on one fixed token sequence and reports the
KL divergence and top-1 agreement of their next-token distributions. A side transformers
cannot load here (e.g. fp8 kernels that need a GPU) is skipped with its reason, never
silently."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quantize.convert.produced import TensorCheck
from quantize.errors import first_line

SMOKE_TOKENS = 32


@dataclass(frozen=True)
class TensorSummary:
    tensors: int
    worst_max_abs: float
    worst_max_abs_tensor: str | None
    min_cosine: float
    min_cosine_tensor: str | None


def summarise(checks: list[TensorCheck]) -> TensorSummary:
    if not checks:
        return TensorSummary(0, 0.0, None, 1.0, None)
    worst = max(checks, key=lambda c: c.max_abs)
    low = min(checks, key=lambda c: c.cosine)
    return TensorSummary(len(checks), worst.max_abs, worst.target, low.cosine, low.target)


@dataclass(frozen=True)
class Smoke:
    """The logits test's outcome: `skipped` holds the reason when it could not run."""

    kl: float | None = None
    top1: float | None = None
    tokens: int = 0
    skipped: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _load(folder: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    if folder.is_file() and folder.suffix == ".gguf":  # transformers' own GGUF dequantizer
        model = AutoModelForCausalLM.from_pretrained(folder.parent, gguf_file=folder.name,
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                     device_map="cpu")
    return model.eval()


def _ids(vocab: int, n: int = SMOKE_TOKENS) -> Any:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, max(vocab, 1), (1, n), generator=g)


def logits_smoke(source: Path, output: Path) -> Smoke:
    """KL(source || output) averaged over positions, and top-1 agreement, on fixed ids."""
    import torch

    try:
        ref = _load(source)
    except Exception as exc:
        return Smoke(skipped=f"source does not load in transformers here: {first_line(exc)}")
    ids = _ids(int(ref.config.get_text_config().vocab_size))
    with torch.no_grad():
        a = ref(ids).logits.float()
    del ref
    try:
        out = _load(output)
    except Exception as exc:
        return Smoke(skipped=f"output does not load in transformers: {first_line(exc)}")
    with torch.no_grad():
        b = out(ids).logits.float()
    return compare_logits(a, b)


def compare_logits(a: Any, b: Any) -> Smoke:
    import torch

    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    kl = float((la.exp() * (la - lb)).sum(-1).mean())
    top1 = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    return Smoke(max(kl, 0.0), top1, int(a.shape[1]))
