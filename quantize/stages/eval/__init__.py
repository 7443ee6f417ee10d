"""eval: measure the exported checkpoint (loaded fresh from disk, as users deploy it) and
the unquantized baseline on the same suite. The baseline's scores are cached per (model
fingerprint, suite, settings, versions, engine) and reused by every recipe run on that model.

Two engines score a suite (engine.py says which, and why): `hf` here (transformers + lm-eval
on a dense model), `vllm` in vllm_engine.py (a vLLM process per model, from prompt
log-probabilities over the same windows and lm-eval requests)."""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path
from typing import Any, TypedDict

from quantize.errors import EvalError, first_line
from quantize.metrics.coverage import expert_coverage
from quantize.model.config import ModelConfig, read_config, torch_dtype
from quantize.model.decode import load_dequantized
from quantize.model.formats import Format
from quantize.model.moe import load_linearized, transformers_load_problem
from quantize.model.qconfig import NATIVE_METHODS, quant_method
from quantize.progress import info, step
from quantize.recipe.metric_kinds import LongPerplexitySpec, PerplexitySpec
from quantize.recipe.recipe import FLAT_FIELDS, LATER_FIELDS, EvalSuite, MetricSpec, canonical_hash
from quantize.run.files import atomic_write_json, atomic_write_text, pause_point
from quantize.run.lock import entry_lock
from quantize.run.results import (
    BaselineRef,
    CandidateRef,
    CoverageBrief,
    EngineBrief,
    EngineInfo,
    EvalResult,
    EvalSummary,
    MetricBrief,
    MetricRow,
    Score,
    Scores,
    Throughput,
    Timing,
    VllmLoads,
    expert_coverage_lines,
)
from quantize.stages.eval.engine import EngineChoice, EngineKey
from quantize.textfmt import md_table

NAME = "eval"


class MeasuredSettings(TypedDict):
    """The suite's part of the eval stage key and of the baseline cache key (hashed as is)."""

    batch_size: int
    metrics: list[dict[str, Any]]  # each MetricSpec's own JSON (quantize.recipe.recipe)


def measured_settings(suite: EvalSuite) -> MeasuredSettings:
    """What changes the numbers (not the thresholds, which only the gate uses; not the
    suite's engine field, which the engine choice replaces). A field added later is left out
    while unset, so existing keys stay valid."""
    return {"batch_size": suite.batch_size, "metrics": [_settings(m) for m in suite.metrics]}


def _settings(m: MetricSpec) -> dict[str, Any]:
    """One metric's part: its fields as the flat model of earlier versions dumped them (the
    same keys, the same order), then its kind's own fields where not at their default."""
    own = m.model_dump(mode="json", exclude={"threshold", "on_fail"})
    later = {k: own.pop(k) for k in list(own) if k in LATER_FIELDS}
    head = {k: own.pop(k) for k in ("name", "kind", "direction")}
    flat = {k: own.pop(k, v) for k, v in FLAT_FIELDS.items()}
    out = {**head, **flat, **own}
    out.update({k: v for k, v in later.items() if v != LATER_FIELDS[k]})
    return out


# How the hf engine scores multiple-choice tasks (quantize.model.choice: each context read
# once). Part of the eval stage key and the baseline cache key: results from the earlier loop
# (one lm-eval sequence per choice; the same accuracies, log-likelihoods differing in rounding)
# are scored again, not mixed with these.
HF_CHOICE_SCORING = "packed-contexts"


def choice_scoring(suite: EvalSuite, choice: EngineChoice | None) -> str | None:
    """The hf engine's multiple-choice scoring marker for the keys; None where it plays no
    part (the vLLM engine, a suite without multiple-choice metrics)."""
    if (choice is not None and choice.name != "hf") or not any(
            m.kind == "multiple_choice" for m in suite.metrics):
        return None
    return HF_CHOICE_SCORING


def check_engine(suite: EvalSuite, choice: EngineChoice | None) -> None:
    """Refuse an engine that cannot score every metric of the suite, in one line."""
    if choice is not None and choice.name == "vllm":
        from quantize.metrics.kinds import vllm_problem

        if (why := vllm_problem(suite)) is not None:
            raise EvalError(problem=f"eval engine vllm ({choice.reason}): {why[0]}", hint=why[1])


def engine_key(choice: EngineChoice | None) -> EngineKey | None:
    """The engine's part of the eval stage key and the baseline cache key: None for hf (the
    keys of runs made before engines existed stay valid), the vLLM settings otherwise."""
    return None if choice is None or choice.name == "hf" else choice.key()


