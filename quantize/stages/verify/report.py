"""verify's words: the one-sentence result (the model card shows it) and verify.md."""

from __future__ import annotations

from quantize.stages.verify.result import AgreementMetrics, DecodeMetrics, VerifySummary
from quantize.textfmt import md_table


def one_line(s: VerifySummary) -> str:
    """The result in one sentence (the model card shows it)."""
    m = s.metrics
    if s.error:
        return str(s.error)
    if s.level == "vllm":
        v = s.vllm
        agree = m if isinstance(m, AgreementMetrics) else None
        return (f"vLLM {v.vllm_version if v else None} loaded it "
                f"({v.quantization if v else None}, {v.dtype if v else None}); greedy "
                f"agreement with transformers {agree.agreement if agree else 0:.1%} over "
                f"{agree.steps if agree else None} steps, mean |Δlogprob| "
                f"{agree.mean_abs_dlogprob if agree else None} nats")
    dec = m if isinstance(m, DecodeMetrics) else None
    return (f"not loadable in this host's vLLM; decoded independently of the loader: "
            f"max weight difference {dec.worst_weight_rel_diff if dec else None} (relative), "
            f"max |Δlogprob| {dec.max_abs_dlogprob if dec else None}; worst layer's cosine "
            f"with the source weights {dec.source_cosine_min if dec else None}")


def dtype_note(s: VerifySummary) -> str | None:
    """The `--dtype` a user must pass to serve this export on the verifying host, and why;
    None when vLLM's auto dtype (the checkpoint's own) runs it."""
    need = s.serve_dtype
    if need is None:
        return None
    return f"{need.why}: serve it with {need.flag}"


def render(s: VerifySummary) -> str:
    """verify.md: the verdict, the level and why, the numbers, how to serve it."""
    lines = [f"# verify: {s.verdict.upper()} ({s.level} level)", "",
             f"- checkpoint: `{s.checkpoint}`", f"- format: {s.format}",
             f"- host: {s.host}"]
    if s.why_not_vllm:
        lines.append(f"- vLLM check skipped: {s.why_not_vllm}")
    if s.error:
        lines.append(f"- error: {s.error}")
    if note := dtype_note(s):
        lines.append(f"- dtype: {note}")
    v = s.vllm
    if v:
        lines.append(f"- vLLM {v.vllm_version}: quantization `{v.quantization}`, "
                     f"dtype {v.dtype}, load {v.load_s} s, "
                     f"generate {v.generate_s} s")
        for kind in ("linear", "attention"):
            kernels = (v.layers or {}).get(kind)
            for key, e in (kernels.items() if isinstance(kernels, dict) else ()):
                lines.append(f"  - {kind}: `{key}` × {e.count} (e.g. {e.example})")
    m = s.metrics.to_json() if s.metrics is not None else {}
    if m:
        lines += ["", *md_table(("metric", "value"), [
            (k, val) for k, val in m.items() if k not in ("failures", "non_tie_disagreements")])]
    if s.serve_command:
        lines += ["", "Reproduce the load:", "", "```", s.serve_command, "```"]
    return "\n".join(lines) + "\n"
