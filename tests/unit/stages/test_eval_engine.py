"""eval's engines: auto's rules, the refusals before loading, and the vLLM engine's scoring
arithmetic with vLLM faked by an in-process scorer (the real vLLM: tests/integration/
test_eval_vllm.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from quantize.errors import EvalError
from quantize.recipe.recipe import EvalSuite, parse_metric
from quantize.stages.eval import engine as E
from quantize.vllm.host import Host

GB = 2**30
CPU_HOST = Host("/fake/python", "0.32.0", "cpu", {"avx512": True}, {"cpu_gemm_wna16": True})
NO_VLLM = Host(None, problem="no vLLM environment: run `make vllm-env`, or pass --vllm-python")


# --- auto's rules ---------------------------------------------------------------------------
def test_auto_picks_vllm_for_a_quantized_kv_cache() -> None:
    name, why = E.auto_rule(True, 1 * GB, 10 * GB, None)
    assert name == "vllm" and "KV cache" in why


def test_auto_falls_back_to_hf_for_kv_without_vllm_and_says_so() -> None:
    name, why = E.auto_rule(True, 1 * GB, 10 * GB, "no vLLM environment")
    assert name == "hf" and "no vLLM environment" in why and "fake-quantized" in why


def test_auto_picks_vllm_when_the_dense_model_does_not_fit() -> None:
    name, why = E.auto_rule(False, 140 * GB, 20 * GB, None)
    assert name == "vllm" and "140.0 GiB of 20.0 GiB" in why


def test_auto_refuses_a_model_that_fits_nowhere() -> None:
    with pytest.raises(EvalError) as err:
        E.auto_rule(False, 140 * GB, 20 * GB, "no vLLM environment")
    assert err.value.problem == ("evaluating in transformers needs the dense model (140.0 GiB of "
                                 "20.0 GiB free) and vLLM cannot be used (no vLLM environment)")
    assert err.value.hint is not None and "make vllm-env" in err.value.hint


def test_auto_keeps_hf_for_a_dense_kv_cache_that_fits() -> None:
    name, why = E.auto_rule(False, 1 * GB, 10 * GB, None)
    assert name == "hf" and "fits" in why


def test_engine_precedence_cli_recipe_suite_auto() -> None:
    assert E.requested_engine("hf", "vllm", "vllm") == "hf"
    assert E.requested_engine(None, "vllm", "hf") == "vllm"
    assert E.requested_engine(None, None, "hf") == "hf"
    assert E.requested_engine(None, None, None) == "auto"


# --- choose(): before anything loads ----------------------------------------------------------
def _choose(tiny_model: Path, monkeypatch: pytest.MonkeyPatch, req: E.EvalEngineRequest,
            host: Host | None, kv: bool = False, free: int = 100 * GB) -> E.EngineChoice:
    monkeypatch.setattr(E, "free_bytes", lambda device: free)
    return E.choose(req, tiny_model, tiny_model, kv, "cpu", host=host)


def test_auto_on_a_plain_recipe_does_not_probe_vllm(tiny_model: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from quantize.vllm import host as vhost

    def no_probe(*a: Any, **k: Any) -> Host:
        raise AssertionError("auto probed vLLM for a recipe that does not need it")

    monkeypatch.setattr(vhost, "detect", no_probe)
    c = _choose(tiny_model, monkeypatch, E.EvalEngineRequest("auto"), None)
    assert (c.name, c.requested) == ("hf", "auto") and "fits" in c.reason


def test_auto_on_a_kv_recipe_picks_vllm(tiny_model: Path, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    c = _choose(tiny_model, monkeypatch, E.EvalEngineRequest("auto"), CPU_HOST, kv=True)
    assert c.name == "vllm" and "KV cache" in c.reason and c.vllm_version == "0.32.0"
    assert c.key() == {"engine": "vllm", "tp": 1, "kv_cache_dtype": "auto",
                       "vllm_version": "0.32.0", "vllm_device": "cpu"}


def test_engine_vllm_without_the_environment_names_make_vllm_env(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(EvalError) as err:
        _choose(tiny_model, monkeypatch, E.EvalEngineRequest("vllm"), NO_VLLM)
    assert err.value.problem == f"--engine vllm: {NO_VLLM.problem}"
    assert err.value.hint is not None and "make vllm-env" in err.value.hint
    assert "\n" not in str(err.value)


def test_engine_vllm_on_a_format_the_host_cannot_run_names_engine_hf(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    avx2 = Host("/fake/python", "0.32.0", "cpu", {"avx2": True}, {})  # no AVX-512: no fp8 KV
    with pytest.raises(EvalError) as err:
        _choose(tiny_model, monkeypatch, E.EvalEngineRequest("vllm", kv_cache_dtype="fp8"), avx2)
    assert err.value.problem is not None and err.value.problem.startswith(
        "--engine vllm: this host's vLLM cannot run the candidate (FP8 KV cache needs AVX-512")
    assert err.value.hint == "use --engine hf"


def test_tp_larger_than_visible_devices_is_refused(tiny_model: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(EvalError) as err:
        _choose(tiny_model, monkeypatch, E.EvalEngineRequest("vllm", tp=2), CPU_HOST)
    assert err.value.problem == ("--tp 2 is larger than the devices vLLM sees on this host "
                                 "(the CPU backend (1 device))")
    gpus = Host("/fake/python", "0.32.0", "cuda", gpus=[90, 90])
    with pytest.raises(EvalError) as err:
        _choose(tiny_model, monkeypatch, E.EvalEngineRequest("vllm", tp=4), gpus)
    assert err.value.problem == ("--tp 4 is larger than the devices vLLM sees on this host "
                                 "(2 GPU(s))")
    assert err.value.hint is not None and err.value.hint.startswith("use --tp 2 ")
    c = _choose(tiny_model, monkeypatch, E.EvalEngineRequest("vllm", tp=2), gpus)
    assert (c.name, c.tp, c.device) == ("vllm", 2, "cuda")


def test_vllm_settings_need_the_vllm_engine() -> None:
    with pytest.raises(EvalError) as err:
        E.EvalEngineRequest("hf", tp=2).check()
    assert err.value.problem == "--tp and --kv-cache-dtype apply to --engine vllm only"
    with pytest.raises(EvalError) as err:
        E.EvalEngineRequest("vllm", kv_cache_dtype="int4").check()
    assert err.value.problem == "unknown --kv-cache-dtype 'int4'"
    assert err.value.hint is not None and "fp8" in err.value.hint


def test_cli_refuses_tp_with_hf_in_one_line(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from quantize.cli import main

    res = CliRunner().invoke(main, ["eval", str(tmp_path), "--engine", "hf", "--tp", "2"])
    assert res.exit_code == 2 and "--engine vllm only" in res.output
    assert "Traceback" not in res.output


# --- the vLLM engine's arithmetic, vLLM faked ---------------------------------------------------
def _hf_scorer(model: Any) -> Any:
    """What the worker's score op returns, computed by transformers in this process."""
    import torch

    def score(req: dict[str, Any]) -> dict[str, Any]:
        groups = []
        for g in req["groups"]:
            outs = []
            for seq, start in zip(g["sequences"], g["score_from"], strict=True):
                with torch.inference_mode():
                    logits = model(input_ids=torch.tensor([seq])).logits[0].float()
                lp = torch.log_softmax(logits, -1)
                pos = range(max(start, 1), len(seq))
                lps = [float(lp[p - 1, seq[p]]) for p in pos]
                ranks = [int((lp[p - 1] > lp[p - 1, seq[p]]).sum()) + 1 for p in pos]
                outs.append({"logprobs": lps, "ranks": ranks})
            groups.append({"outputs": outs, "seconds": 1.0,
                           "tokens": sum(map(len, g["sequences"]))})
        return {"ok": True, "groups": groups, "vllm_version": "fake"}

    return score


