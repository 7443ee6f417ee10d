"""The vLLM engine of eval: one vLLM process (the worker's `score` op, in the vLLM
environment) per model scores every metric of the suite from prompt log-probabilities.

- perplexity / long_perplexity: the same token windows as the hf engine
  (quantize.metrics.token_windows); a window's NLL is minus the sum of its scored tokens'
  log-probabilities; the same result fields (quantize.metrics.perplexity_result).
- multiple choice: lm-eval builds the requests as for the hf engine and a TemplateLM
  (quantize.metrics.token_lm) turns them into token ids the way HFLM does. lm-eval asks for
  all log-likelihoods of a task at once, and vLLM runs in another process, so each task is
  run twice: a first pass records the token sequences (answering zeros), vLLM scores them
  with everything else in one process, and a second pass answers from those scores.

Each metric is one timed group in the worker, so `tokens_per_s` is vLLM's on those windows.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from quantize.errors import EvalError
from quantize.metrics.kinds import SCORERS, vllm_problem
from quantize.progress import info, step
from quantize.recipe.metric_kinds import MultipleChoiceSpec, TextMetric
from quantize.recipe.recipe import EvalSuite
from quantize.run.results import Score, Scores, VllmLoad
from quantize.stages.eval.engine import EngineChoice
from quantize.vllm.protocol import ScoreGroup, ScoreRequest, kernel_counts, score, size_kv

TIMEOUT_S = 3600
Key = tuple[tuple[int, ...], int]
Window = tuple[int, int, int]  # begin, end, tokens scored (quantize.metrics.windows)


def _windows(tok: Any, spec: TextMetric) -> tuple[list[list[int]], list[int], list[Window]]:
    from quantize import metrics

    ids, wins = metrics.token_windows(tok, spec)
    return [ids[b:e] for b, e, _ in wins], [e - b - s for b, e, s in wins], wins


def _collect(tok: Any, spec: MultipleChoiceSpec, max_length: int, work: Path) -> list[Key]:
    """The (sequence, score_from) pairs lm-eval will ask about for this task."""
    from quantize import metrics

    seen: list[Key] = []

    def record(seqs: list[list[int]], starts: list[int]) -> list[tuple[list[float], list[int]]]:
        seen.extend((tuple(s), st) for s, st in zip(seqs, starts, strict=True))
        return [([0.0], [1]) for _ in seqs]

    metrics.multiple_choice(None, tok, spec, 1, work, lm=metrics.token_lm(tok, record,
                                                                           max_length))
    return list(dict.fromkeys(seen))


def request(model: Path, choice: EngineChoice, groups: list[ScoreGroup],
            dtype: str | None, kv_cache_dtype: str) -> ScoreRequest:
    """The worker's score request (one per model)."""
    longest = max((len(s) for g in groups for s in g.sequences), default=16)
    req = ScoreRequest(model=str(model.resolve()), groups=groups, tp=choice.tp,
                       kv_cache_dtype=kv_cache_dtype, max_model_len=longest,
                       enforce_eager=True)
    if dtype:
        req.dtype = dtype
    size_kv(req, choice.device)
    return req


def evaluate(path: Path, suite: EvalSuite, choice: EngineChoice, label: str, workdir: Path,
             *, dtype: str | None = None, kv_cache_dtype: str = "auto") -> Scores:
    """Every metric of the suite on the model at `path`, scored by vLLM."""
    import tempfile

    from transformers import AutoTokenizer

    from quantize import metrics
    from quantize.model.config import read_config

    assert choice.vllm_python is not None
    tok = AutoTokenizer.from_pretrained(path)
    max_length = int(read_config(path).max_position_embeddings or 2048)
    groups: list[ScoreGroup] = []
    asked: dict[str, list[Key]] = {}  # multiple choice: what lm-eval asks
    windows: dict[str, list[Window]] = {}  # perplexity kinds
    # each kind's path in vLLM (quantize.metrics.kinds); derived kinds are paired later
    scored = [m for m in suite.metrics if SCORERS[m.kind].vllm != "derived"]
    if (why := vllm_problem(suite)) is not None:
        raise EvalError(problem=f"--engine vllm: {why[0]}", hint=why[1])
    with tempfile.TemporaryDirectory(prefix="quantize-tasks-") as tmp:
        work = Path(tmp)
        for spec in scored:
            if isinstance(spec, MultipleChoiceSpec):  # the "choices" path
                keys = _collect(tok, spec, max_length, work / "collect")
                seqs, starts = [list(k[0]) for k in keys], [k[1] for k in keys]
                asked[spec.name] = keys
            else:  # the "windows" path
                assert isinstance(spec, TextMetric)
                seqs, starts, wins = _windows(tok, spec)
                if max(len(s) for s in seqs) > max_length:
                    raise EvalError(problem=f"metric {spec.name}: seq_len {spec.seq_len} "
                                            f"exceeds the model's {max_length} positions",
                                    hint="use a shorter seq_len")
                windows[spec.name] = wins
            groups.append(ScoreGroup(name=spec.name, sequences=seqs, score_from=starts))
        req = request(path, choice, groups, dtype, kv_cache_dtype)
        with step(f"{label}: scoring {sum(len(g.sequences) for g in groups)} sequences "
                  f"in vLLM (tp {choice.tp}, kv cache {kv_cache_dtype})"):
            res = score(Path(choice.vllm_python), req, workdir, label, TIMEOUT_S)
        if not res.ok:
            raise EvalError(problem=f"vLLM could not score the {label} ({path}): {res.error} "
                                    f"(log: {res.log})", hint="use --engine hf")
        results = Scores()
        for spec, group in zip(scored, res.groups, strict=True):
            outs = [(o.logprobs, o.ranks) for o in group.outputs]
            if isinstance(spec, MultipleChoiceSpec):
                r = _replay(tok, spec, max_length, asked[spec.name], outs, work / "replay")
            else:
                assert isinstance(spec, TextMetric)
                nll = [-sum(lps) for lps, _ in outs]
                r = metrics.perplexity_result(spec, windows[spec.name], nll, group.seconds)
            r.seconds = group.seconds  # vLLM's time on this metric's sequences
            results.metrics[spec.name] = r
            info(f"    {spec.name} = {r.value:.4g} (n={r.n}, vLLM {group.seconds}s)")
    results.vllm = VllmLoad(vllm_version=res.vllm_version, quantization=res.quantization,
                            dtype=res.dtype, kv_cache_dtype=res.kv_cache_dtype,
                            load_s=res.load_s, engine_args=res.engine_args,
                            kernels=kernel_counts(res.layers) or None)
    return results


def _replay(tok: Any, spec: MultipleChoiceSpec, max_length: int, keys: list[Key],
            outs: list[tuple[list[float], list[int]]], work: Path) -> Score:
    from quantize import metrics

    table = dict(zip(keys, outs, strict=True))

    def answer(seqs: list[list[int]], starts: list[int]) -> list[tuple[list[float], list[int]]]:
        try:
            return [table[(tuple(s), st)] for s, st in zip(seqs, starts, strict=True)]
        except KeyError:
            raise EvalError(problem=f"metric {spec.name}: lm-eval asked for a sequence it did "
                                    "not ask for in the first pass (a non-deterministic task?)") \
                from None

    t0 = time.perf_counter()
    r = metrics.multiple_choice(None, tok, spec, 1, work,
                                lm=metrics.token_lm(tok, answer, max_length))
    r.seconds = round(time.perf_counter() - t0, 2)
    return r
