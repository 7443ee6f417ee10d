"""The shared imatrix range search gives each module the min/max the library's own
per-module search gives it (same patience stop, same importance), and leaves other
observers to the library."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llmcompressor")

from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from llmcompressor.modifiers.quantization.calibration import observe  # noqa: E402
from llmcompressor.observers.imatrix import IMatrixMSEObserver  # noqa: E402

from quantize.backends import _imatrix_batch  # noqa: E402


def _linears(n: int, out: int, inp: int, *, seed: int, **obs_kw: object) -> list[torch.nn.Linear]:
    gen = torch.Generator().manual_seed(seed)
    mods = []
    for i in range(n):
        lin = torch.nn.Linear(inp, out, bias=False)
        with torch.no_grad():
            # experts of different scales and outlier columns: their searches stop at
            # different steps, which is what the per-module patience must reproduce
            lin.weight.copy_(torch.randn(out, inp, generator=gen) * (0.5 + i)
                             + (torch.rand(out, inp, generator=gen) > 0.99) * 4.0)
        args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group",
                                group_size=16)
        obs = IMatrixMSEObserver(base_name="weight", args=args, **obs_kw)
        lin.weight_observer = obs
        obs.attach(lin)
        with torch.no_grad():
            lin(torch.randn(8, inp, generator=gen) * torch.linspace(0.1, 3.0, inp))
        mods.append(lin)
    return mods


@pytest.mark.parametrize(("out", "kw"), [(24, {}), (24, {"patience": 1}), (1, {"patience": 1}),
                                         (24, {"patience": 0, "grid": 8})])
def test_same_min_max_as_the_library(out: int, kw: dict[str, object]) -> None:
    mods = _linears(5, out, 16 if out == 1 else 64, seed=3, **kw)
    ref = copy.deepcopy(mods)
    observe(ref, "weight")
    _imatrix_batch.observe_batched(observe)(mods, "weight")
    for a, b in zip(mods, ref, strict=True):
        assert torch.equal(a.weight_observer.min_vals, b.weight_observer.min_vals)
        assert torch.equal(a.weight_observer.max_vals, b.weight_observer.max_vals)
        qa, qb = a.weight_observer.get_qparams(), b.weight_observer.get_qparams()
        assert torch.equal(qa["scale"], qb["scale"])
        assert torch.equal(qa["zero_point"], qb["zero_point"])


def test_importance_changes_the_result() -> None:
    """The control for the test above: the same weights searched without their importance
    vectors end elsewhere, so agreeing with the library means using each module's own."""
    mods = _linears(5, 24, 64, seed=3)
    uniform = copy.deepcopy(mods)
    for m in uniform:
        m.weight_observer._imatrix_sum.fill_(1.0)
    _imatrix_batch.search(mods)
    _imatrix_batch.search(uniform)
    assert any(not torch.equal(a.weight_observer.min_vals, b.weight_observer.min_vals)
               for a, b in zip(mods, uniform, strict=True))


def test_widths_and_other_observers_go_their_own_way(monkeypatch: pytest.MonkeyPatch) -> None:
    mods = _linears(2, 24, 64, seed=1) + _linears(2, 24, 32, seed=2)
    plain = torch.nn.Linear(16, 8, bias=False)
    calls: list[int] = []
    monkeypatch.setattr(_imatrix_batch, "search", lambda batch: calls.append(len(batch)))
    seen: list[object] = []
    _imatrix_batch.observe_batched(lambda m, name: seen.append(m))([*mods, plain], "weight")
    assert sorted(calls) == [2, 2]  # one pass per input width
    assert seen == [plain]  # no imatrix observer: the library's observe


def test_batches_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_imatrix_batch, "MAX_BATCH_ELEMENTS", 24 * 64 * 2)
    batches, rest = _imatrix_batch._batches(_linears(5, 24, 64, seed=0))
    assert [len(b) for b in batches] == [2, 2, 1] and rest == []


@pytest.mark.slow
def test_a_moe_export_is_the_same_with_the_shared_search(
        tmp_path: Path, default_tokenizer: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default recipe on a tiny Qwen3-MoE, through the whole quantize stage: the export's
    tensors are bit-identical with and without the shared search."""
    from fixtures.export_runs import export_run
    from fixtures.moe import build_moe
    from safetensors.torch import load_file

    calib = tmp_path / "small.yaml"
    calib.write_text("name: tiny\nbuiltin: wiki\nnum_samples: 2\nseq_len: 64\n")
    src = build_moe("qwen3_moe", tmp_path / "src", default_tokenizer)
    calls: list[int] = []
    real = _imatrix_batch.search
    monkeypatch.setattr(_imatrix_batch, "search", lambda b: (calls.append(len(b)), real(b)))
    shared = export_run("gptq-int4-asym-g32", src, calib, tmp_path / "shared")
    assert calls and max(calls) > 1  # the experts went through the shared search
    monkeypatch.setattr(_imatrix_batch, "batched_imatrix",
                        lambda enabled=True: contextlib.nullcontext())
    alone = export_run("gptq-int4-asym-g32", src, calib, tmp_path / "alone")
    a = load_file(shared / "export" / "model.safetensors")
    b = load_file(alone / "export" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
