"""Security through the real pipeline: a run of a Hub-sourced model gets a user-only run
folder, and a recipe's trust_remote_code: true is recorded in the run and export manifests."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from quantize import pipeline
from quantize.model.source import ModelRef

RECIPE = """name: trusting
description: a recipe that trusts the model repo's code
method: rtn
scheme: W4A16
group_size: 64
trust_remote_code: true
calibration: {name: small, builtin: wiki, num_samples: 2, seq_len: 32}
"""


def test_hub_model_run_is_user_only_and_records_trust_remote_code(
        tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = tmp_path / "trusting.yaml"
    recipe.write_text(RECIPE)
    hub = ModelRef("test-org/Tiny-Llama", tiny_model, "Tiny-Llama")  # as if downloaded
    monkeypatch.setattr(pipeline, "resolve_model", lambda spec, allow_pickle=False: hub)
    out = tmp_path / "run"
    pipeline.run(pipeline.RunOptions(recipe=str(recipe), model=hub.source, out=out,
                                     until="export", device="cpu"))
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert json.loads((out / "manifest.json").read_text())["recipe"]["trust_remote_code"]
    em = json.loads((out / "export" / "manifest.json").read_text())
    assert em["recipe"]["trust_remote_code"] is True
    # a local model's run folder keeps the user's umask
    local = tmp_path / "local-run"
    monkeypatch.setattr(pipeline, "resolve_model", lambda spec, allow_pickle=False: ModelRef(
        str(tiny_model), tiny_model, tiny_model.name))
    pipeline.run(pipeline.RunOptions(recipe=str(recipe), model=str(tiny_model), out=local,
                                     until="calibrate", device="cpu"))
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(local.stat().st_mode) == 0o777 & ~umask
