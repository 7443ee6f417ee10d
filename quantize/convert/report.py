"""convert_report.json and convert_report.md in the output folder: formats, tensors, the
round-trip numbers, the preservation rows and the measured time and peak memory, so the
proof travels with the converted model (and the card can quote it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantize.convert.preserve import PreservationRow
from quantize.convert.roundtrip import Smoke, TensorSummary
from quantize.run.files import atomic_write_json, atomic_write_text

REPORT_JSON = "convert_report.json"
REPORT_MD = "convert_report.md"


@dataclass
class ConvertReport:
    source: str
    source_format: str
    target_format: str
    output: str
    tensors: TensorSummary
    smoke: Smoke
    preservation: list[PreservationRow]
    dropped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    largest_group_bytes: int = 0
    resumed_shards: int = 0

    @property
    def preserved(self) -> bool:
        return all(r.ok for r in self.preservation)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["preserved"] = self.preserved
        return data


def write_report(folder: Path, report: ConvertReport) -> None:
    atomic_write_json(folder / REPORT_JSON, report.to_json())
    atomic_write_text(folder / REPORT_MD, markdown(report))


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def markdown(r: ConvertReport) -> str:
    t, s = r.tensors, r.smoke
    smoke = (f"skipped: {s.skipped}" if s.skipped else
             f"KL {s.kl:.3g} nats, top-1 agreement {100 * (s.top1 or 0):.1f} % over "
             f"{s.tokens} tokens")
    lines = [f"# Conversion report: {r.source_format} -> {r.target_format}", "",
             f"- source: `{r.source}`", f"- output: `{r.output}`",
             f"- tensors checked: {t.tensors}; worst max-abs {t.worst_max_abs:.3g} "
             f"(`{t.worst_max_abs_tensor}`), lowest cosine {t.min_cosine:.6f} "
             f"(`{t.min_cosine_tensor}`)",
             f"- logits smoke test (transformers): {smoke}",
             f"- time {r.seconds:.1f} s, peak RSS {_gib(r.peak_rss_bytes)}, largest tensor "
             f"group {_gib(r.largest_group_bytes)}"
             + (f", {r.resumed_shards} shard(s) resumed" if r.resumed_shards else ""),
             "", "| preserved | ok | detail |", "|---|---|---|"]
    lines += [f"| {row.check} | {'yes' if row.ok else '**NO**'} | {row.detail} |"
              for row in r.preservation]
    if r.dropped:
        lines += ["", "Not carried over (by design):", ""]
        reasons: dict[str, int] = {}
        for why in r.dropped.values():
            reasons[why] = reasons.get(why, 0) + 1
        lines += [f"- {n} tensor(s): {why}" for why, n in sorted(reasons.items())]
    if r.notes:
        lines += ["", *[f"- {n}" for n in r.notes]]
    return "\n".join(lines) + "\n"
