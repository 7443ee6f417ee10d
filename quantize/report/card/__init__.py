"""The model card (`README.md`) of a published run, built from the run's own files.

Every number in the card is read from the run folder (export config and manifest, eval.json,
gate.json, verify.json) or from the base model's files; nothing is typed in. The YAML header
is `huggingface_hub`'s ModelCardData (header.py); the body is the Jinja template `card.md`,
rendered by `ModelCard.from_template` with the values body.py computes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard

from quantize.report.card.body import BodyView, body_view, engine
from quantize.report.card.header import card_data, eval_results, tags
from quantize.report.card.inputs import BaseInfo, Calibration, CardInputs, CardMetric
from quantize.report.card.memory import human_bytes, kv_bytes_per_token, kv_per_token
from quantize.report.card.naming import default_repo_name, scheme_tag

TEMPLATE = Path(__file__).with_name("card.md")

__all__ = ["TEMPLATE", "BaseInfo", "BodyView", "Calibration", "CardInputs", "CardMetric",
           "body_view", "build_card", "card_data", "default_repo_name", "dumps_json", "engine",
           "eval_results", "human_bytes", "kv_bytes_per_token", "kv_per_token", "scheme_tag",
           "tags"]


def build_card(inputs: CardInputs) -> ModelCard:
    # from_template(template_path=...) would read the file in the locale's encoding; the
    # template is UTF-8 (×, ±). jinja2.Template drops a template's final newline, so one more
    # is appended: the card ends with exactly one.
    template = TEMPLATE.read_text(encoding="utf-8") + "\n"
    return ModelCard.from_template(card_data(inputs), template_str=template,
                                   **body_view(inputs).template_vars())


def dumps_json(data: Any) -> str:
    """Stable JSON for the provenance files shipped next to the card."""
    return json.dumps(data, indent=2, sort_keys=True) + "\n"
