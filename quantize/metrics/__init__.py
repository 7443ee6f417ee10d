"""The measurements behind `eval`: strided perplexity (our own loop) and multiple-choice
accuracy through lm-eval. Both keep per-window / per-example values so the gate can compare
baseline and candidate *paired* on the same data."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

from quantize.errors import EvalError, first_line
from quantize.model.nll import window_nll
from quantize.recipe.metric_kinds import (
    LongPerplexitySpec,
    MultipleChoiceSpec,
    PerplexitySpec,
    TextMetric,
)
from quantize.recipe.paths import DATA_DIR
from quantize.recipe.texts import BUILTIN_EVAL_TEXT, hub_texts
from quantize.run.results import Score, Settings

# one table of shipped texts; `novel`: a whole novel, for long-context windows (data/README.md)
BIGBENCH_DIR = DATA_DIR / "bigbench"


# --- perplexity -------------------------------------------------------------------------
def eval_text(spec: TextMetric) -> str:
    if spec.builtin is not None:
        return BUILTIN_EVAL_TEXT[spec.builtin].read_text(encoding="utf-8")
    if spec.path is not None:
        p = Path(spec.path)
        if not p.is_file():
            raise EvalError(problem=f"metric {spec.name}: text file {p} does not exist",
                            hint="fix `path`")
        try:
            return p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise EvalError(problem=f"metric {spec.name}: {p} is not UTF-8",
                            hint="convert it") from None
    assert spec.hub is not None
    texts = hub_texts(spec.hub, spec.subset, spec.split, spec.text_field, EvalError,
                      f"use `builtin: wiki-eval` offline (metric {spec.name})")
    return "\n\n".join(texts)


def windows(n_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, n_scored) per window; the scored tokens are the window's last n_scored.

    A window scores only tokens no earlier window scored, each with as much context as the
    window holds (the standard strided evaluation). A window's first token has no context
    inside it, so with stride == seq_len (disjoint windows) it is not scored.
    """
    out = []
    prev_end = 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + seq_len, n_tokens)
        scored = min(end - prev_end, end - begin - 1)
        if scored > 0:
            out.append((begin, end, scored))
        prev_end = end
        if end == n_tokens:
            break
    return out


def tail_windows(n_tokens: int, seq_len: int, score_from: int) -> list[tuple[int, int, int]]:
    """long_perplexity: disjoint full windows of seq_len tokens, each scoring its tokens at
    positions >= score_from (each has at least score_from tokens of context)."""
    return [(b, b + seq_len, seq_len - score_from)
            for b in range(0, n_tokens - seq_len + 1, seq_len)]


def token_windows(tokenizer: Any, spec: TextMetric) -> tuple[list[int], list[tuple[int, int, int]]]:
    """The token ids and (begin, end, n_scored) windows a text metric scores: the same for
    every engine (the vLLM engine sends these windows to vLLM). Disjoint windows unless the
    metric has a stride; long_perplexity's score their tail."""
    text = eval_text(spec)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: spec.max_tokens]
    if len(ids) < spec.seq_len:
        raise EvalError(problem=f"metric {spec.name}: text has {len(ids)} tokens, fewer than "
                                f"seq_len {spec.seq_len}",
                        hint="use more text or a shorter seq_len")
    if isinstance(spec, LongPerplexitySpec):
        return ids, tail_windows(len(ids), spec.seq_len, score_from(spec))
    return ids, windows(len(ids), spec.seq_len, stride(spec))


def stride(spec: TextMetric) -> int:
    """A text metric's window stride: its own, else disjoint windows."""
    own = spec.stride if isinstance(spec, PerplexitySpec) else None
    return own or spec.seq_len


def score_from(spec: LongPerplexitySpec) -> int:
    return spec.score_from or spec.seq_len // 2


def perplexity_result(spec: TextMetric, wins: list[tuple[int, int, int]],
                      nll_sums: list[float], seconds: float) -> Score:
    """The metric's result from each window's summed NLL over its scored tokens."""
    counts = [scored for _, _, scored in wins]
    total = sum(counts)
    mean_nll = sum(nll_sums) / total
    settings: Settings = {"seq_len": spec.seq_len, "tokens": total}
    if isinstance(spec, LongPerplexitySpec):
        settings.update({"score_from": score_from(spec), "windows": len(wins)})
    else:
        settings["stride"] = stride(spec)
    return Score(
        value=math.exp(mean_nll),
        mean_nll=mean_nll,
        per_window_nll=[s / c for s, c in zip(nll_sums, counts, strict=True)],
        window_tokens=counts,
        n=total,
        tokens_per_s=round(sum(e - b for b, e, _ in wins) / seconds, 1),
        seconds=round(seconds, 2),
        settings=settings,
    )


