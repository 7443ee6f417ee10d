"""verify's words: the one-sentence result (the model card shows it) and verify.md."""

from __future__ import annotations

from typing import Any


def one_line(s: dict[str, Any]) -> str:
    """The result in one sentence (the model card shows it)."""
    m = s.get("metrics") or {}
    if s.get("error"):
        return str(s["error"])
    if s["level"] == "vllm":
        v = s.get("vllm") or {}
        return (f"vLLM {v.get('vllm_version')} loaded it ({v.get('quantization')}, "
                f"{v.get('dtype')}); greedy agreement with transformers "
                f"{m.get('agreement', 0):.1%} over {m.get('steps')} steps, mean |Δlogprob| "
                f"{m.get('mean_abs_dlogprob')} nats")
    return (f"not loadable in this host's vLLM; decoded independently of the loader: "
            f"max weight difference {m.get('worst_weight_rel_diff')} (relative), max "
            f"|Δlogprob| {m.get('max_abs_dlogprob')}; worst layer's cosine with the source "
            f"weights {m.get('source_cosine_min')}")


def dtype_note(s: dict[str, Any]) -> str | None:
    """The `--dtype` a user must pass to serve this export on the verifying host, and why;
    None when vLLM's auto dtype (the checkpoint's own) runs it."""
    need = s.get("serve_dtype")
    if not isinstance(need, dict):
        return None
    return f"{need.get('why')}: serve it with {need.get('flag')}"


def render(s: dict[str, Any]) -> str:
    """verify.md: the verdict, the level and why, the numbers, how to serve it."""
    lines = [f"# verify: {s['verdict'].upper()} ({s['level']} level)", "",
             f"- checkpoint: `{s['checkpoint']}`", f"- format: {s['format']}",
             f"- host: {s['host']}"]
    if s.get("why_not_vllm"):
        lines.append(f"- vLLM check skipped: {s['why_not_vllm']}")
    if s.get("error"):
        lines.append(f"- error: {s['error']}")
    if note := dtype_note(s):
        lines.append(f"- dtype: {note}")
    v = s.get("vllm") or {}
    if v:
        lines.append(f"- vLLM {v.get('vllm_version')}: quantization `{v.get('quantization')}`, "
                     f"dtype {v.get('dtype')}, load {v.get('load_s')} s, "
                     f"generate {v.get('generate_s')} s")
        for kind in ("linear", "attention"):
            for key, e in ((v.get("layers") or {}).get(kind) or {}).items():
                if isinstance(e, dict):
                    lines.append(f"  - {kind}: `{key}` × {e['count']} (e.g. {e['example']})")
    m = s.get("metrics") or {}
    if m:
        lines += ["", "| metric | value |", "| --- | --- |"]
        lines += [f"| {k} | {val} |" for k, val in m.items()
                  if k not in ("failures", "non_tie_disagreements")]
    if s.get("serve_command"):
        lines += ["", "Reproduce the load:", "", "```", s["serve_command"], "```"]
    return "\n".join(lines) + "\n"
