"""The real-client check: simple factual questions asked through vLLM's own engine, as a user
of `vllm serve` would (the model's chat template, greedy decoding), counted right or wrong.

Perplexity and multiple-choice accuracy score log-likelihoods; this check reads what the
model *says*. The questions live in eval/questions/factual.yaml; an answer is right when one of its
accepted answers appears in the generated text as a whole word (case-insensitive). Each
checkpoint runs in a fresh vLLM process in the separate vLLM environment, with the `--dtype`
this host needs for it (quantize.vllm.support.serving_dtype).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from quantize.errors import QuantizeError, VerifyError
from quantize.model.config import read_config
from quantize.recipe.paths import PROJECT_ROOT
from quantize.recipe.yamlio import parse_model, read_text
from quantize.vllm import host as vhost
from quantize.vllm import protocol as vllm_io
from quantize.vllm import support

QUESTIONS = PROJECT_ROOT / "eval" / "questions" / "factual.yaml"  # not a suite: own folder
MAX_TOKENS = 32
TIMEOUT_S = 900.0


class Question(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    q: str = Field(min_length=1)
    a: list[str] = Field(min_length=1)


class QuestionSet(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    questions: list[Question] = Field(min_length=1)


@dataclass(frozen=True)
class Answer:
    question: str
    text: str
    right: bool


@dataclass(frozen=True)
class AnswerSheet:
    checkpoint: str
    right: int
    total: int
    answers: list[Answer]
    dtype: str | None  # the --dtype it was served with (None: vLLM's auto)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> AnswerSheet:
        d = json.loads(text)
        d["answers"] = [Answer(**a) for a in d["answers"]]
        return cls(**d)


def load_questions(path: Path = QUESTIONS) -> QuestionSet:
    qs: QuestionSet = parse_model(QuestionSet, read_text(path), str(path))
    return qs


def is_right(text: str, accepted: list[str]) -> bool:
    low = text.lower()
    return any(re.search(rf"(?<![\w]){re.escape(a.lower())}(?![\w])", low) for a in accepted)


def prompt_ids(checkpoint: Path, questions: QuestionSet) -> tuple[list[list[int]], Any]:
    """Each question through the checkpoint's chat template (as `vllm serve`'s chat endpoint
    applies it), as token ids; and the tokenizer, to read the answers back."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    ids = []
    for q in questions.questions:
        enc: Any = tok.apply_chat_template([{"role": "user", "content": q.q}],
                                           add_generation_prompt=True, tokenize=True,
                                           return_dict=True)
        ids.append(list(enc["input_ids"]))
    return ids, tok


def ask(checkpoint: Path, workdir: Path, host: vhost.Host,
        questions: QuestionSet | None = None) -> AnswerSheet:
    """Load `checkpoint` in vLLM, answer every question greedily, and score the answers."""
    if host.vllm_python is None:
        raise VerifyError(problem=f"the question check needs vLLM: {host.problem}")
    qs = questions or load_questions()
    prompts, tok = prompt_ids(checkpoint, qs)
    need = support.serving_dtype(support.checkpoint_format(read_config(checkpoint)),
                                 host.device)
    dtype = need.dtype if need is not None else None
    req = vllm_io.GenerateRequest(model=str(checkpoint.resolve()), prompts=prompts,
                                  max_tokens=MAX_TOKENS, logprobs=1, max_model_len=512,
                                  enforce_eager=True)
    vllm_io.size_kv(req, host.device)
    if dtype is not None:
        req.dtype = dtype
    res = vllm_io.generate(Path(host.vllm_python), req, workdir, "answers", TIMEOUT_S)
    if not res.ok:
        raise QuantizeError(problem=f"vLLM could not answer with {checkpoint}: {res.error}")
    eos = getattr(tok, "eos_token_id", None)
    answers = []
    for q, out in zip(qs.questions, res.outputs, strict=True):
        ids = out.token_ids
        if eos in ids:  # the worker decodes past EOS (ignore_eos); a client stops there
            ids = ids[:ids.index(eos)]
        text = tok.decode(ids, skip_special_tokens=True).strip()
        answers.append(Answer(q.q, text, is_right(text, q.a)))
    return AnswerSheet(str(checkpoint), sum(a.right for a in answers), len(answers), answers,
                       dtype)
