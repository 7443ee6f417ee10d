"""Every tiny MoE architecture (tests/fixtures/moe.py: Qwen3-MoE, Mixtral, DeepSeek-V3 with
MLA, shared experts and a dense first layer, gpt-oss with transposed biased experts) through
the real pipeline up to its export (rtn-int4: data-free, seconds; and fp8-block on the
Qwen3-MoE whose shards are all 128 wide, the shapes block FP8 needs), then what the export must
be: every expert projection quantized and the routers dense, its weights the planner's
estimate to the byte, no NaN/Inf or all-zero expert scale, and `quantize verify` passing (vLLM
where this host runs the MoE layers, the exact decode elsewhere). bench/moe_matrix.py runs
every shipped recipe the same way (docs/moe.md)."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
from fixtures import export_runs
from fixtures.export_runs import export_run
from fixtures.moe import ARCHS, NUM_EXPERTS, build_moe

small_calibration = export_runs.small_calibration  # the module fixture, shared


def _stored(export: Path) -> tuple[int, dict[str, str]]:
    """(tensor bytes: the files less their JSON headers, {tensor name: dtype})."""
    from safetensors import safe_open

    total, names = 0, {}
    for f in export.glob("*.safetensors"):
        with open(f, "rb") as fh:
            (header,) = struct.unpack("<Q", fh.read(8))
        total += f.stat().st_size - 8 - header
        with safe_open(str(f), "pt") as fh:
            names.update({k: fh.get_slice(k).get_dtype() for k in fh.keys()})  # noqa: SIM118
    return total, names


CASES = [*((arch, "rtn-int4", 64) for arch in ARCHS), ("qwen3_moe_block128", "fp8-block", None)]


@pytest.mark.parametrize(("arch", "recipe", "group"), CASES)
def test_each_architecture_exports_to_plan_and_verifies(arch: str, recipe: str,
                                                        group: int | None, tmp_path: Path,
                                                        default_tokenizer: Path,
                                                        small_calibration: Path) -> None:
    from quantize.model.config import model_shape, read_config
    from quantize.model.moe import check_expert_scales, read_coverage
    from quantize.planner.weights import estimate_weights, meta, recipe_layers
    from quantize.recipe.recipe import load_recipe
    from quantize.stages import verify as V

    src = build_moe(arch, tmp_path / "src", default_tokenizer)
    run = export_run(recipe, src, small_calibration, tmp_path / "run")
    export = run / "export"
    stored, names = _stored(export)

    config = read_config(src)
    model = meta(config)
    planned = estimate_weights(model, model_shape(config).dtype_bytes,
                               recipe_layers(model, load_recipe(recipe), group)).total
    assert stored == planned

    scaled = (re.match(r"(.*\.experts\.\d+\.\w+)\.weight_scale$", n) for n in names)
    experts = {m[1] for m in scaled if m}
    moe_layers = 2
    assert len(experts) == moe_layers * NUM_EXPERTS * 3
    # no expert weight left in 16 bits (INT4 is packed into int32, FP8 stored as float8)
    assert not [n for n, dt in names.items()
                if re.search(r"\.experts\.\d+\.\w+\.weight$", n) and dt in ("BF16", "F16")]
    routers = [n for n in names if re.search(r"\.(gate|router)\.weight$", n)]
    assert len(routers) == moe_layers
    assert all(names[n] == "BF16" and n.replace(".weight", ".weight_scale") not in names
               for n in routers)

    scales = check_expert_scales(export)
    assert (scales.experts, scales.nonfinite, scales.all_zero) == \
        (moe_layers * NUM_EXPERTS, [], [])
    coverage = read_coverage(export)
    assert coverage is not None and len(coverage.layers) == moe_layers

    s = V.verify(export, out=tmp_path / "verify")
    assert s.verdict == "pass", s.error
    if s.level == "decode":
        m = s.metrics
        assert m.worst_weight_rel_diff == 0.0 and m.max_abs_dlogprob <= 5e-2
        assert m.source_cosine_min >= 0.9
