"""What a model card is built from, typed: the base model, the run's facts and its results.

The result files (eval.json, gate.json, verify.json) stay the JSON their stages wrote, since
they are shipped verbatim next to the card; the card reads them through the small views
here (`CardMetric`, `GateView`, `VerifyView`, `Calibration`), so a key is looked up in one
place and the template sees attributes, not dict lookups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from quantize.model.config import ModelConfig
from quantize.model.qconfig import QuantConfig, read_quant_config
from quantize.recipe.metric_kinds import METRIC_KINDS
from quantize.recipe.recipe import Recipe

Json = dict[str, Any]  # a result file as its stage wrote it


@dataclass(frozen=True)
class BaseInfo:
    """What is known about the model the run started from."""

    name: str  # short name, used for the default repo name
    source: str  # what the run was given (`default`, a Hub id, a folder name)
    repo_id: str | None  # Hub id, for `base_model`; None when unknown
    license: str | None = None
    license_name: str | None = None
    license_link: str | None = None
    weights_bytes: int | None = None  # safetensors on disk
    dtype: str | None = None  # torch dtype of the base weights (config.json)
    note: str = ""  # provenance caveat shown under the eval table


@dataclass(frozen=True)
class Calibration:
    """The calibration summary the export recorded (what calibrate wrote)."""

    fingerprint: Any
    num_samples: Any
    seq_len: Any
    tokens: Any
    spec_name: str
    source: str  # "builtin `wiki`", "Hub dataset `org/name`", "file `x.txt`" or "?"
    description: str

    @classmethod
    def read(cls, summary: Json | None) -> Calibration | None:
        if not summary:
            return None
        spec = summary.get("spec") or {}
        source = (f"builtin `{spec['builtin']}`" if spec.get("builtin") else
                  f"Hub dataset `{spec['hub']}`" if spec.get("hub") else
                  f"file `{Path(str(spec.get('path'))).name}`" if spec.get("path") else "?")
        return cls(summary.get("fingerprint"), summary.get("num_samples"),
                   summary.get("seq_len"), summary.get("tokens"), str(spec.get("name", "?")),
                   source, str(spec.get("description") or "no description"))


@dataclass(frozen=True)
class CardInputs:
    repo_id: str
    run: str
    base: BaseInfo
    recipe: Recipe
    recipe_text: str
    config: ModelConfig  # the export's config.json
    calibration: Calibration | None
    versions: dict[str, str]
    group_size: int | None  # pre-flight facts of the run
    layers: int | None
    weights_bytes: int
    has_chat_template: bool
    eval: Json | None = None
    gate: Json | None = None
    verify: Json | None = None
    forced: bool = False
    force_reason: str = ""
    extra_files: list[str] = field(default_factory=list)  # provenance files in the repo

    @cached_property
    def quant(self) -> QuantConfig | None:
        """The export's quantization block, typed (quantize.model.qconfig)."""
        return read_quant_config(self.config)

    @property
    def native(self) -> bool:
        """A native GPTQ/AWQ checkpoint (GPTQModel, AutoAWQ), not compressed-tensors."""
        return self.quant is not None and self.quant.native

    @cached_property
    def consumers(self) -> list[Any]:
        """The consumers this run checked, with what was measured (card/consumers.py)."""
        from quantize.report.card.consumers import consumer_lines

        return consumer_lines(self.gate, self.verify, self.recipe.advertised_consumers)

    def checked(self, consumer: str) -> bool:
        from quantize.report.card.consumers import checked

        return checked(self.consumers, consumer)

    @property
    def kv_cache_bits(self) -> int | None:
        """Bits per KV-cache element the checkpoint stores scales for (None: not quantized)."""
        kv = self.quant.kv_cache if self.quant else None
        return kv.num_bits if kv and kv.num_bits else None


# --- views of the result files ------------------------------------------------------------
def _pct(v: Any) -> str:
    return f"{float(v):.1%}"


