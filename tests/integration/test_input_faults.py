"""The model-input and machine-fault matrix (#47 items 3, 7, 8, 9, 12): hostile model folders
(links leaving the folder, a link loop, missing/extra/mis-shaped/mis-typed tensors, safetensors
headers that lie) and hostile places to write (`--out` a file, /dev/null or /proc, a `.lock`
that is a folder, a link or a FIFO, a run folder of another recipe, a file-size limit).

Each case runs the real CLI (in-process through click's CliRunner, or in a subprocess where
the fault is the process's own: `ulimit -f`) and must end with exit 2, exactly one `error:`
line that names the problem, no traceback, no `.partial` and the run folder's manifest
byte-for-byte what it was (no new file anywhere when there was no run folder). Each case takes
a second or two; the cases that need a finished run share one (`export fp8-dynamic` on the tiny
model, a few seconds).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from quantize.cli import main

Setup = Callable[[Path, Path], None]  # (work folder, tiny model) -> writes the fault


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]  # {work}, {tiny}, {run} substituted
    match: str  # a regex the one error line must contain
    setup: Setup | None = None
    run: bool = False  # the case starts from a finished run folder in {work}/run


CAL = ("calibrate", "fp8-dynamic", "--device", "cpu")


def model_case(id: str, setup: Setup, match: str) -> Case:
    """`quantize calibrate fp8-dynamic --model {work}/m`: refused before any stage."""
    return Case(id, (*CAL, "--model", "{work}/m", "--out", "{work}/out"), match, setup)


def out_case(id: str, out: str, match: str, setup: Setup | None = None) -> Case:
    return Case(id, (*CAL, "--model", "{tiny}", "--out", out), match, setup)


# --- model folders ------------------------------------------------------------------------
def _copy(work: Path, tiny: Path) -> Path:
    m = work / "m"
    shutil.copytree(tiny, m)
    return m


def _link(name: str, target: Callable[[Path], Path | str], dir_target: bool = False) -> Setup:
    def setup(work: Path, tiny: Path) -> None:
        m = _copy(work, tiny)
        (work / "secret.txt").write_text("root:$6$not-a-real-hash\n")
        (work / "outside").mkdir()
        (work / "outside" / "x.jinja").write_text("{{ secrets }}")
        link = m / name
        if link.exists() or link.is_symlink():
            link.unlink()
        link.symlink_to(target(work), target_is_directory=dir_target)
    return setup


def _tensors(change: Callable[[dict[str, Any]], None]) -> Setup:
    def setup(work: Path, tiny: Path) -> None:
        from safetensors.torch import load_file, save_file

        w = _copy(work, tiny) / "model.safetensors"
        state = load_file(w)
        change(state)
        save_file(state, w, metadata={"format": "pt"})
    return setup


def _header(change: Callable[[dict[str, Any]], None]) -> Setup:
    """Rewrite the safetensors header (the data untouched, the file's size kept honest)."""
    def setup(work: Path, tiny: Path) -> None:
        w = _copy(work, tiny) / "model.safetensors"
        data = w.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        change(header)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        w.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])
    return setup


def _config(**change: object) -> Setup:
    def setup(work: Path, tiny: Path) -> None:
        cfg = _copy(work, tiny) / "config.json"
        cfg.write_text(json.dumps({**json.loads(cfg.read_text()), **change}))
    return setup


DOWN = "model.layers.1.mlp.down_proj.weight"


def _to(dtype: str) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        import torch

        state[DOWN] = state[DOWN].to(getattr(torch, dtype))
    return change


def _lie_shape(h: dict[str, Any]) -> None:
    h[DOWN]["shape"] = [128, 128]  # half the bytes its data_offsets hold


def _overlap(h: dict[str, Any]) -> None:
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"
    h[b]["data_offsets"] = h[a]["data_offsets"]


def _unknown_dtype(h: dict[str, Any]) -> None:
    h[DOWN]["dtype"] = "F12"


def _shard_index(work: Path, tiny: Path) -> None:
    m = _copy(work, tiny)
    (m / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {DOWN: "model-00002-of-00002.safetensors",
                        "model.norm.weight": "model.safetensors"}}))


def _weights_folder(work: Path, tiny: Path) -> None:
    m = _copy(work, tiny)
    (m / "extra.safetensors").mkdir()


