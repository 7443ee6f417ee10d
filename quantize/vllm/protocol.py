"""The vLLM worker's requests and answers (quantize/vllm/worker.py), typed at this edge: a
request is built as a model and sent as its JSON (only the keys that were set, in field
order, as the request files in logs/ always had them); an answer is parsed once, here, into
the fields the stages read, keeping the rest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from quantize.run.results import Record, Scalar
from quantize.vllm import host as vhost


class WorkerRequest(Record):
    """What every op takes to build the engine (worker._engine)."""

    op: str
    model: str

    def model_post_init(self, context: Any, /) -> None:
        self.__pydantic_fields_set__.add("op")  # the worker dispatches on it: always sent


class ScoreGroup(Record):
    name: str
    sequences: list[list[int]]
    score_from: list[int]


class ScoreRequest(WorkerRequest):
    op: str = "score"
    groups: list[ScoreGroup]
    tp: int
    kv_cache_dtype: str
    max_model_len: int
    enforce_eager: bool
    dtype: str | None = None
    kv_cache_space_gib: int | None = None
    kv_cache_gib: float | None = None  # GPU: a fixed KV cache and a memory share to match


class GenerateRequest(WorkerRequest):
    op: str = "generate"
    prompts: list[list[int]]
    max_tokens: int
    logprobs: int
    tp: int | None = None
    kv_cache_dtype: str | None = None
    max_model_len: int
    enforce_eager: bool
    dtype: str | None = None
    kv_cache_space_gib: int | None = None
    kv_cache_gib: float | None = None


class WorkerAnswer(Record):
    """Any worker answer: ok, or the error and where the log is."""

    ok: bool = False
    error: str | None = None
    error_type: str | None = None
    log: str | None = None
    vllm_version: str | None = None
    quantization: str | None = None
    dtype: str | None = None
    load_s: float | None = None
    engine_args: dict[str, Scalar] | None = None
    engine: dict[str, Any] | None = None  # what vLLM reported once started (serving.facts)


class ScoredSequence(Record):
    logprobs: list[float]
    ranks: list[int]


class ScoredGroup(Record):
    outputs: list[ScoredSequence]
    seconds: float
    tokens: int | None = None


class LayerKernel(Record):
    count: int
    example: str


# {"linear"|"attention": {kernel: {count, example}}}, or {"error": why} when vLLM's modules
# could not be inspected
Kernels = dict[str, dict[str, LayerKernel] | str]


def kernel_counts(layers: Kernels | None) -> dict[str, int]:
    """How many layers each kernel runs ("Method/Scheme/Kernel" -> count, linear layers and
    attention), from a worker answer's `layers`; empty when vLLM could not be inspected."""
    out: dict[str, int] = {}
    for table in ("linear", "attention"):
        rows = (layers or {}).get(table)
        if isinstance(rows, dict):
            out.update({key: row.count for key, row in rows.items()})
    return out


class ScoreAnswer(WorkerAnswer):
    groups: list[ScoredGroup] = Field(default_factory=list)
    kv_cache_dtype: str | None = None
    layers: Kernels | None = None


class Step(Record):
    token: int
    logprob: float
    top: dict[str, float] = Field(default_factory=dict)


class Generated(Record):
    token_ids: list[int]
    steps: list[Step] = Field(default_factory=list)


class GenerateAnswer(WorkerAnswer):
    outputs: list[Generated] = Field(default_factory=list)
    generate_s: float | None = None
    layers: Kernels | None = None


# The KV cache a check sizes vLLM with: on a CPU the backend's space (VLLM_CPU_KVCACHE_SPACE,
# GiB), on a GPU a fixed cache and a memory share just large enough for the model beside it
# (quantize/vllm/serving.py), so a check neither takes 90 % of the card nor fails on a GPU
# that other processes share.
CHECK_KV_GIB = {"cpu": 1, "cuda": 4}


def size_kv(req: ScoreRequest | GenerateRequest, device: str) -> None:
    """Give a check's request its KV-cache size for the device vLLM runs on."""
    if device == "cpu":
        req.kv_cache_space_gib = CHECK_KV_GIB["cpu"]
    else:
        req.kv_cache_gib = CHECK_KV_GIB["cuda"]


def score(python: Path, req: ScoreRequest, workdir: Path, name: str, timeout_s: float
          ) -> ScoreAnswer:
    return ScoreAnswer.model_validate(vhost.run_worker(python, req.to_json(), workdir, name,
                                                       timeout_s))


def generate(python: Path, req: GenerateRequest, workdir: Path, name: str, timeout_s: float
             ) -> GenerateAnswer:
    return GenerateAnswer.model_validate(vhost.run_worker(python, req.to_json(), workdir, name,
                                                          timeout_s))
