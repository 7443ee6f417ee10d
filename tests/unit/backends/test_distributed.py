"""Data-parallel calibration without launching it: which recipes may run on several processes,
how samples are split, the job file, the launcher's command and error reporting."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from quantize.backends import QuantizeJob
from quantize.backends import distributed as d
from quantize.errors import NotImplementedFeature, QuantizeError
from quantize.recipe.recipe import load_recipe


@pytest.mark.parametrize("recipe", ["gptq-int4", "awq-int4", "w8a8-int8", "fp8-kv"])
def test_gpu_recipes_with_calibration_may_run_data_parallel(recipe: str) -> None:
    d.check_support(load_recipe(recipe), "cuda", 2, visible_gpus=2)


def test_one_process_is_always_fine() -> None:
    d.check_support(load_recipe("rtn-int4"), "cpu", 1)


@pytest.mark.parametrize("recipe", ["rtn-int4", "fp8-dynamic"])
def test_data_free_recipes_have_nothing_to_split(recipe: str) -> None:
    with pytest.raises(NotImplementedFeature) as info:
        d.check_support(load_recipe(recipe), "cuda", 2, visible_gpus=8)
    assert info.value.problem == (f"recipe {recipe} needs no calibration data, so --gpus 2 has "
                                  "nothing to split across processes")
    hint = info.value.hint or ""
    assert hint.startswith("drop --gpus") and "gptq, awq, and rtn with static" in hint


def test_other_engines_are_refused() -> None:
    r = load_recipe("gptq-int4").model_copy(update={"backend": "gptqmodel"})
    with pytest.raises(NotImplementedFeature) as info:
        d.check_support(r, "cuda", 2, visible_gpus=2)
    assert info.value.problem == "--gpus 2: backend gptqmodel has no distributed calibration here"
    assert info.value.hint is not None and "backend: llmcompressor" in info.value.hint


def test_more_gpus_than_visible() -> None:
    with pytest.raises(QuantizeError) as info:
        d.check_support(load_recipe("gptq-int4"), "cuda", 4, visible_gpus=2)
    assert info.value.problem == "--gpus 4 but 2 CUDA GPU(s) are visible"
    assert info.value.hint is not None and info.value.hint.startswith("use --gpus 2 or fewer")


def test_cpu_runs_gptq_only() -> None:
    d.check_support(load_recipe("gptq-int4"), "cpu", 2)
    with pytest.raises(NotImplementedFeature) as info:
        d.check_support(load_recipe("awq-int4"), "cpu", 2)
    problem = info.value.problem or ""
    assert problem.startswith("--gpus 2 on CPU (gloo) supports method gptq without "
                              "smoothquant; method awq: ") and "accelerator" in problem
    assert info.value.hint == "use a GPU machine, or drop --gpus"
    with pytest.raises(NotImplementedFeature) as info:
        d.check_support(load_recipe("w8a8-int8"), "cpu", 2)
    problem = info.value.problem or ""
    assert "; smoothquant: " in problem and problem.endswith("rescales it in place on every rank")


def test_at_least_one_sample_per_process() -> None:
    d.check_samples(2, 2)
    with pytest.raises(QuantizeError) as info:
        d.check_samples(3, 4)
    assert info.value.problem == ("--gpus 4 needs at least 4 calibration samples (one per "
                                  "process) and the set has 3")
    assert info.value.hint is not None and "num_samples" in info.value.hint


@pytest.mark.parametrize(("n", "world"), [(128, 2), (127, 2), (32, 3), (5, 4), (64, 8)])
def test_partition_is_llmcompressors_contiguous_split(n: int, world: int) -> None:
    from llmcompressor.datasets.utils import _get_partition_start_end

    slices = [d.partition(n, r, world) for r in range(world)]
    assert slices == [_get_partition_start_end(n, r, world) for r in range(world)]
    assert slices[0][0] == 0 and slices[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(slices))
    sizes = d.shares(n, world)
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1


def test_job_file_round_trips(tmp_path: Path) -> None:
    job = QuantizeJob(tmp_path / "model", load_recipe("w8a8-int8"), None, [[1, 2], [3]], "cuda",
                      4, placement="onload", world_size=2, host_tier="disk",
                      cpu_budget=123, offload_dir=tmp_path / ".offload")
    text = json.dumps(d.job_to_dict(job, tmp_path / "out"))
    back, out = d.job_from_dict(json.loads(text))
    assert back == job and out == tmp_path / "out"


def test_torchrun_command_is_standalone(tmp_path: Path) -> None:
    cmd = d.torchrun_command(4, tmp_path / "job.json")
    assert cmd[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                       "-m", "quantize.backends._ddp_worker", str(tmp_path / "job.json")]


def test_failure_names_the_first_rank_to_fail(tmp_path: Path) -> None:
    (tmp_path / "error-0.json").write_text(json.dumps(
        {"rank": 0, "time": 20.0, "error": "RuntimeError: Connection closed by peer"}))
    (tmp_path / "error-1.json").write_text(json.dumps(
        {"rank": 1, "time": 10.0, "error": "OutOfMemoryError: CUDA out of memory"}))
    err = d._failure(tmp_path, 1, tmp_path / "torchrun.log")
    assert err.problem == ("distributed quantization failed on rank 1: OutOfMemoryError: CUDA "
                           f"out of memory (all ranks' output: {tmp_path / 'torchrun.log'})")
    (tmp_path / "error-0.json").unlink()
    (tmp_path / "error-1.json").unlink()
    err = d._failure(tmp_path, 1, tmp_path / "x")
    assert err.problem == ("distributed quantization failed (torchrun exit status 1) before "
                           "any rank reported an error")
    assert err.hint == f"see {tmp_path / 'x'}"


def test_cli_has_gpus_and_refuses_before_calibration(tmp_path: Path) -> None:
    from quantize.cli import main

    runner = CliRunner()
    assert "--gpus" in runner.invoke(main, ["run", "--help"]).output
    res = runner.invoke(main, ["run", "gptq-int4", "--gpus", "0"])
    assert res.exit_code == 2 and "--gpus" in res.output


def test_verify_tp_reaches_vllm_tensor_parallel_size(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    """`quantize verify --tp N`: the request carries N, the worker hands it to vllm.LLM as
    tensor_parallel_size, and the printed serve command repeats it (vLLM faked here)."""
    import sys
    import types

    from quantize.stages import verify
    from quantize.vllm import host as capabilities
    from quantize.vllm import worker as vllm_worker

    host = capabilities.Host(None, device="cuda")
    req = verify.engine_request(tmp_path, [[1, 2]], host, 4, "auto")
    assert req.tp == 4
    assert "--tensor-parallel-size 4" in verify.serve_command(tmp_path, req, host)

    seen: dict[str, object] = {}

    class LLM:
        def __init__(self, **kw: object) -> None:
            seen.update(kw)
            raise RuntimeError("stop after the engine arguments")

    fake = types.ModuleType("vllm")
    fake.__dict__.update(LLM=LLM, SamplingParams=object, __version__="0")
    inputs = types.ModuleType("vllm.inputs")
    inputs.__dict__.update(TokensPrompt=dict)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    for var in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ALLOW_INSECURE_SERIALIZATION"):
        monkeypatch.setenv(var, "1")  # generate() setdefaults them; restored afterwards
    with pytest.raises(RuntimeError, match="stop after"):
        vllm_worker.generate(req.to_json())  # type: ignore[arg-type]  # the JSON it reads
    assert seen["tensor_parallel_size"] == 4