def _no_tensors(work: Path, tiny: Path) -> None:
    header = b'{"__metadata__": {"format": "pt"}}'
    header += b" " * (-len(header) % 8)
    (_copy(work, tiny) / "model.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header)


def _weights_bytes(data: bytes) -> Setup:
    def setup(work: Path, tiny: Path) -> None:
        (_copy(work, tiny) / "model.safetensors").write_bytes(data)
    return setup


def _a_copy(work: Path, tiny: Path) -> None:
    _copy(work, tiny)


def _a_file(work: Path, tiny: Path) -> None:
    (work / "m").write_text("not a folder")


# --- places to write ------------------------------------------------------------------------
def _file(name: str) -> Setup:
    def setup(work: Path, tiny: Path) -> None:
        (work / name).write_text("a file, not a run folder")
    return setup


def _lock_as(kind: str) -> Setup:
    def setup(work: Path, tiny: Path) -> None:
        lock = work / "run" / ".lock"
        if kind == "folder":
            lock.mkdir()
            (lock / "keep").write_text("the user's")
        elif kind == "link":
            (work / "victim.txt").write_text("must not be truncated")
            lock.symlink_to(work / "victim.txt")
        else:
            os.mkfifo(lock)
    return setup


CASES: list[Case] = [
    # 3: links that leave the model folder; a loop; a broken link
    model_case("chat-template-links-outside", _link("chat_template.jinja",
                                                    lambda w: w / "secret.txt"),
               r"m/chat_template\.jinja is a symlink to .*secret\.txt, outside the model "
               r"folder; copy the real file"),
    model_case("link-to-etc", _link("generation_config.json", lambda w: "/etc/hostname"),
               r"generation_config\.json is a symlink to /etc/hostname, outside the model"),
    model_case("folder-links-outside", _link("additional_chat_templates",
                                             lambda w: w / "outside", dir_target=True),
               r"additional_chat_templates is a symlink to .*outside, outside the model"),
    model_case("dotdot-link", _link("tokenizer.json", lambda w: "../secret.txt"),
               r"tokenizer\.json is a symlink to .*secret\.txt, outside the model folder"),
    model_case("config-symlink-loop", _link("config.json", lambda w: "config.json"),
               r"m/config\.json is a symlink loop"),
    model_case("broken-symlink", _link("tokenizer.json", lambda w: "gone.json"),
               r"m/tokenizer\.json is a broken symlink \(to gone\.json\)"),
    # 9 and a model folder that is a file
    Case("model-empty", (*CAL, "--model", "", "--out", "{work}/out"),
         r"--model '' is empty; give a local folder"),
    Case("model-blank", (*CAL, "--model", "  ", "--out", "{work}/out"),
         r"--model '  ' is empty"),
    model_case("model-is-a-file", _a_file, r"model folder '.*m' is a file, not a folder"),
    # 7: every tensor present, none extra, shapes and dtypes as config.json makes them
    model_case("missing-tensor", _tensors(lambda s: s.pop(DOWN)),
               rf"stores no tensor {re.escape(DOWN)}, which config\.json's architecture "
               r"needs \(transformers would initialise it at random\)"),
    model_case("extra-tensor", _tensors(lambda s: s.__setitem__(
        "model.layers.7.mlp.up_proj.weight", s["model.norm.weight"].clone())),
        r"model\.safetensors stores model\.layers\.7\.mlp\.up_proj\.weight, which config\.json's "
        r"architecture has no place for"),
    model_case("config-shape-mismatch", _config(intermediate_size=384),
               r"model\.safetensors: model\.layers\.0\.mlp\.down_proj\.weight has shape "
               r"\[128, 256\] but config\.json makes it \[128, 384\]"),
    model_case("int8-tensor", _tensors(_to("int8")),
               rf"{re.escape(DOWN)} is stored as I8, but a weight of this model is floating "
               r"point \(config\.json declares float16\)"),
    model_case("undeclared-bf16-tensor", _tensors(_to("bfloat16")),
               rf"{re.escape(DOWN)} is stored as BF16, but config\.json declares float16"),
    model_case("header-lies-about-size", _header(_lie_shape),
               r"model\.safetensors is not a valid safetensors file: tensor "
               rf"'{re.escape(DOWN)}' \(F16 \[128, 128\]\) needs 32768 bytes, its "
               r"data_offsets \[\d+, \d+\] hold 65536"),
    model_case("header-tensors-overlap", _header(_overlap),
               r"not a valid safetensors file: tensor .* starts at byte \d+, not \d+ "
               r"\(tensors overlap or leave a gap\)"),
    model_case("header-unknown-dtype", _header(_unknown_dtype),
               r"not a valid safetensors file: tensor .* has unknown dtype 'F12'"),
    model_case("header-not-an-object", _weights_bytes(b"\x08" + b"\0" * 7 + b"[]      "),
               r"not a valid safetensors file: the header is not a JSON object"),
    model_case("safetensors-without-tensors", _no_tensors,
               r"model\.safetensors holds no tensors"),
    model_case("empty-safetensors-file", _weights_bytes(b""), r"shorter than its 8-byte header"),
    model_case("index-names-a-missing-shard", _shard_index,
               r"model\.safetensors\.index\.json names the shard "
               r"'model-00002-of-00002\.safetensors', which is not in the folder"),
    model_case("weights-name-a-folder", _weights_folder,
               r"extra\.safetensors cannot be read \(Is a directory\)"),
    # 12: where the run is written
    out_case("out-is-a-file", "{work}/afile", r"afile is a file, not a folder; give --out",
             _file("afile")),
    out_case("out-is-dev-null", "/dev/null", r"/dev/null is not a folder; give --out"),
    out_case("out-under-a-file", "{work}/afile/run",
             r"cannot create .*afile/run \(Not a directory\)", _file("afile")),
    out_case("out-is-proc", "/proc", r"cannot (create|access) /proc/\.lock"),
    Case("out-is-the-model-folder", (*CAL, "--model", "{work}/m", "--out", "{work}/m"),
         r"m is the model folder, so the run would write into the model; give --out a folder "
         r"of its own", _a_copy),
    Case("out-inside-the-model-folder", (*CAL, "--model", "{work}/m", "--out",
                                         "{work}/m/run"),
         r"m/run is inside the model folder .*m, so the run would write into the model",
         _a_copy),
    Case("lock-is-a-folder", (*CAL, "--model", "{tiny}", "--out", "{run}"),
         r"run/\.lock is a folder, not a lock file; remove it", _lock_as("folder"), True),
    Case("lock-is-a-link", (*CAL, "--model", "{tiny}", "--out", "{run}"),
         r"run/\.lock is a link, not a lock file", _lock_as("link"), True),
    Case("lock-is-a-fifo", (*CAL, "--model", "{tiny}", "--out", "{run}"),
         r"run/\.lock is a special file \(a FIFO or device\), not a lock file",
         _lock_as("fifo"), True),
    Case("out-of-another-recipe", ("calibrate", "w8a16-int8", "--device", "cpu", "--model",
                                   "{tiny}", "--out", "{run}"),
         r"run holds the run of recipe 'fp8-dynamic', which this run of recipe 'w8a16-int8' "
         r"on '.*' would replace; give another --out folder, or pass --rerun all", None, True),
    Case("out-of-another-model", (*CAL, "--model", "{work}/m", "--out", "{run}"),
         r"run holds the run of model '.*tiny-llama.*', which this run of recipe "
         r"'fp8-dynamic' on '.*m' would replace", _a_copy, True),
]


def _fill(arg: str, work: Path, tiny: Path) -> str:
    return (arg.replace("{work}", str(work)).replace("{tiny}", str(tiny))
            .replace("{run}", str(work / "run")))


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under `root`, with the manifests' bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() if p.name == "manifest.json"
            and p.is_file() else None for p in root.rglob("*")}


