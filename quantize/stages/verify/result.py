"""What verify finds, typed: verify.json (the summary), the two levels' measurements and the
manifest's record of the stage. Built field by field by the levels; written with exactly
the keys that were set (quantize.run.results.Record), so verify.json keeps its shape."""

from __future__ import annotations

from pydantic import Field

from quantize.run.results import Record, Scalar
from quantize.vllm.protocol import LayerKernel


class ServeDtype(Record):
    """The --dtype this host needs to serve the export (quantize.vllm.support.DtypeNeed)."""

    flag: str
    dtype: str
    declared: str | None = None
    why: str


class VllmLoadInfo(Record):
    """How vLLM loaded the checkpoint (from the worker's answer)."""

    vllm_version: str | None = None
    quantization: str | None = None
    dtype: str | None = None
    layers: dict[str, dict[str, LayerKernel] | str] | None = None
    load_s: float | None = None
    generate_s: float | None = None
    engine_args: dict[str, Scalar] | None = None


class Tie(Record):
    """A step where vLLM and transformers pick different tokens, not a near-tie."""

    prompt: int
    step: int
    vllm_token: int
    hf_token: int
    gap_nats: float


class AgreementMetrics(Record):
    """The vllm level: vLLM's greedy tokens against transformers' scores (in this order in
    verify.md)."""

    steps: int
    agreement: float
    mean_abs_dlogprob: float
    max_abs_dlogprob: float
    greedy_prefix_match: list[int]
    prompts_fully_matching: int
    non_tie_disagreements: list[Tie]
    failures: list[str] = Field(default_factory=list)


class DecodeMetrics(Record):
    """The decode level: the loader's decode against ours, and against the source model."""

    layers_decoded: int
    worst_weight_rel_diff: float
    worst_weight_layer: str
    mean_abs_dlogprob: float
    max_abs_dlogprob: float
    source_model: str | None
    source_cosine_min: float | None
    source_cosine_layer: str
    source_cosine_floor: float
    weight_bits: int
    failures: list[str] = Field(default_factory=list)


class LevelResult(Record):
    """What a level adds to the summary."""

    serve_command: str | None = None
    verdict: str = "fail"
    error: str | None = None
    vllm_log: str | None = None
    vllm: VllmLoadInfo | None = None
    metrics: AgreementMetrics | DecodeMetrics | None = None
    thresholds: dict[str, float] | None = None
    tolerance: dict[str, float | list[tuple[int, float]]] | None = None
    reference_s: float | None = None
    samples: list[str] | None = None


class VerifySummary(LevelResult):
    """verify.json (and, with `out`, what `quantize verify` prints)."""

    checkpoint: str = ""
    format: str = "?"
    host: str = "?"
    tp: int = 1
    kv_cache_dtype: str = "auto"
    export_manifest_sha256: str | None = None
    level: str = "?"
    rules_said: str | None = None
    serve_dtype: ServeDtype | None = None
    why_not_vllm: str | None = None
    host_limit: str | None = None
    passed: bool = False
    result: str = ""
    duration_s: float = 0.0
    out: str | None = None  # where verify.json is (not in the file)

    def add(self, level: LevelResult) -> None:
        for name in level.model_fields_set:
            setattr(self, name, getattr(level, name))

    def brief(self) -> VerifyBrief:
        """The manifest's record of a verify run (verify.json holds the rest)."""
        return VerifyBrief(verdict=self.verdict, passed=self.passed, level=self.level,
                           format=self.format, result=self.result,
                           duration_s=self.duration_s)


class VerifyBrief(Record):
    verdict: str | None
    passed: bool | None
    level: str | None
    format: str | None
    result: str | None
    duration_s: float | None