def load_model(path: Path, device: str) -> tuple[Any, Any]:
    import logging

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    # fp32 on CPU (16-bit matmuls there are slow and add their own error); 16-bit on GPU.
    dtype = torch.float32 if device == "cpu" else "auto"
    config = read_config(path)
    method = quant_method(config)
    try:
        if method in NATIVE_METHODS:
            model = dense_native(path, config, device)
        elif method == Format.COMPRESSED_TENSORS and transformers_load_problem(config):
            model = load_linearized(path, config).to(device)  # MoE: quantize/model/moe.py
        elif method == Format.COMPRESSED_TENSORS:
            model = load_dequantized(path, dtype=dtype, device_map=device)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device)
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, RuntimeError) as exc:
        first = first_line(exc)
        raise EvalError(problem=f"cannot load {path} for evaluation: {first}") from None
    model.eval()
    return model, tok


def dense_native(path: Path, config: ModelConfig, device: str) -> Any:
    """A native GPTQ/AWQ export (backend gptqmodel/autoawq) decoded once from its stored
    integers, zero points and scales into a dense model: fp32 on CPU, the same arithmetic as
    the compressed-tensors path, so engines compare on equal terms. Loaded as is through
    transformers, these checkpoints run GPTQModel's fused CPU kernels in bf16 with
    bf16-rounded scales (0.55% per weight, 0.17 nats on the default model's logits): an eval
    difference that would be the kernel's, not the engine's. `quantize verify` checks that
    this decode equals GPTQModel's own (bit for bit on the default model) and vLLM's output."""

    from quantize.model.decode import build_reference

    model, _ = build_reference(path, config)
    if device != "cpu":
        model = model.to(device=device, dtype=torch_dtype(config))
    return model


def evaluate(path: Path, suite: EvalSuite, device: str, label: str,
             baseline: Scores | None = None) -> Scores:
    """Every metric of the suite on the model at `path` (`baseline`: the baseline's scores
    when this is the candidate; the divergence kinds compare against them)."""
    from quantize.metrics.kinds import SCORERS, ScoreJob

    results = Scores()
    with step(f"loading {label} for evaluation"):
        model, tok = load_model(path, device)
    try:
        with tempfile.TemporaryDirectory(prefix="quantize-tasks-") as work:
            for spec in suite.metrics:
                scorer = SCORERS[spec.kind].hf
                if scorer is None:  # derived from other metrics' items (answer_flips)
                    continue
                with step(f"{label}: {spec.name}"):
                    r = scorer(ScoreJob(model, tok, spec, suite.batch_size, Path(work),
                                        baseline.metrics.get(spec.name) if baseline else None))
                results.metrics[spec.name] = r
                info(f"    {spec.name} = {r.value:.4g} (n={r.n}, {r.seconds}s)")
    finally:
        del model
        gc.collect()
    return results


def score(path: Path, suite: EvalSuite, device: str, label: str, engine: EvalEngine,
          baseline: Scores | None = None) -> Scores:
    """The suite on one model, by the chosen engine."""
    if engine.choice.name == "hf":
        return evaluate(path, suite, device, label, baseline)
    from quantize.stages.eval import vllm_engine

    kv = engine.choice.kv_cache_dtype if label == "candidate" else "auto"
    return vllm_engine.evaluate(path, suite, engine.choice, label, engine.logs,
                                dtype=engine.dtype, kv_cache_dtype=kv)


def baseline(model_path: Path, fingerprint: str, suite: EvalSuite, device: str,
             versions: dict[str, str], engine: EvalEngine) -> tuple[Scores, bool]:
    """The baseline's results, from the cache when the same model/suite/settings ran before."""
    from quantize.model.source import cache_root

    parts = {"model": fingerprint, "settings": measured_settings(suite), "device": device,
             "versions": versions}
    if (ek := engine_key(engine.choice)) is not None:
        parts["engine"] = {**ek, "dtype": engine.dtype}
    if (scoring := choice_scoring(suite, engine.choice)) is not None:
        parts["choice_scoring"] = scoring
    key = canonical_hash(parts)
    path = cache_root() / "baselines" / f"{key}.json"
    # one process measures an entry; another run of the same baseline waits, then reads it
    with entry_lock(path.parent / f".{path.name}.lock", what=f"measuring the baseline {key[:16]}"):
        if path.is_file():
            info(f"[dim]baseline scores from cache {path.name[:16]}[/dim]")
            return Scores.read(path), True
        results = score(model_path, suite, device, "baseline", engine)
        atomic_write_json(path, results.to_json())
    return results, False


