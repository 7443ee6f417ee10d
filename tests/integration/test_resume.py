"""Kill a real `quantize run` / `quantize publish` subprocess (SIGKILL and SIGINT) at named
points of every stage, then re-run the same command: it resumes from the last finished stage,
never reuses a half-written folder, and ends with the same hashes as an uninterrupted run.

Pipeline points pause through QUANTIZE_PAUSE_AT (quantize.run.files.pause_point):
`<stage>:start` (before its folder exists), `<stage>:written` (all files written into the
hidden `.<stage>.partial` folder), `<stage>:renamed` (the folder is in place, its manifest
entry not written yet), `export:half` (halfway through copying the export's files) and
`eval:baseline` (between the baseline's and the candidate's evaluation). Publish points:
`publish:staged` (the repo folder is written, nothing uploaded) and the commit request held
open by the loopback fake Hub (tests/fixtures/hub/), which after the kill either carries the
commit out (`commit-landed`: the request had reached the Hub) or drops it (`commit-lost`).

The default run (`make test`) kills at 3 points; `make test-slow` runs the whole matrix.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fixtures.hub import FakeHub
from fixtures.pause import (
    FAKE_TOKEN,
    STAGES,
    cmd,
    env,
    resume_and_compare,
    sigint_default,
    start_paused,
    wait_for_pause,
)

ORG, BASE = "test-org", "test-org/Tiny-Llama"
REPO = f"{ORG}/Tiny-Llama-fp8-dynamic"  # <base>-<recipe>
SIGNALS = (signal.SIGKILL, signal.SIGINT)
STAGE_POINTS = {  # in the order the run runs them (fixtures.pause.STAGES)
    "calibrate": ("start", "written"),
    "quantize": ("start", "written", "renamed"),
    "export": ("start", "half", "written", "renamed"),
    "eval": ("start", "baseline", "written"),
    "gate": ("start", "written"),
}
assert tuple(STAGE_POINTS) == STAGES
PIPELINE_POINTS = [f"{stage}:{when}" for stage, whens in STAGE_POINTS.items() for when in whens]
PUBLISH_POINTS = ["publish:staged", "commit-landed", "commit-lost"]
DEFAULT = {("export:half", signal.SIGKILL), ("eval:baseline", signal.SIGINT),
           ("commit-landed", signal.SIGKILL)}


def _cases(points: list[str]) -> list[Any]:
    return [pytest.param(p, s, id=f"{p}-{s.name}",
                         marks=() if (p, s) in DEFAULT else pytest.mark.slow)
            for p in points for s in SIGNALS]


def kill_point_count() -> dict[str, int]:
    """Kill points per stage x signal (docs/reliability.md quotes these)."""
    counts = {stage: len(whens) * len(SIGNALS) for stage, whens in STAGE_POINTS.items()}
    counts["publish"] = len(PUBLISH_POINTS) * len(SIGNALS)
    return counts


# --- the pipeline ---------------------------------------------------------------------------
def _kill_at(point: str, sig: signal.Signals, tiny_model: Path, pause_suite: Path, out: Path,
             pause_reference: Path) -> None:
    marker = out.parent / "paused"
    proc = start_paused(tiny_model, out, pause_suite, point, marker)
    wait_for_pause(proc, marker)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == (130 if sig == signal.SIGINT else -signal.SIGKILL), err
    if sig == signal.SIGINT:
        assert "interrupted: finished stages are kept" in err and "Traceback" not in err
        assert not (out / ".lock").exists()
    else:
        assert (out / ".lock").read_text() == str(proc.pid)  # stale: its owner is dead
    stage, when = point.split(":")
    manifest = json.loads((out / "manifest.json").read_text()) if (
        out / "manifest.json").exists() else {"stages": {}}
    assert stage not in manifest["stages"]  # the interrupted stage never looks finished
    partial = out / f".{stage}.partial"
    if when == "renamed":  # complete folder, but no manifest entry: will not be trusted
        assert (out / stage).is_dir() and not partial.exists()
    elif when == "start" or sig == signal.SIGINT:
        assert not (out / stage).exists() and not partial.exists()
    else:  # SIGKILL inside the stage: a hidden half-written folder is left behind
        assert partial.is_dir() and not (out / stage).exists()
        if point == "export:half":
            done = {p.name for p in partial.iterdir()}
            assert 0 < len(done) < len(list((pause_reference / "export").iterdir()))


@pytest.mark.parametrize(("point", "sig"), _cases(PIPELINE_POINTS))
def test_kill_and_resume(point: str, sig: signal.Signals, tiny_model: Path, pause_suite: Path,
                         pause_reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _kill_at(point, sig, tiny_model, pause_suite, out, pause_reference)
    resume_and_compare(point, tiny_model, pause_suite, out, pause_reference)


@pytest.mark.slow
def test_a_second_run_on_the_same_folder_is_refused(tiny_model: Path, pause_suite: Path,
                                                    tmp_path: Path) -> None:
    """While one run owns the folder, a second one exits 2 naming the owner's pid and
    writes nothing; the first one then finishes as if alone."""
    out, marker = tmp_path / "run", tmp_path / "paused"
    first = start_paused(tiny_model, out, pause_suite, "quantize:written", marker,
                         QUANTIZE_PAUSE_SECONDS="20")
    wait_for_pause(first, marker)
    before = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in out.rglob("*")}
    second = subprocess.run(cmd(tiny_model, out, pause_suite), env=env(), capture_output=True,
                            text=True)
    assert second.returncode == 2
    assert f"is in use by process {first.pid}; wait for it" in second.stderr
    assert {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in out.rglob("*")} == before
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err


def test_no_file_a_run_writes_holds_the_token(pause_reference: Path) -> None:
    """Manifest, stage files, reports and llm-compressor's log: the token is in the
    environment of the run, and in none of its files."""
    files = [p for p in pause_reference.rglob("*") if p.is_file()]
    assert any(p.parent.name == "logs" for p in files)  # the engine's log is checked too
    for f in files:
        assert FAKE_TOKEN.encode() not in f.read_bytes(), f


# --- publish ------------------------------------------------------------------------------
def publish_env(hub: FakeHub, home: Path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items()
         if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE",
                       "TRANSFORMERS_CACHE")}
    return e | {"HF_ENDPOINT": hub.url, "HF_TOKEN": FAKE_TOKEN, "HF_HOME": str(home),
                "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def publish_cmd(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "quantize.cli", "publish", str(run_dir), "--org", ORG,
            "--base-model", BASE, "--license", "apache-2.0"]


def hub_files(hub: FakeHub) -> dict[str, str]:
    return {p: b.sha256 for p, b in hub.files(REPO).items() if p != ".gitattributes"}


@pytest.fixture(scope="module")
def published(pause_reference: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """What an uninterrupted publish of (a copy of) the reference run puts on the Hub."""
    base = tmp_path_factory.mktemp("pubref")
    run_dir = base / "run"
    shutil.copytree(pause_reference, run_dir)
    with FakeHub(token=FAKE_TOKEN, orgs=(ORG,)) as hub:
        proc = subprocess.run(publish_cmd(run_dir), env=publish_env(hub, base / "hf"),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert len(hub.commits(REPO)) == 2
        return hub_files(hub)


def _publish_killed(point: str, sig: signal.Signals, run_dir: Path, hub: FakeHub,
                    home: Path) -> None:
    marker = run_dir.parent / "paused"
    e = publish_env(hub, home)
    hold = None
    if point == "publish:staged":
        e |= {"QUANTIZE_PAUSE_AT": point, "QUANTIZE_PAUSE_MARKER": str(marker)}
    else:
        hold = hub.hold("POST", r"/commit/main$", lose=point == "commit-lost")
    proc = subprocess.Popen(publish_cmd(run_dir), env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    if hold is None:
        wait_for_pause(proc, marker)
    else:
        while not hold.arrived.wait(0.2):
            assert proc.poll() is None, proc.communicate()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == (130 if sig == signal.SIGINT else -signal.SIGKILL), err
    if sig == signal.SIGINT:
        assert "interrupted" in err and "Traceback" not in err
    assert FAKE_TOKEN not in out + err
    if hold is not None:
        hold.release.set()  # the Hub finishes (or drops) the request its client left behind
        assert hold.done.wait(60)
    landed = point == "commit-landed"
    assert (REPO in hub.repos and len(hub.commits(REPO)) == 2) == landed


@pytest.mark.parametrize(("point", "sig"), _cases(PUBLISH_POINTS))
def test_kill_publish_and_resume(point: str, sig: signal.Signals, pause_reference: Path,
                                 published: dict[str, str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(pause_reference, run_dir)
    with FakeHub(token=FAKE_TOKEN, orgs=(ORG,)) as hub:
        _publish_killed(point, sig, run_dir, hub, tmp_path / "hf")
        proc = subprocess.run(publish_cmd(run_dir), env=publish_env(hub, tmp_path / "hf"),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        if point == "commit-landed":  # the re-run sees its files already there
            assert "nothing changed" in proc.stdout, proc.stdout
        else:
            assert f"published {REPO}" in proc.stdout, proc.stdout
        assert len(hub.commits(REPO)) == 2  # the initial commit + exactly one of ours
        assert hub_files(hub) == published  # the same bytes as an uninterrupted publish
        assert FAKE_TOKEN not in proc.stdout + proc.stderr
    pub = run_dir / "publish"
    assert stat.S_IMODE(pub.stat().st_mode) == 0o700  # staged repo + push record: user-only
    leftovers = [p for p in [*run_dir.iterdir(), *pub.rglob(".*")] if p.name.startswith(".")]
    assert leftovers == [], leftovers
    for f in tmp_path.rglob("*"):  # run folder, staging, publish record, HF_HOME
        if f.is_file():
            assert FAKE_TOKEN.encode() not in f.read_bytes(), f
