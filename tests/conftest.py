"""Shared fixtures and the fast tier. Tests run offline: any socket connection outside
loopback fails.

The fast tier (`pytest --fast`, what `make test-fast` runs) is tests/unit and tests/bench
without the tests marked slow, gpu, vllm, e2e or real_model; a test that takes the
`default_model` fixture is marked real_model here, so it leaves the tier by itself. Two rules
keep a slow test from entering the tier unseen: the tier runs on an empty model cache where
converting the default model fails the test (a test that calls default_model_dir() itself),
and a test whose setup or body takes more than FAST_CPU_S CPU seconds (or FAST_WALL_S of the
clock) fails, naming the limit and the way out (@pytest.mark.e2e: `make test` only)."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# session fixtures shared by several modules (one instance per session, not per module)
pytest_plugins = ("fixtures.pause", "fixtures.default_runs")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_real_connect = socket.socket.connect


def _loopback_only(self: socket.socket, address: object) -> None:
    host = address[0] if isinstance(address, tuple) else None
    if host is not None:
        try:
            ok = ipaddress.ip_address(host).is_loopback
        except ValueError:
            ok = host == "localhost"
        if not ok:
            raise OSError(f"tests may not reach the network ({host}); only loopback")
    _real_connect(self, address)  # type: ignore[arg-type]


socket.socket.connect = _loopback_only  # type: ignore[method-assign]


# --- the fast tier --------------------------------------------------------------------------
FAST_PATHS = ("tests/unit/", "tests/bench/")
NOT_FAST = ("slow", "gpu", "vllm", "real_model", "e2e")
# What one fast test may take, its setup (fixtures) and its body each: CPU seconds (this
# process and its waited-for children; a shared machine slows the clock, not this) and, for a
# test that waits rather than computes, wall-clock seconds.
FAST_CPU_S = 15.0
FAST_WALL_S = 60.0
_CPU = pytest.StashKey[dict[str, float]]()  # an item's CPU s by phase
_COSTS = pytest.StashKey[dict[str, float]]()  # the session's CPU s by test
_START = pytest.StashKey[float]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true", default=False, help=(
        "the fast tier (make test-fast): tests/unit and tests/bench on tiny models, without "
        f"the {'/'.join(NOT_FAST)} tests; a test that converts the default model, or whose "
        f"setup or body takes over {FAST_CPU_S:.0f} CPU s or {FAST_WALL_S:.0f} s, fails"))


def _fast(config: pytest.Config) -> bool:
    return bool(config.getoption("fast"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "default_model" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)
    if not _fast(config):
        return
    root = config.rootpath
    keep, drop = [], []
    for item in items:
        rel = item.path.relative_to(root).as_posix()
        fast = rel.startswith(FAST_PATHS) and not any(item.get_closest_marker(m)
                                                      for m in NOT_FAST)
        (keep if fast else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def _cpu_s() -> float:
    import resource

    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                 resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _timed(item: pytest.Item, when: str) -> Iterator[None]:
    start = _cpu_s()
    try:
        return (yield)
    finally:
        item.stash.setdefault(_CPU, {})[when] = _cpu_s() - start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _timed(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _timed(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Iterator[pytest.TestReport]:
    report: pytest.TestReport = yield
    cpu = item.stash.get(_CPU, {}).get(report.when)
    if cpu is not None:
        costs = item.config.stash.setdefault(_COSTS, {})
        costs[item.nodeid] = costs.get(item.nodeid, 0.0) + cpu
    if (_fast(item.config) and report.when in ("setup", "call") and report.passed
            and cpu is not None and (cpu > FAST_CPU_S or report.duration > FAST_WALL_S)):
        report.outcome = "failed"
        report.longrepr = (
            f"the fast tier allows {FAST_CPU_S:.0f} CPU s and {FAST_WALL_S:.0f} s per test "
            f"setup or body, and this test's {report.when} took {cpu:.1f} CPU s in "
            f"{report.duration:.1f} s: make it faster, or move it out of the tier "
            "(@pytest.mark.e2e: `make test` still runs it)")
    return report


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The tier's own account: the tests that cost the most CPU (the clock is noisy on a
    shared machine; CPU time is what the 2-minute budget on 2 cores is made of)."""
    if not _fast(config):
        return
    costs = config.stash.get(_COSTS, {})
    total = _cpu_s() - config.stash.get(_START, 0.0)
    terminalreporter.write_sep("=", f"fast tier: {total:.0f} CPU s in all (tests "
                                    f"{sum(costs.values()):.0f}); the costliest tests")
    for nodeid, cpu in sorted(costs.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{cpu:7.2f} CPU s  {nodeid}")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_START] = _cpu_s()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The fast tier imports the heavy libraries its tests share once, up front, so the
    per-test limits measure each test and not whichever test imports them first."""
    if _fast(session.config) and session.items:
        import llmcompressor  # noqa: F401  (torch and transformers come with it)


def _no_conversion(*_args: object) -> None:
    pytest.fail("the fast tier never converts the default model (~20 s): use the tiny_model "
                "or default_tokenizer fixture, or take the default_model fixture (the test "
                "then runs in `make test` only)", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def quantize_cache(request: pytest.FixtureRequest,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One cache per test session (the default model is converted into it once).
    QUANTIZE_TEST_CACHE reuses a cache across sessions when set (local iteration); the fast
    tier always starts empty and refuses the conversion, so a warm cache cannot hide a test
    that needs the default model."""
    fast = _fast(request.config)
    reuse = None if fast else os.environ.get("QUANTIZE_TEST_CACHE")
    path = Path(reuse or tmp_path_factory.mktemp("cache"))
    os.environ["QUANTIZE_CACHE"] = str(path)
    with pytest.MonkeyPatch.context() as mp:
        if fast:
            from quantize.model import source

            mp.setattr(source, "_convert_gguf", _no_conversion)
        yield path


@pytest.fixture(scope="session")
def default_model(quantize_cache: Path) -> Path:
    """The real pretrained default model (SmolLM2-135M-Instruct) as a bf16 folder, converted
    from its GGUF once per cache (~20 s on 2 cores). Taking it marks a test real_model."""
    from quantize.model.source import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def default_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the default model's tokenizer (the one the conversion writes), read from
    the GGUF's metadata in about a second: for tests that need the real tokenizer and not the
    model (tests/fixtures/tokenizer.py)."""
    from fixtures.tokenizer import save_default_tokenizer

    return save_default_tokenizer(tmp_path_factory.mktemp("default-tokenizer"))


@pytest.fixture(scope="session")
def tiny_model(default_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (2 layers, hidden 128) with the default model's tokenizer:
    real mechanics in seconds. Quality claims use the real default model instead."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    tok = AutoTokenizer.from_pretrained(default_tokenizer)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, dtype=torch.float16)
    model = LlamaForCausalLM(cfg).to(torch.float16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture
def recipe_file(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Write YAML text to a recipe file named after its `name:` (or x.yaml)."""

    def write(text: str, name: str = "x") -> Path:
        p = tmp_path / f"{name}.yaml"
        p.write_text(text)
        return p

    return write
