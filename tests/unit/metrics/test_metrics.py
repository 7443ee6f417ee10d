from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantize.metrics import BIGBENCH_DIR, _bigbench_docs, _task_yaml, windows
from quantize.recipe.texts import BUILTIN_TEXT


@pytest.mark.parametrize(("n", "seq", "stride"), [(100, 10, 10), (100, 10, 5), (97, 16, 7),
                                                   (5, 10, 10), (64, 64, 64)])
def test_strided_windows_score_each_token_at_most_once(n: int, seq: int, stride: int) -> None:
    scored: list[int] = []
    for b, e, k in windows(n, seq, stride):
        assert e - b <= seq and 0 < k <= e - b - 1
        scored += range(e - k, e)
    assert len(scored) == len(set(scored))
    assert scored == sorted(scored) and scored[-1] == n - 1
    if stride < seq:  # overlapping windows: every token but the first is predicted
        assert scored == list(range(1, n))


def test_bigbench_prompt_leaves_the_space_to_the_choice() -> None:
    docs = _bigbench_docs("general_knowledge")
    assert docs[0]["text"].endswith("A:") and not docs[0]["text"].endswith(" ")
    assert docs[0]["choices"][docs[0]["gold"]] == "four"  # "How many legs do horses have?"
    assert 'target_delimiter: " "' in _task_yaml("t", BIGBENCH_DIR / "x.jsonl")


def test_shipped_tasks_keep_their_canary() -> None:
    for p in BIGBENCH_DIR.glob("*.json"):
        assert "canary" in json.loads(p.read_text())


def test_calibration_and_eval_text_share_no_paragraph() -> None:
    calib = set(BUILTIN_TEXT["wiki"].read_text().splitlines())
    ev = set(BUILTIN_TEXT["wiki-eval"].read_text().splitlines())
    assert calib and ev and not (calib & ev)


def test_packed_multiple_choice_scores_like_lm_eval_hflm(tiny_model: Path, tmp_path: Path) -> None:
    """The hf engine's packed scorer inside lm-eval's own task run: the same accuracy on every
    example as lm-eval's HFLM, and eval.json says which loop scored it."""
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantize.metrics import hf_lm, multiple_choice
    from quantize.recipe.recipe import parse_metric

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    spec = parse_metric(dict(name="gk", kind="multiple_choice", direction="higher_is_better",
                             task="bigbench:general_knowledge", limit=12, threshold=0.5))
    packed = multiple_choice(model, tok, spec, 4, tmp_path / "packed")
    plain = multiple_choice(model, tok, spec, 4, tmp_path / "plain",
                            lm=HFLM(pretrained=model, tokenizer=tok, batch_size=4))
    assert packed.n == plain.n == 12
    assert packed.per_example == plain.per_example
    assert packed.settings["scoring"] == "packed contexts"
    assert plain.settings["scoring"] == "lm-eval"
    assert type(hf_lm(model, tok, 4)).__name__ == "PackedHFLM"


def test_choice_scoring_marks_the_hf_keys_only() -> None:
    from quantize.recipe.recipe import load_suite
    from quantize.stages.eval import HF_CHOICE_SCORING, choice_scoring
    from quantize.stages.eval.engine import EngineChoice

    suite = load_suite("default")
    assert choice_scoring(suite, None) == HF_CHOICE_SCORING
    assert choice_scoring(suite, EngineChoice("hf", "auto", "fits")) == HF_CHOICE_SCORING
    assert choice_scoring(suite, EngineChoice("vllm", "vllm", "asked")) is None
    ppl_only = suite.model_copy(update={"metrics": [m for m in suite.metrics
                                                    if m.kind != "multiple_choice"]})
    assert choice_scoring(ppl_only, None) is None