PPL = parse_metric(dict(name="ppl", kind="perplexity", direction="lower_is_better",
                        builtin="wiki-eval", max_tokens=600, seq_len=128, threshold=0.5))
LONG = parse_metric(dict(name="long", kind="long_perplexity", direction="lower_is_better",
                         builtin="novel", max_tokens=1100, seq_len=512, score_from=384,
                         threshold=0.5))
GK = parse_metric(dict(name="gk", kind="multiple_choice", direction="higher_is_better",
                       task="bigbench:general_knowledge", limit=6, threshold=0.5))


def _vllm_and_hf(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 suite: EvalSuite) -> tuple[Any, Any, list[dict[str, Any]]]:
    """The suite scored by the vLLM engine (tp 2, fp8 KV cache asked for) with the worker
    answering the tiny model's own log-probabilities, by the hf engine, and the requests
    the worker got."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantize.stages.eval import evaluate as hf_evaluate
    from quantize.stages.eval import vllm_engine
    from quantize.vllm import host as vhost

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    seen: list[dict[str, Any]] = []
    fake = _hf_scorer(model)

    def run_worker(python: Path, req: dict[str, Any], *a: Any, **k: Any) -> dict[str, Any]:
        seen.append(req)
        return fake(req)

    monkeypatch.setattr(vhost, "run_worker", run_worker)
    choice = E.EngineChoice("vllm", "vllm", "test", tp=2, vllm_python="/fake/python",
                            device="cuda")
    got = vllm_engine.evaluate(tiny_model, suite, choice, "candidate", tmp_path,
                               kv_cache_dtype="fp8")
    assert len(seen) == 1  # one request (one vLLM process) for every metric of the suite
    assert seen[0]["tp"] == 2 and seen[0]["kv_cache_dtype"] == "fp8"
    return (got.metrics, hf_evaluate(tiny_model, suite, "cpu", "reference").metrics, seen)


def test_vllm_engine_scores_perplexity_as_the_hf_engine_and_passes_tp(
        tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Given the same per-token log-probabilities, the vLLM engine's perplexity and
    long-context perplexity equal the hf engine's (so any difference in a real run is vLLM's
    numbers, not the scoring), and --tp reaches the worker request."""
    from quantize import metrics

    suite = EvalSuite(name="t", batch_size=4, metrics=[PPL, LONG])
    got, want, seen = _vllm_and_hf(tiny_model, tmp_path, monkeypatch, suite)
    assert seen[0]["max_model_len"] == 512  # the longest window, every position of it
    for name in ("ppl", "long"):
        assert got[name].n == want[name].n
        assert got[name].value == pytest.approx(want[name].value, rel=1e-4)
        assert got[name].per_window_nll == pytest.approx(want[name].per_window_nll,
                                                            rel=1e-4)
    assert got["long"].n == 2 * (512 - 384)  # two disjoint windows, the last 128 of each
    assert metrics.tail_windows(1100, 512, 384) == [(0, 512, 128), (512, 1024, 128)]