def compare(suite: EvalSuite, base: Scores, cand: Scores) -> list[MetricRow]:
    """One row per metric: each kind pairs the two models' scores its own way
    (quantize.metrics.kinds), the gate reads recovery and noise from the kind's rule."""
    from quantize.metrics.kinds import SCORERS
    from quantize.recipe.metric_kinds import METRIC_KINDS, paired_se

    rows = []
    for spec in suite.metrics:
        p = SCORERS[spec.kind].pair(spec, suite, base, cand)
        b_se = base.metrics[spec.name].stderr if spec.name in base.metrics else None
        rows.append(MetricRow(
            name=spec.name, kind=spec.kind, direction=spec.direction,
            baseline=p.baseline, candidate=p.candidate,
            baseline_stderr=b_se if METRIC_KINDS[spec.kind].per_model else None,
            candidate_stderr=p.candidate_stderr,
            diff_se=(paired_se(p.base_items, p.cand_items)
                     if p.base_items is not None and p.cand_items is not None else None),
            recovery=METRIC_KINDS[spec.kind].recover(p.baseline, p.candidate),
            threshold=spec.threshold, on_fail=spec.on_fail, n=p.n,
            settings=p.settings,
        ))
    return rows


def markdown(result: EvalResult) -> str:
    lines = [f"# Eval: suite `{result.suite}`", "",
             f"Candidate `{result.candidate.path}` vs baseline "
             f"`{result.baseline.path}` on {result.device}, scored by "
             f"{_engine_line(result.engine)}.", "",
             *md_table(("metric", "n", "baseline", "candidate", "recovery", "threshold"),
                       [(r.name, r.n, f"{r.baseline:.4g}", f"{r.candidate:.4g}" + (
                           f" ± {r.candidate_stderr:.3f}" if r.candidate_stderr else ""),
                         f"{r.recovery:.2%}", f"{r.threshold:.2%}") for r in result.metrics],
                       right=(1, 2, 3, 4, 5))]
    for r in result.metrics:
        if r.name == "expert_coverage":  # MoE exports (quantize/metrics/coverage.py)
            lines += ["", *expert_coverage_lines(r)]
    for name, tp in result.throughput.items():
        lines.append(f"\n{name}: {tp.engine} forward throughput baseline "
                     f"{tp.baseline_tokens_per_s} tokens/s, candidate "
                     f"{tp.candidate_tokens_per_s} tokens/s.")
    t = result.timing
    lines += ["", f"Eval time: baseline {t.baseline_s} s "
              f"({'cached' if result.baseline.cached else 'measured'}), "
              f"candidate {t.candidate_s} s."]
    return "\n".join(lines) + "\n"


def _moe_rows(export: Path) -> list[MetricRow]:
    row = expert_coverage(export)
    return [row] if row is not None else []


def _engine_line(engine: EngineInfo | None) -> str:
    if engine is None or engine.name == "hf":
        return "transformers" + (f" ({engine.reason})" if engine else "")
    return (f"vLLM {engine.vllm_version or ''} (tp {engine.tp}, candidate KV cache "
            f"{engine.kv_cache_dtype}; {engine.reason})")


def _strip(results: Scores) -> dict[str, Score]:
    """Per-item lists stay in the baseline cache; eval.json keeps summaries."""
    return {k: r.summary() for k, r in results.metrics.items()}


class EvalEngine:
    """The chosen engine with what scoring needs: where worker logs go and the --dtype vLLM
    serves both models at (the candidate's need on this host, e.g. bf16 for INT8 on CPU)."""

    def __init__(self, choice: EngineChoice | None, logs: Path, dtype: str | None = None):
        self.choice = choice or EngineChoice("hf", "hf", "the default engine")
        self.logs = logs
        self.dtype = dtype


def serving_dtype(candidate: Path, choice: EngineChoice | None) -> str | None:
    if choice is None or choice.name != "vllm":
        return None
    from quantize.vllm import support

    fmt = support.checkpoint_format(read_config(candidate))
    need = support.serving_dtype(fmt, choice.device)
    if need:
        return need.dtype
    # On CPU, bfloat16 for both models: vLLM's CPU backend has no oneDNN float16 matmul on
    # CPUs without AVX-512-FP16/AMX and falls back to torch's float16 linear ("Failed to
    # create oneDNN linear"), many times slower; bf16 is the CPU backend's native dtype.
    return "bfloat16" if choice.device == "cpu" else None