@dataclass(frozen=True)
class CardMetric:
    """One eval.json metric joined with the gate's verdict on it (the gate's values win)."""

    row: Json

    @classmethod
    def join(cls, ev: Json | None, gate: Json | None) -> list[CardMetric]:
        verdicts = {r["name"]: r for r in (gate or {}).get("rows", [])}
        out = []
        for r in (ev or {}).get("metrics", []):
            if r.get("kind") == "consumer_agreement":  # its own table (card/consumers.py)
                continue
            joined, g = dict(r), verdicts.get(r["name"], {})
            for k in ("threshold", "verdict", "note", "recovery"):
                if g.get(k) is not None:
                    joined[k] = g[k]
            out.append(cls(joined))
        return out

    @property
    def name(self) -> str:
        return str(self.row["name"])

    @property
    def accuracy(self) -> bool:
        """Whether the value reads as a share (accuracy, answer flips)."""
        r = self.row
        kind = METRIC_KINDS.get(r.get("kind") or "")
        return kind.percent if kind is not None else (
            r.get("kind") is None and r.get("direction") == "higher_is_better")

    @property
    def unit(self) -> str:
        if self.row.get("kind") == "expert_coverage":  # MoE: 1.0 = every expert sound
            return "MoE experts"
        kind = METRIC_KINDS.get(self.row.get("kind") or "")
        if kind is not None:
            return kind.unit or kind.name
        return "accuracy" if self.accuracy else "perplexity"

    @property
    def settings(self) -> Json:
        return self.row.get("settings") or {}

    @property
    def candidate(self) -> float:
        return float(self.row["candidate"])

    def _value(self, key: str) -> str:
        v, se = self.row.get(key), self.row.get(f"{key}_stderr")
        text = "-" if v is None else f"{v:.1%}" if self.accuracy else f"{v:.4g}"
        if se:
            text += f" ± {se * 100:.1f}" if self.accuracy else f" ± {se:.2g}"
        return text

    @property
    def cells(self) -> list[str]:
        """The eval table's cells: metric, n, baseline, this model, recovery, threshold,
        verdict."""
        r = self.row
        verdict = f"{r.get('verdict', '-')}{' (advisory)' if r.get('on_fail') == 'warn' else ''}"
        return [f"{self.name} ({self.unit})", str(r.get("n", "-")), self._value("baseline"),
                self._value("candidate"), _pct(r["recovery"]), _pct(r["threshold"]), verdict]

    @property
    def note(self) -> str:
        if self.row.get("kind") == "expert_coverage" and self.row.get("details"):
            from quantize.run.results import MetricRow as Row
            from quantize.run.results import expert_coverage_lines  # the eval report words

            return " ".join(expert_coverage_lines(Row.model_validate(self.row)))
        return str(self.row.get("note") or "")


@dataclass(frozen=True)
class GateView:
    verdict: str  # upper case
    failures: list[str]
    warnings: list[str]

    @classmethod
    def read(cls, gate: Json | None) -> GateView | None:
        if gate is None:
            return None
        return cls(str(gate.get("verdict", "?")).upper(),
                   [str(f) for f in gate.get("failures") or []],
                   [str(w) for w in gate.get("warnings") or []])


def kernel_names(kernels: dict[str, int]) -> str:
    """"MarlinLinearKernel x90, MacheteLinearKernel x30": each kernel class with its layers
    (the last part of the worker's "Method/Scheme/Kernel" key; attention backends as is)."""
    short: dict[str, int] = {}
    for key, n in kernels.items():
        parts = key.split("/")
        name = parts[0] if "kv_cache_dtype=" in key else parts[-1]
        short[name] = short.get(name, 0) + n
    return ", ".join(f"{k} x{n}" for k, n in sorted(short.items(), key=lambda kv: -kv[1]))


_VERIFY_FIELDS = (("result", "result"), ("why_not_vllm", "vLLM check skipped"),
                  ("format", "format"), ("kv_cache_dtype", "KV cache dtype"),
                  ("tp", "tensor parallel"), ("host", "host"))
_VERIFY_HIDDEN = {key for key, _ in _VERIFY_FIELDS} | {"level", "passed", "verdict",
                                                       "checkpoint", "out"}
_VERIFY_HOW = {"vllm": " (loaded and decoded in vLLM, compared with transformers)",
               "decode": " (decoded independently of the loader and compared; vLLM could not "
                         "run on the verifying host)"}


@dataclass(frozen=True)
class VerifyView:
    level: str
    how: str  # what the level checked, as a parenthesis (or "")
    status: str  # passed | FAILED
    rows: list[tuple[str, Any]]  # the facts table

    @classmethod
    def read(cls, v: Json | None) -> VerifyView | None:
        if v is None:
            return None
        rows: list[tuple[str, Any]] = [
            (label, v[key]) for key, label in _VERIFY_FIELDS
            if isinstance(v.get(key), (str, int, float)) and v.get(key) != ""]
        # other scalar facts a verify result may carry (but never local paths)
        rows += [(k, val) for k, val in sorted(v.items())
                 if k not in _VERIFY_HIDDEN and isinstance(val, (int, float, str))
                 and not isinstance(val, bool) and not str(val).startswith(("/", "~"))]
        vllm = v.get("vllm") or {}
        kernels = {key: row.get("count", 0)
                   for table in ("linear", "attention")
                   for key, row in ((vllm.get("layers") or {}).get(table) or {}).items()
                   if isinstance(row, dict)}
        if kernels:  # the kernels vLLM ran the check on
            rows.append((f"vLLM {vllm.get('vllm_version', '')} kernels", kernel_names(kernels)))
        return cls(str(v.get("level", "?")), _VERIFY_HOW.get(str(v.get("level")), ""),
                   "passed" if v.get("passed") else "FAILED", rows)
