"""The real-client question check: scoring rules, the shipped question set, the request it
sends to the vLLM worker and how it reads answers back (the worker faked here; the real
engine runs in tests/integration/test_answers_vllm.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from quantize.report import answers
from quantize.vllm.host import Host


@pytest.mark.parametrize(("text", "accepted", "right"), [
    ("2 plus 2 equals 4.", ["4", "four"], True),
    ("Two plus two is four", ["4", "four"], True),
    ("2 plus 2 is 2.", ["4", "four"], False),
    ("Water boils at 100 degrees.", ["0", "zero"], False),  # whole words only
    ("The chemical formula is H2O.", ["h2o"], True),
    ("It absorbs carbon dioxide", ["carbon dioxide", "co2"], True),
    ("Cowboys", ["cow"], False),
])
def test_an_answer_is_right_when_an_accepted_answer_is_a_whole_word(
        text: str, accepted: list[str], right: bool) -> None:
    assert answers.is_right(text, accepted) is right


def test_the_shipped_question_set_loads() -> None:
    qs = answers.load_questions()
    assert len(qs.questions) >= 20
    assert len({q.q for q in qs.questions}) == len(qs.questions)


def test_ask_sends_chat_prompts_and_stops_reading_at_eos(
        tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    qs = answers.QuestionSet(name="t", questions=[
        answers.Question(q="What is 2 plus 2?", a=["4"]),
        answers.Question(q="What color is the sky?", a=["blue"])])
    sent: dict[str, Any] = {}

    def fake_worker(python: Path, req: dict[str, Any], workdir: Path, name: str,
                    timeout_s: float) -> dict[str, Any]:
        sent.update(req)
        right = [*tok.encode(" 4", add_special_tokens=False), tok.eos_token_id,
                 *tok.encode(" blue", add_special_tokens=False)]  # past EOS: not read
        wrong = tok.encode(" green", add_special_tokens=False)
        return {"ok": True, "outputs": [{"token_ids": right}, {"token_ids": wrong}]}

    monkeypatch.setattr(answers.vhost, "run_worker", fake_worker)
    host = Host(vllm_python="/bin/true", device="cpu")
    sheet = answers.ask(tiny_model, tmp_path, host, qs)
    assert (sheet.right, sheet.total) == (1, 2)
    assert sheet.answers[0].text == "4"
    assert sent["op"] == "generate" and len(sent["prompts"]) == 2
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 2?"}],
                                   add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]
    assert sent["prompts"][0] == list(chat)
    assert answers.AnswerSheet.from_json(sheet.to_json()) == sheet


def test_without_vllm_one_line_names_the_fix(tiny_model: Path, tmp_path: Path) -> None:
    from quantize.errors import VerifyError

    host = Host(None, problem="no vLLM environment: run `make vllm-env`")
    with pytest.raises(VerifyError) as err:
        answers.ask(tiny_model, tmp_path, host)
    assert err.value.problem == ("the question check needs vLLM: no vLLM environment: run "
                                 "`make vllm-env`")