def consumer_rows(candidate: Path, device: str, consumers: list[str],
                  trust_remote_code: bool = False) -> list[MetricRow]:
    """The export loaded as each consumer loads it, against the reference decode the suite
    was scored on (quantize/metrics/consumers.py): one agreement row per consumer."""
    if not consumers:
        return []
    from quantize.metrics import consumers as agreement

    with step(f"loading the export as {', '.join(consumers)} do"):
        model, tok = load_model(candidate, device)
        try:
            reference = agreement.ReferenceLogits(model, tok)
        finally:
            del model
            gc.collect()
        rows = agreement.check(candidate, reference, consumers, device, trust_remote_code)
    for r in rows:
        s = r.settings
        info(f"    {r.name}: " + (f"KL {s['kl']:.2g}, top-1 {s['top1_agreement']:.1%}"
                                   if "kl" in s else f"cannot load ({s['load_error']})"))
    return rows


def run(candidate: Path, base_path: Path, fingerprint: str, suite: EvalSuite, device: str,
        versions: dict[str, str], out: Path, choice: EngineChoice | None = None,
        consumers: list[str] | None = None, trust_remote_code: bool = False
        ) -> EvalSummary:
    check_engine(suite, choice)  # before anything is read
    engine = EvalEngine(choice, out / "logs", serving_dtype(candidate, choice))
    c = engine.choice
    info(f"eval engine: {c.name} ({c.reason})")
    t0 = time.perf_counter()
    base, cached = baseline(base_path, fingerprint, suite, device, versions, engine)
    pause_point("eval:baseline")  # tests kill the run between baseline and candidate
    t1 = time.perf_counter()
    cand = score(candidate, suite, device, "candidate", engine, base)
    agree = consumer_rows(candidate, device, consumers or [], trust_remote_code)
    t2 = time.perf_counter()
    engine_info = EngineInfo(
        name=c.name, requested=c.requested, reason=c.reason, tp=c.tp,
        kv_cache_dtype=c.kv_cache_dtype, vllm_version=c.vllm_version, device=c.device,
        serve_dtype=engine.dtype,
        vllm=VllmLoads(baseline=base.vllm, candidate=cand.vllm) if c.name == "vllm" else None)
    result = EvalResult(
        suite=suite.name, suite_sha256=canonical_hash(suite), device=device,
        engine=engine_info, throughput=throughput(suite, base, cand, c.name),
        baseline=BaselineRef(path=str(base_path), fingerprint=fingerprint, cached=cached,
                             results=_strip(base)),
        candidate=CandidateRef(path=str(candidate), results=_strip(cand)),
        metrics=compare(suite, base, cand) + _moe_rows(candidate) + agree,
        timing=Timing(baseline_s=round(t1 - t0, 1), candidate_s=round(t2 - t1, 1)),
    )
    atomic_write_json(out / "eval.json", result.to_json())
    atomic_write_text(out / "eval.md", markdown(result))
    moe = next((CoverageBrief(coverage=r.details.coverage, problems=r.details.problems,
                              experts_checked=r.details.experts_checked,
                              all_zero_scales=r.details.all_zero_scales)
                for r in result.metrics
                if r.name == "expert_coverage" and r.details is not None), None)
    summary = EvalSummary(
        metrics={r.name: MetricBrief(baseline=r.baseline, candidate=r.candidate,
                                     recovery=r.recovery) for r in result.metrics},
        engine=EngineBrief(name=c.name, requested=c.requested, reason=c.reason, tp=c.tp,
                           kv_cache_dtype=c.kv_cache_dtype))
    if c.name == "vllm":
        summary.engine.vllm_version = c.vllm_version
        summary.engine.device = c.device
        if cand.vllm is not None and cand.vllm.kernels:
            summary.engine.kernels = cand.vllm.kernels
    if moe is not None:  # the manifest's copy
        summary.expert_coverage = moe
    return summary


def throughput(suite: EvalSuite, base: Scores, cand: Scores, engine: str
               ) -> dict[str, Throughput]:
    """Tokens/s of the engine on each perplexity metric's windows (forward passes only)."""
    out = {}
    for spec in suite.metrics:
        if isinstance(spec, (PerplexitySpec, LongPerplexitySpec)):
            out[spec.name] = Throughput(
                engine=engine, baseline_tokens_per_s=base.metrics[spec.name].tokens_per_s,
                candidate_tokens_per_s=cand.metrics[spec.name].tokens_per_s)
    return out
