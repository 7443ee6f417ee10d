"""Running one stage into a run folder: decide (as data) whether it must run, build its folder
atomically, and record it in the manifest. The pipeline drives the stages it chains through
this; a stage run on its own (verify) records itself through `record_stage`.

A stage is skipped only when its recorded key (sha256 of its inputs) matches **and** its
files still hash to what the manifest recorded; otherwise it re-runs, and `Status.message`
says why in the words the log has always used.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from quantize.errors import ExportError
from quantize.progress import info
from quantize.recipe.recipe import canonical_hash
from quantize.run.files import atomic_dir, check_tree, hash_tree, now, pause_point
from quantize.run.lock import run_lock
from quantize.run.manifest import RunFolder, StageRecord

Inputs = dict[str, Any]  # JSON values; a zero-argument callable is resolved when needed
Execute = Callable[[Path], dict[str, Any]]  # the stage's summary as the manifest keeps it
Reason = Literal["rerun", "no-result", "inputs-changed", "outputs-changed", "up-to-date"]


@dataclass(frozen=True)
class Status:
    """Whether a stage must run, and why: data, rendered only by `message`."""

    reason: Reason
    key: str | None = None  # the inputs' key, when it was computed
    changed: tuple[str, ...] = ()  # the inputs that differ from the recorded ones
    detail: str = ""  # what no longer matches, for outputs-changed

    @property
    def must_run(self) -> bool:
        return self.reason != "up-to-date"

    def message(self) -> str:
        if self.reason == "rerun":
            return "re-running as asked (--rerun)"
        if self.reason == "no-result":
            return "no finished result yet"
        if self.reason == "inputs-changed":
            return f"inputs changed ({', '.join(self.changed) or 'key'})"
        if self.reason == "outputs-changed":
            return f"outputs no longer match the manifest ({self.detail}); rebuilding"
        return f"inputs unchanged (key {(self.key or '')[:12]}), outputs verified"


def announce(name: str, st: Status) -> None:
    """The log line that says whether a stage runs, and why (the same for every stage)."""
    if st.must_run:
        info(f"[bold]{name}[/bold]: {st.message()}")
    else:
        info(f"[dim]skip[/dim] {name}: {st.message()}")


def resolved(inputs: Inputs) -> Inputs:
    """Stage inputs with deferred values (zero-argument callables) computed."""
    return {k: resolved(v) if isinstance(v, dict) else v() if callable(v) else v
            for k, v in inputs.items()}


def status(name: str, entry: StageRecord | None, inputs: Inputs, out: Path, *,
           rerun: bool) -> Status:
    """Why the stage must run, or up-to-date. Deferred inputs are resolved (waited for) only
    when there is a finished result to compare them with."""
    if rerun:
        return Status("rerun")
    if entry is None or not entry.done:
        return Status("no-result")
    now_inputs = resolved(inputs)
    key = canonical_hash(now_inputs)
    if entry.key != key:
        old = entry.inputs
        changed = sorted(k for k in set(old) | set(now_inputs) if old.get(k) != now_inputs.get(k))
        return Status("inputs-changed", key, tuple(changed))
    try:
        check_tree(out, entry.outputs, name)
    except ExportError as exc:
        return Status("outputs-changed", key, detail=str(exc))
    return Status("up-to-date", key)


def build(run_dir: Path, name: str, inputs: Inputs, execute: Execute) -> StageRecord:
    """Run the stage into `run_dir/name` (atomically) and return its manifest record."""
    out = run_dir / name
    started, t0 = now(), time.perf_counter()
    pause_point(f"{name}:start")
    with atomic_dir(out) as tmp:
        summary = execute(tmp)
        pause_point(f"{name}:written")
    pause_point(f"{name}:renamed")  # folder in place, manifest entry not yet written
    inputs = resolved(inputs)  # a deferred input (the model fingerprint) is ready by now
    return StageRecord(key=canonical_hash(inputs), inputs=inputs, status="done",
                       started=started, ended=now(),
                       duration_s=round(time.perf_counter() - t0, 2), outputs=hash_tree(out),
                       summary=summary)


def record_stage(run_dir: Path, name: str, inputs: Inputs, execute: Execute, *,
                 rerun: bool = False) -> tuple[Status, StageRecord]:
    """Run one stage of an existing run folder on its own (under the run lock) and record
    it, or reuse its recorded result when nothing changed. Returns (status, its record)."""
    folder = RunFolder(run_dir)
    with run_lock(run_dir):
        manifest = folder.read()
        entry = manifest.stages.get(name)
        st = status(name, entry, inputs, run_dir / name, rerun=rerun)
        announce(name, st)
        if not st.must_run and entry is not None:
            return st, entry
        record = build(run_dir, name, inputs, execute)
        manifest.stages[name] = record
        folder.write(manifest)
        return st, record
