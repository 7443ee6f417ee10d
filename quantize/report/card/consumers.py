"""The card's "Where it loads" table and which snippets it shows: only the consumers this
run checked (the eval's agreement rows as the gate judged them, vLLM from `quantize
verify`), each with what was measured (quantize/recipe/consumers.py, metrics/consumers.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantize.recipe.consumers import CONSUMERS, row_name

Json = dict[str, Any]


@dataclass(frozen=True)
class ConsumerLine:
    name: str
    label: str
    result: str  # "agrees", "DISAGREES", "cannot load", "not checked"
    measured: str  # KL, top-1 and perplexity against the reference, or what was checked
    passed: bool


def _agreement(row: Json) -> tuple[str, str, bool]:
    s = row.get("settings") or {}
    if "load_error" in s:
        return "cannot load", str(s["load_error"]), False
    passed = row.get("verdict") == "pass"
    nan = float("nan")
    return ("agrees" if passed else "DISAGREES",
            f"KL {s.get('kl', nan):.2g} nats, top-1 {s.get('top1_agreement', 0):.1%}, "
            f"perplexity {s.get('ppl', nan):.4g} (reference {s.get('reference_ppl', nan):.4g}) "
            f"on {row.get('n', '?')} eval tokens", passed)


def consumer_lines(gate: Json | None, verify: Json | None,
                   advertised: tuple[str, ...]) -> list[ConsumerLine]:
    """One line per advertised consumer (and any other this run measured), in table order."""
    rows = {r.get("name"): r for r in (gate or {}).get("rows", [])
            if r.get("kind") == "consumer_agreement"}
    out = []
    for name, c in CONSUMERS.items():
        row = rows.get(row_name(name))
        if name == "vllm" and verify is not None and verify.get("level") == "vllm":
            passed = bool(verify.get("passed"))
            out.append(ConsumerLine(name, c.label, "agrees" if passed else "DISAGREES",
                                    str(verify.get("result") or "loaded and decoded in vLLM"),
                                    passed))
        elif row is not None:
            out.append(ConsumerLine(name, c.label, *_agreement(row)))
        elif name in advertised:
            out.append(ConsumerLine(name, c.label, "not checked", "this run did not load it "
                                    "there" + (" (`quantize verify`)" if name == "vllm" else ""),
                                    False))
    return out


def checked(lines: list[ConsumerLine], name: str) -> bool:
    """Whether this run loaded the export in `name` and it agreed with the reference."""
    return any(line.name == name and line.passed for line in lines)
