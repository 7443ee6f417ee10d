from __future__ import annotations

import json

import pytest

from quantize.metrics import BIGBENCH_DIR, _bigbench_docs, _task_yaml, windows
from quantize.spec.texts import BUILTIN_TEXT


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