@pytest.mark.e2e  # lm-eval builds its task index three times (~20 CPU s)
def test_vllm_engine_scores_multiple_choice_as_the_hf_engine(
        tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for multiple choice, which lm-eval asks in two passes (the sequences are
    collected, scored in the one vLLM request with the other metrics, then replayed)."""
    suite = EvalSuite(name="t", batch_size=4, metrics=[PPL, GK])
    got, want, _ = _vllm_and_hf(tiny_model, tmp_path, monkeypatch, suite)
    assert got["gk"].per_example == want["gk"].per_example
    assert got["gk"].n == 6
    assert got["ppl"].value == pytest.approx(want["ppl"].value, rel=1e-4)


# --- the spec: long_perplexity and eval.engine ------------------------------------------------
def test_long_perplexity_fields_are_checked() -> None:
    from pydantic import ValidationError

    base = {"name": "l", "kind": "long_perplexity", "direction": "lower_is_better",
            "builtin": "novel", "seq_len": 2048, "threshold": 0.9}
    assert parse_metric(base).score_from is None  # seq_len // 2 when scored
    with pytest.raises(ValidationError) as err:  # windows are disjoint: no stride
        parse_metric({**base, "stride": 1024})
    assert err.value.errors()[0]["loc"] == ("long_perplexity", "stride")
    assert err.value.errors()[0]["type"] == "extra_forbidden"
    with pytest.raises(ValidationError, match="must be below seq_len"):
        parse_metric({**base, "score_from": 2048})
    with pytest.raises(ValidationError) as err:  # score_from is long_perplexity's own
        parse_metric({**base, "kind": "perplexity", "score_from": 10})
    assert err.value.errors()[0]["loc"] == ("perplexity", "score_from")


def test_fp8_kv_recipe_gates_on_long_context_in_vllm_by_default() -> None:
    from quantize.recipe.recipe import load_recipe, suite_for

    recipe = load_recipe("fp8-kv")
    suite = suite_for(recipe, None)
    longs = {m.name: m.seq_len for m in suite.metrics if m.kind == "long_perplexity"}
    assert longs == {"long_ppl_2k": 2048, "long_ppl_4k": 4096, "long_ppl_8k": 8192}
    assert E.requested_engine(None, recipe.eval.engine, suite.engine) == "auto"
    assert {m.name: m.threshold for m in suite.metrics}["wiki_ppl"] == 0.97  # recipe's


def test_measured_settings_keep_keys_of_runs_made_before_long_perplexity() -> None:
    from quantize.recipe.recipe import load_suite
    from quantize.stages.eval import engine_key, measured_settings

    settings = measured_settings(load_suite("default"))
    assert all("score_from" not in m for m in settings["metrics"])
    assert engine_key(None) is None
    assert engine_key(E.EngineChoice("hf", "auto", "fits")) is None
    assert engine_key(E.EngineChoice("vllm", "auto", "kv"))["engine"] == "vllm"
