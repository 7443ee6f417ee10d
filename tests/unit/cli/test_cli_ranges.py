"""Numeric options out of range (issue #47, defect 10): `plan --cpu-offload-gb -4` printed a
`vllm serve` line with it, `--max-num-batched-tokens -1` silently planned 16, `fit
--sensitivity-tokens -100` measured 412 tokens. Each is click's usage error now: exit 2, one
`Error:` line naming the option and its range, before anything is read."""

from __future__ import annotations

import math

import click
import pytest
from click.testing import CliRunner

from quantize.cli import main
from quantize.cli.fit_cmd import fit_cmd
from quantize.cli.plan_cmd import plan_cmd

PLAN = ("plan", "--gpu", "h100")
FIT = ("fit", "--gpu", "h100")

# (command and its other arguments, option, value, the range click names)
MATRIX: list[tuple[tuple[str, ...], str, str, str]] = [
    (PLAN, "--cpu-offload-gb", "-4", "0.0<=x<=65536.0"),
    (PLAN, "--cpu-offload-gb", "inf", "0.0<=x<=65536.0"),
    (PLAN, "--cpu-offload-gb", "nan", "0.0<=x<=65536.0"),
    (PLAN, "--cpu-offload-gb", "1e400", "0.0<=x<=65536.0"),
    (PLAN, "--max-num-batched-tokens", "-1", "1<=x<=16777216"),
    (PLAN, "--max-num-batched-tokens", "0", "1<=x<=16777216"),
    (PLAN, "--max-num-seqs", "0", "1<=x<=65536"),
    (PLAN, "--max-num-seqs", "100000", "1<=x<=65536"),
    (PLAN, "--gpus", "0", "1<=x<=512"),
    (PLAN, "--gpus", "-2", "1<=x<=512"),
    (PLAN, "--max-model-len", "-8192", "1<=x<=16777216"),
    (PLAN, "--max-model-len", "99999999999", "1<=x<=16777216"),
    (PLAN, "--concurrency", "0", "1<=x<=65536"),
    (PLAN, "--gpu-memory-utilization", "0", "0.05<=x<=1.0"),
    (PLAN, "--gpu-memory-utilization", "1.5", "0.05<=x<=1.0"),
    (PLAN, "--gpu-memory-utilization", "-inf", "0.05<=x<=1.0"),
    (PLAN, "--gpu-memory-utilization", "nan", "0.05<=x<=1.0"),
    (FIT, "--sensitivity-tokens", "-100", "16<=x<=1000000"),
    (FIT, "--sensitivity-tokens", "0", "16<=x<=1000000"),
    (FIT, "--sensitivity-tokens", "10000000", "16<=x<=1000000"),
    (FIT, "--gpus", "0", "1<=x<=512"),
    (FIT, "--max-model-len", "0", "1<=x<=16777216"),
    (FIT, "--concurrency", "-16", "1<=x<=65536"),
]


@pytest.mark.parametrize(("command", "option", "value", "allowed"), MATRIX,
                         ids=[f"{m[0][0]}{m[1]}={m[2]}" for m in MATRIX])
def test_out_of_range_is_a_one_line_usage_error(command: tuple[str, ...], option: str,
                                                value: str, allowed: str) -> None:
    res = CliRunner().invoke(main, [*command, option, value])
    assert res.exit_code == 2, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, res.output
    assert errors[0].startswith(f"Error: Invalid value for '{option}': ")
    assert errors[0].endswith(f"is not in the range {allowed}.")
    assert "Traceback" not in res.output and "vllm serve" not in res.output


@pytest.mark.parametrize("value", ["lots", "1" * 5000, "3.5"])
def test_not_a_number_is_a_usage_error(value: str) -> None:
    res = CliRunner().invoke(main, [*PLAN, "--max-num-seqs", value])
    assert res.exit_code == 2
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "Invalid value for '--max-num-seqs'" in errors[0]
    assert "is not a valid integer" in errors[0]


def _param(command: click.Command, option: str) -> click.Parameter:
    return next(p for p in command.params if option in getattr(p, "opts", ()))


@pytest.mark.parametrize(("command", "option", "value", "want"), [
    (plan_cmd, "--cpu-offload-gb", "0", 0.0),
    (plan_cmd, "--cpu-offload-gb", "65536", 65536.0),
    (plan_cmd, "--gpu-memory-utilization", "0.05", 0.05),
    (plan_cmd, "--gpu-memory-utilization", "1", 1.0),
    (plan_cmd, "--max-num-batched-tokens", "1", 1),
    (plan_cmd, "--max-model-len", "16777216", 1 << 24),
    (plan_cmd, "--gpus", "512", 512),
    (fit_cmd, "--sensitivity-tokens", "16", 16),
    (fit_cmd, "--sensitivity-tokens", "1000000", 1_000_000),
])
def test_the_bounds_themselves_are_taken(command: click.Command, option: str, value: str,
                                         want: float) -> None:
    param = _param(command, option)
    got = param.type.convert(value, param, None)
    assert got == want and type(got) is type(want)


def test_every_numeric_option_of_plan_and_fit_has_a_bounded_range() -> None:
    """A numeric option added later without a range fails here: every one needs a min and
    a max (and the float ones refuse NaN)."""
    for command in (plan_cmd, fit_cmd):
        for p in command.params:
            if not isinstance(p.type, click.types.IntParamType | click.types.FloatParamType):
                continue
            name = getattr(p, "opts", ["?"])[0]
            if name == "--min-recovery":  # quantize.fit refuses outside (0, 1], NaN too
                continue
            assert isinstance(p.type, click.IntRange | click.FloatRange), name
            assert p.type.min is not None and p.type.max is not None, name
            if isinstance(p.type, click.FloatRange):
                with pytest.raises(click.BadParameter):
                    p.type.convert("nan", p, None)
            assert not math.isinf(p.type.max), name


def test_fit_max_weights_too_large_for_a_float_is_one_line() -> None:
    res = CliRunner().invoke(main, ["fit", "--max-weights", "9" * 400, "--dry-run"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: --max-weights '9999") and lines[-1].endswith(
        "is not a positive size; write e.g. 120MB, 0.5GiB or a byte count")
    assert "Traceback" not in res.output and "OverflowError" not in res.output


@pytest.mark.parametrize("value", ["1.2", "0", "nan", "inf"])
def test_fit_min_recovery_outside_its_range_is_one_line(value: str) -> None:
    res = CliRunner().invoke(main, ["fit", "--max-weights", "100MB", "--min-recovery", value,
                                    "--dry-run"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert lines[-1].startswith(f"error: --min-recovery {float(value)} is outside (0, 1]")