def perplexity(model: Any, tokenizer: Any, spec: TextMetric, batch_size: int) -> Score:
    """Token-level perplexity: exp(mean NLL per predicted token) over the first max_tokens
    tokens of the text (token perplexity, not lm-eval's word perplexity)."""
    import torch

    ids, wins = token_windows(tokenizer, spec)
    all_ids = torch.tensor(ids, dtype=torch.long)
    t0 = time.perf_counter()
    # batched windows without full logits or per-window host syncs; long_perplexity's
    # windows one at a time (an 8k window's activations are the memory to watch)
    nll_sums = window_nll(model, all_ids, wins,
                          1 if isinstance(spec, LongPerplexitySpec) else batch_size)
    return perplexity_result(spec, wins, nll_sums, time.perf_counter() - t0)


# --- multiple choice via lm-eval ----------------------------------------------------------
class ChoiceDoc(TypedDict):
    """One multiple-choice example as lm-eval's task YAML reads it (a JSONL line)."""

    text: str
    choices: list[str]
    gold: int


def _bigbench_docs(task: str) -> list[ChoiceDoc]:
    path = BIGBENCH_DIR / f"{task}.json"
    if not path.is_file():
        known = sorted(p.stem for p in BIGBENCH_DIR.glob("*.json"))
        raise EvalError(problem=f"no shipped BIG-bench task {task!r}", hint=f"shipped: {known}")
    data = json.loads(path.read_text(encoding="utf-8"))
    prefix = data.get("task_prefix", "")
    in_prefix = data.get("example_input_prefix", "\nQ: ")
    out_prefix = data.get("example_output_prefix", "\nA: ")
    docs = []
    for ex in data["examples"]:
        choices = list(ex["target_scores"])
        gold = max(range(len(choices)), key=lambda i: ex["target_scores"][choices[i]])
        # The prompt ends without trailing space: lm-eval adds " " before each choice, so
        # the space belongs to the continuation (as the model saw it in training).
        text = (prefix + in_prefix + ex["input"] + out_prefix).lstrip("\n").rstrip()
        docs.append(ChoiceDoc(text=text, choices=choices, gold=gold))
    return docs


def _task_yaml(name: str, data_file: Path) -> str:
    return "\n".join([
        f"task: {name}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {json.dumps(str(data_file))}",
        "test_split: test",
        "output_type: multiple_choice",
        'doc_to_text: "{{text}}"',
        'doc_to_choice: "{{choices}}"',
        'doc_to_target: "{{gold}}"',
        'target_delimiter: " "',
        "metric_list:",
        "  - metric: acc",
        "    aggregation: mean",
        "    higher_is_better: true",
        "",
    ])


def _prepare_task(spec: MultipleChoiceSpec, workdir: Path) -> tuple[str, Path | None]:
    """lm-eval task name, and an include dir for shipped tasks (None for lm-eval's own)."""
    if not spec.task.startswith("bigbench:"):
        return spec.task, None
    task = spec.task.split(":", 1)[1]
    docs = _bigbench_docs(task)[: spec.limit]
    name = f"quantize_bigbench_{task}"
    tdir = workdir / name
    tdir.mkdir(parents=True, exist_ok=True)
    data = tdir / "test.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    (tdir / f"{name}.yaml").write_text(_task_yaml(name, data), encoding="utf-8")
    return name, tdir


# (sequence, score_from) -> per-token (log-probability, rank) from score_from on
TokenScorer = Callable[[list[list[int]], list[int]], list[tuple[list[float], list[int]]]]


def token_lm(tokenizer: Any, scorer: TokenScorer, max_length: int) -> Any:
    """An lm-eval model whose log-likelihoods come from `scorer` (the vLLM engine's prompt
    log-probabilities). lm-eval's TemplateLM turns each (context, choice) into token ids as
    HFLM does (trailing context spaces moved to the choice, whole string encoded then split;
    BOS/EOS as the context of an empty one); `_loglikelihood_tokens` then sums the choice's
    log-probabilities over HFLM's window (the last max_length + 1 tokens), and a choice is
    greedy when each of its tokens has rank 1: HFLM's arithmetic, another engine's numbers."""
    from lm_eval.api.model import TemplateLM

    class TokenLM(TemplateLM):
        backend = "causal"

        def __init__(self) -> None:
            super().__init__()
            self.tokenizer = tokenizer

        @property
        def eot_token_id(self) -> int:
            return int(tokenizer.eos_token_id)

        @property
        def prefix_token_id(self) -> int:  # HFLM's: BOS when the tokenizer has one
            bos = tokenizer.bos_token_id
            return int(bos if bos is not None else tokenizer.eos_token_id)

        def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                       **kwargs: Any) -> list[int]:
            kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
            if add_special_tokens is None and tokenizer.bos_token and string.startswith(
                    tokenizer.bos_token):
                kw["add_special_tokens"] = False
            return list(tokenizer.encode(string, **kw))

        def _loglikelihood_tokens(self, requests: list[Any], **kwargs: Any
                                  ) -> list[tuple[float, bool]]:
            seqs, starts = [], []
            for _, ctx, cont in requests:
                seq = (ctx + cont)[-(max_length + 1):]
                seqs.append(seq)
                starts.append(len(seq) - len(cont))
            out = []
            for lps, ranks in scorer(seqs, starts):
                out.append((float(sum(lps)), all(r == 1 for r in ranks)))
            return out

        def loglikelihood_rolling(self, requests: Any, disable_tqdm: bool = False) -> Any:
            raise EvalError(problem="the vLLM engine scores multiple-choice tasks only")

        def generate_until(self, requests: Any, disable_tqdm: bool = False) -> Any:
            raise EvalError(problem="the vLLM engine scores multiple-choice tasks only")

    return TokenLM()


