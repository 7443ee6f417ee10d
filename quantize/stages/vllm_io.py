"""The vLLM worker's requests and answers (quantize/vllm/worker.py), typed at this edge: a
request is built as a model and sent as its JSON (only the keys that were set, in field
order, as the request files in logs/ always had them); an answer is parsed once, here, into
the fields the stages read, keeping the rest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from quantize.stages.results import Record, Scalar
from quantize.vllm import host as vhost


class EngineRequest(Record):
    """What every op takes to build the engine (worker._engine)."""

    op: str
    model: str

    def model_post_init(self, context: Any, /) -> None:
        self.__pydantic_fields_set__.add("op")  # the worker dispatches on it: always sent


class ScoreGroup(Record):
    name: str
    sequences: list[list[int]]
    score_from: list[int]


class ScoreRequest(EngineRequest):
    op: str = "score"
    groups: list[ScoreGroup]
    tp: int
    kv_cache_dtype: str
    max_model_len: int
    enforce_eager: bool
    dtype: str | None = None
    kv_cache_space_gib: int | None = None


class GenerateRequest(EngineRequest):
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


class Answer(Record):
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


class ScoredSequence(Record):
    logprobs: list[float]
    ranks: list[int]


class ScoredGroup(Record):
    outputs: list[ScoredSequence]
    seconds: float
    tokens: int | None = None


class ScoreAnswer(Answer):
    groups: list[ScoredGroup] = Field(default_factory=list)
    kv_cache_dtype: str | None = None


class Step(Record):
    token: int
    logprob: float
    top: dict[str, float] = Field(default_factory=dict)


class Generated(Record):
    token_ids: list[int]
    steps: list[Step] = Field(default_factory=list)


class LayerKernel(Record):
    count: int
    example: str


class GenerateAnswer(Answer):
    outputs: list[Generated] = Field(default_factory=list)
    generate_s: float | None = None
    # {"linear"|"attention": {kernel: {count, example}}}, or {"error": why} when vLLM's
    # modules could not be inspected
    layers: dict[str, dict[str, LayerKernel] | str] | None = None


def score(python: Path, req: ScoreRequest, workdir: Path, name: str, timeout_s: float
          ) -> ScoreAnswer:
    return ScoreAnswer.model_validate(vhost.run_worker(python, req.to_json(), workdir, name,
                                                       timeout_s))


def generate(python: Path, req: GenerateRequest, workdir: Path, name: str, timeout_s: float
             ) -> GenerateAnswer:
    return GenerateAnswer.model_validate(vhost.run_worker(python, req.to_json(), workdir, name,
                                                          timeout_s))