def _one_error(out: str, match: str) -> str:
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out
    assert out.rstrip().splitlines()[-1] == errors[0]  # the last line says what went wrong
    assert re.search(match, errors[0]), errors[0]
    assert "Traceback" not in out and "internal error" not in out
    return errors[0]


@pytest.fixture(scope="module")
def finished_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`quantize export fp8-dynamic` on the tiny model: the run folder the cases that need
    one start from (copied, never changed)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    result = CliRunner().invoke(main, ["export", "fp8-dynamic", "--model", str(tiny_model),
                                       "--out", str(out), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault_is_one_line_exit_2_and_leaves_nothing(
        case: Case, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        request: pytest.FixtureRequest) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # a default `runs/` folder would land here and be caught
    monkeypatch.delenv("QUANTIZE_DEBUG", raising=False)
    if case.run:
        shutil.copytree(request.getfixturevalue("finished_run"), work / "run", symlinks=True)
    if case.setup:
        case.setup(work, tiny_model)
    before = _snapshot(tmp_path)
    victim = work / "victim.txt"
    result = CliRunner().invoke(main, [_fill(a, work, tiny_model) for a in case.args])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # handled, not crashed
    _one_error(result.output, case.match)
    assert _snapshot(tmp_path) == before, "left output behind or changed the manifest"
    assert not list(tmp_path.rglob("*.partial"))
    if victim.exists():
        assert victim.read_text() == "must not be truncated"


def test_the_matrix_covers_each_defect() -> None:
    ids = {c.id for c in CASES}
    assert len(ids) == len(CASES) >= 30
    assert {"chat-template-links-outside", "missing-tensor", "config-shape-mismatch",
            "model-empty", "out-is-a-file", "out-is-proc", "out-is-dev-null",
            "lock-is-a-folder", "out-of-another-recipe"} <= ids


def test_a_hub_snapshot_of_links_into_its_blobs_is_accepted(tiny_model: Path,
                                                           tmp_path: Path) -> None:
    """huggingface_hub's cache: snapshots/REV/x -> ../../blobs/SHA, inside the repo's folder."""
    from quantize.model.source import resolve_model

    repo = tmp_path / "hub" / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in tiny_model.iterdir():
        shutil.copyfile(f, blobs / f"sha-{f.name}")
        (snap / f.name).symlink_to(Path("../../blobs") / f"sha-{f.name}")
    assert resolve_model(str(snap)).path == snap
    result = CliRunner().invoke(main, [*CAL, "--model", str(snap), "--out",
                                       str(tmp_path / "run")])
    assert result.exit_code == 0, result.output


def test_another_recipe_replaces_the_run_only_with_rerun_all(finished_run: Path,
                                                            tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    tiny = json.loads((run / "manifest.json").read_text())["model"]["path"]
    result = CliRunner().invoke(main, ["calibrate", "w8a16-int8", "--model", tiny, "--out",
                                       str(run), "--device", "cpu", "--rerun", "all"])
    assert result.exit_code == 0, result.output
    assert json.loads((run / "manifest.json").read_text())["recipe"]["name"] == "w8a16-int8"


def test_a_changed_chat_template_or_generation_config_rebuilds_the_export(
        finished_run: Path, tiny_model: Path, tmp_path: Path) -> None:
    """Every file that reaches the export is in its key (through the model fingerprint);
    leftovers of killed writers (`.export.old`, a stage's `.partial`) go when the lock is
    taken, even where every stage is up to date."""
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    run = tmp_path / "run"
    args = ["export", "fp8-dynamic", "--model", str(model), "--out", str(run), "--device",
            "cpu"]
    assert CliRunner().invoke(main, args).exit_code == 0
    (run / ".export.old").mkdir()
    (run / ".export.old" / "model.safetensors").write_bytes(b"old")
    (run / ".eval.partial").mkdir()
    (run / ".manifest.json.x1y2.tmp").write_text("{")
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0 and "skip export: inputs unchanged" in result.output
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []
    gen = {**json.loads((model / "generation_config.json").read_text()), "max_length": 77}
    for name, text in (("chat_template.jinja", "{{ 'new template' }}"),
                       ("generation_config.json", json.dumps(gen))):
        (model / name).write_text(text)
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        assert "quantize: inputs changed (model)" in result.output, result.output
        assert "export: inputs changed (quantize)" in result.output, result.output
        exported = (run / "export" / name).read_text()
        assert ("new template" in exported if name.endswith(".jinja")
                else json.loads(exported)["max_length"] == 77)


def test_a_refusal_stops_and_joins_the_hashing_thread(tiny_model: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal after the model's background hash started (a bad --dataset, found by the
    calibrate stage) waits for the
    hashing thread, stopped, before the CLI exits: a thread torn down at interpreter exit
    inside native code aborted one refusal in ten (exit 134)."""
    from concurrent.futures import CancelledError

    import quantize.pipeline as pipeline

    seen: list[threading.Event] = []

    def slow(ref: object, cancel: threading.Event) -> str:
        seen.append(cancel)
        if cancel.wait(60):
            raise CancelledError
        return "never"

    monkeypatch.setattr(pipeline, "model_fingerprint", slow)
    # --no-disk-check: the disk check would read the dataset spec before the hash starts
    result = CliRunner().invoke(main, [*CAL, "--model", str(tiny_model), "--out",
                                       str(tmp_path / "run"), "--dataset", "/nonexistent.txt",
                                       "--no-disk-check"])
    assert result.exit_code == 2, result.output
    _one_error(result.output, r"dataset '/nonexistent\.txt': no such file")
    assert seen and seen[0].is_set()
    assert not [t for t in threading.enumerate() if t.name == "model-fingerprint"]


def _limit_file_size() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))  # 4 MiB: calibrate fits


def test_a_file_size_limit_is_one_line_exit_2(finished_run: Path, tmp_path: Path) -> None:
    """`ulimit -f`: the engine's 12 MiB checkpoint write fails with EFBIG (Python ignores
    SIGXFSZ), in the real CLI's own process: one line, exit 2, the manifest unchanged."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    manifest = json.loads((run / "manifest.json").read_text())
    model = manifest["model"]["path"]
    before = (run / "manifest.json").read_bytes()
    proc = subprocess.run([sys.executable, "-m", "quantize.cli", "export", "fp8-dynamic",
                           "--model", model, "--out", str(run), "--device", "cpu", "--rerun",
                           "quantize"], capture_output=True, text=True,
                          preexec_fn=_limit_file_size,
                          env={**os.environ, "QUANTIZE_DEBUG": ""})
    assert proc.returncode == 2, proc.stderr
    _one_error(proc.stderr, r"cannot write .*run/quantize: the file would exceed this "
                            r"process's file-size limit \(ulimit -f\); raise the limit")
    assert (run / "manifest.json").read_bytes() == before
    assert not list(run.rglob("*.partial")) and not (run / ".quantize.partial").exists()
