"""quantize.convert.report: the JSON and markdown report carry every row and number."""

from __future__ import annotations

import json
from pathlib import Path

from quantize.convert.preserve import PreservationRow
from quantize.convert.report import REPORT_JSON, REPORT_MD, ConvertReport, write_report
from quantize.convert.roundtrip import Smoke, TensorSummary


def test_report_files(tmp_path: Path) -> None:
    r = ConvertReport("src", "fp8-block", "hf-bf16", "out", TensorSummary(3, 0.01, "w", 0.9999,
                                                                          "w"),
                      Smoke(kl=1e-6, top1=1.0, tokens=32),
                      [PreservationRow("tensor names", True, "3 in, 3 out"),
                       PreservationRow("chat template", False, "'x' -> None")],
                      {"a.k_scale": "activation / KV-cache scale"}, ["note"], 1.5, 1 << 30)
    write_report(tmp_path, r)
    data = json.loads((tmp_path / REPORT_JSON).read_text())
    assert data["preserved"] is False and data["smoke"]["kl"] == 1e-6
    md = (tmp_path / REPORT_MD).read_text()
    assert "| chat template | **NO** | 'x' -> None |" in md
    assert "KL 1e-06 nats, top-1 agreement 100.0 %" in md and "1 tensor(s): activation" in md