def hf_lm(model: Any, tokenizer: Any, batch_size: int) -> Any:
    """lm-eval's HFLM on the loaded model; for a model quantize.model.choice packs, its
    log-likelihoods come from the packed loop (each context read once, the head on the
    scored positions only). Requests, tokenization and the metric stay HFLM's."""
    from lm_eval.models.huggingface import HFLM

    from quantize.model.choice import packable, packed_loglikelihoods

    if not packable(model):
        return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)

    class PackedHFLM(HFLM):
        scoring = "packed contexts"  # eval.json says which loop scored the task

        def _loglikelihood_tokens(self, requests: list[Any], disable_tqdm: bool = False,
                                  override_bs: int | None = None) -> list[tuple[float, bool]]:
            # HFLM cuts a sequence longer than max_length + 1 from the left: those go its way
            fits = [len(ctx) + len(cont) <= self.max_length + 1 for _, ctx, cont in requests]
            packed = iter(packed_loglikelihoods(
                self.model, [(r[1], r[2]) for r, ok in zip(requests, fits, strict=True) if ok],
                batch_size))
            rest = [r for r, ok in zip(requests, fits, strict=True) if not ok]
            cut = iter(super()._loglikelihood_tokens(rest, disable_tqdm, override_bs)
                       if rest else [])
            return [next(packed) if ok else next(cut) for ok in fits]

    return PackedHFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)


def multiple_choice(model: Any, tokenizer: Any, spec: MultipleChoiceSpec, batch_size: int,
                    workdir: Path, lm: Any = None) -> Score:
    """Accuracy through lm-eval: `model` via HFLM (hf_lm), or `lm` (a token_lm) when given."""
    import logging

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    task, include = _prepare_task(spec, workdir)
    # a shipped task needs only its own folder indexed, not lm-eval's thousands of task
    # YAMLs (seconds per metric)
    manager = TaskManager(include_path=str(include), include_defaults=False) if include \
        else TaskManager()
    if lm is None:
        lm = hf_lm(model, tokenizer, batch_size)
    t0 = time.perf_counter()
    try:
        out = simple_evaluate(model=lm, tasks=[task], task_manager=manager,
                              num_fewshot=spec.num_fewshot,
                              limit=None if include else spec.limit, log_samples=True,
                              bootstrap_iters=0)
    except Exception as exc:  # lm-eval raises bare exceptions for unknown tasks, offline...
        first = first_line(exc)
        raise EvalError(problem=f"metric {spec.name}: lm-eval failed on task {spec.task!r}: "
                                f"{first}") from None
    if out is None or task not in out["results"]:
        raise EvalError(problem=f"metric {spec.name}: lm-eval returned no result for {task!r}")
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    per_example = [float(s["acc"]) for s in samples]
    chosen = [_chosen(s["filtered_resps"]) for s in samples]
    n = len(per_example)
    acc = sum(per_example) / n
    return Score(
        value=acc,
        stderr=math.sqrt(acc * (1 - acc) / max(n - 1, 1)),
        per_example=per_example,
        per_example_choice=chosen,
        n=n,
        seconds=round(time.perf_counter() - t0, 2),
        settings={"task": spec.task, "num_fewshot": spec.num_fewshot, "limit": spec.limit,
                  "scoring": getattr(lm, "scoring", "lm-eval")},
    )


def _chosen(responses: list[Any]) -> int:
    """The answer lm-eval's `acc` takes for one item: the first choice of highest
    log-likelihood (numpy's argmax over each choice's (log-likelihood, is_greedy))."""
    lls = [float(r[0]) for r in responses]
    return lls.index(max(lls))
