"""Atomic writes and hashes of the files a run writes (the layout: quantize.run.manifest)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import threading

from quantize.errors import DiskError, ExportError, compose, first_line

_CHUNK = 1 << 20


# sha256 of files this process already read, keyed by (device, inode, size, mtime, ctime): a
# rename keeps the key, any write changes it. Measured on an 8B export (bench/RESULTS.md):
# hashing each checkpoint three times cost 16-25 s per run; now each file is read once.
# ctime is in the key because mtime alone can be copied (copystat, copytree) onto a new file
# that reuses a deleted file's inode; ctime cannot be set. Files under _CACHE_MIN_BYTES are
# always re-read: they cost nothing to hash, and a small file rewritten in place within one
# timestamp tick (same size, same times) is the one case a stat key cannot tell apart.
_HASHED: dict[tuple[int, ...], str] = {}
_CACHE_MIN_BYTES = 1 << 20
_RACY_NS = 50_000_000  # > the coarsest Linux file-time tick (10 ms at HZ=100)


def _key(st: os.stat_result) -> tuple[int, ...] | None:
    if st.st_size < _CACHE_MIN_BYTES:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _remember(path: Path, digest: str) -> str:
    key = _key(os.stat(path))
    if key is not None:
        _HASHED[key] = digest
    return digest


def _known(path: Path) -> str | None:
    key = _key(os.stat(path))
    return None if key is None else _HASHED.get(key)


def sha256_file(path: Path, cancel: threading.Event | None = None) -> str:
    """The file's sha256; `cancel` set stops it within a chunk (CancelledError)."""
    known = _known(path)
    if known is not None:
        return known
    started = time.time_ns()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            if cancel is not None and cancel.is_set():
                raise CancelledError(f"hashing {path} was cancelled")
            h.update(chunk)
    st = os.stat(path)
    if started - st.st_ctime_ns < _RACY_NS:
        # changed within a timestamp tick of our read (git's "racy clean" case): a rewrite
        # now could keep every stat field, so this hash is not remembered
        return h.hexdigest()
    return _remember(path, h.hexdigest())


def copy_hashed(src: Path, dst: Path) -> str:
    """Copy a file and know its sha256 after: when this process already hashed `src` (the
    quantize stage's outputs are hashed as the stage completes or is verified), the kernel
    copies it (sendfile, no user-space pass) and the hash carries over; otherwise copy and
    hash in the same pass (one read instead of two)."""
    known = _known(src)
    if known is not None:
        shutil.copyfile(src, dst)
        shutil.copystat(src, dst)
        return _remember(dst, known)
    h = hashlib.sha256()
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(_CHUNK):
            h.update(chunk)
            fout.write(chunk)
    shutil.copystat(src, dst)
    return _remember(dst, h.hexdigest())


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link `src` to `dst` (same inode, so its known hash carries over for free); copy
    when they are on different file systems or links are not allowed."""
    known = _known(src)
    try:
        os.link(src, dst)
    except OSError:
        copy_hashed(src, dst)
        return
    if known is not None:  # a new link changes the inode's ctime, not its bytes
        _remember(dst, known)


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def pause_point(point: str) -> None:
    """Test hook: QUANTIZE_PAUSE_AT=<point> sleeps here (after writing the point's name to
    QUANTIZE_PAUSE_MARKER), so that tests can kill a real run at a chosen place. With
    QUANTIZE_PAUSE_UNTIL=<file> it goes on as soon as that file exists (tests change the
    world at the point, e.g. fill the disk, then let the run continue)."""
    if os.environ.get("QUANTIZE_PAUSE_AT") == point:
        marker = os.environ.get("QUANTIZE_PAUSE_MARKER")
        if marker:
            Path(marker).write_text(point)
        deadline = time.monotonic() + float(os.environ.get("QUANTIZE_PAUSE_SECONDS", "3600"))
        until = os.environ.get("QUANTIZE_PAUSE_UNTIL")
        while time.monotonic() < deadline and not (until and os.path.exists(until)):
            time.sleep(0.05 if until else 1.0)


# --- the environment refusing a write ------------------------------------------------------
# errno -> what happened and the fix; the path is added by disk_error
_DISK_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EFBIG: "file too large",
}
# the same errors from code that does not raise OSError (the safetensors writer, in Rust,
# raises SafetensorError "... No space left on device (os error 28)")
_OS_ERROR = re.compile(r"(?:os error|Errno) (\d+)")
_STRERROR = {os.strerror(n): n for n in _DISK_ERRNOS}


def free_bytes(path: Path) -> int:
    """Free bytes (for this user) on the file system that holds, or will hold, `path`."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return int(shutil.disk_usage(path).free)


def disk_errno(exc: BaseException) -> int | None:
    """The errno when `exc` (or what caused it) is the environment refusing a write."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in _DISK_ERRNOS:
            return cur.errno
        text = str(cur)
        m = _OS_ERROR.search(text)
        if m and int(m.group(1)) in _DISK_ERRNOS:
            return int(m.group(1))
        for msg, n in _STRERROR.items():
            if msg in text:
                return n
        cur = cur.__cause__ or cur.__context__
    return None


def _fmt(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def disk_error(exc: BaseException, path: Path | str | None = None) -> DiskError | None:
    """A one-line DiskError naming the path and the fix, or None when `exc` is not a disk,
    quota, read-only or permission error. The path is the one the error names, else `path`."""
    code = disk_errno(exc)
    if code is None:
        return None
    named = getattr(exc, "filename", None) if isinstance(exc, OSError) else None
    known = named or path
    where: Path | str = (Path(os.path.abspath(known)) if known else
                         f"a file the error does not name ({first_line(exc)})")
    again = ("then re-run the same command: finished stages are kept and the run resumes "
             "(QUANTIZE_CACHE moves the model cache, --out the run folder)")
    if code in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"{_fmt(free_bytes(Path(where)))} free there" if known else "free unknown"
        except OSError:
            free = "free space unknown"
        problem = f"{_DISK_ERRNOS[code]} writing {where} ({free})"
        hint = f"free space on that file system or write somewhere larger, {again}"
    elif code == errno.EFBIG:  # SIGXFSZ is ignored by Python: a write past `ulimit -f`
        problem = (f"cannot write {where}: the file would exceed this process's file-size "
                   "limit (ulimit -f)")
        hint = f"raise the limit (`ulimit -f unlimited`), {again}"
    elif code == errno.EROFS:
        problem = f"cannot write {where}: it is on a read-only file system"
        hint = f"use a writable folder, {again}"
    else:
        problem = f"cannot access {where}: {_DISK_ERRNOS[code]}"
        hint = f"fix its permissions or use a folder you own, {again}"
    # the path sits inside the sentence, so the message is composed without the path prefix
    err = DiskError(compose(problem, hint), problem=problem, hint=hint,
                    path=where if known else None)
    err.errno = code  # type: ignore[attr-defined]
    return err


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _reraise(exc: OSError, path: Path) -> NoReturn:
    """Raise `exc` as a DiskError naming `path` when it is one, else as it is."""
    mapped = disk_error(exc, path)
    if mapped is not None:
        raise mapped from exc
    raise exc


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over `path`."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        _reraise(exc, path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            _reraise(exc, path)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def tmp_dir_for(final: Path) -> Path:
    return final.parent / f".{final.name}.partial"


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield an empty temporary folder; on success it replaces `final`, on error it is removed.

    A leftover `.NAME.partial` from a killed run is deleted first: never reused. Data files
    are not fsynced one by one (that cost seconds per GB): the manifest entry written after
    the rename holds every file's sha256, and a later run re-checks them before reusing a
    stage, so a file torn by a power loss is rebuilt, never trusted.

    A write the environment refuses (no space, quota, read-only, permission), in this
    process's code or an engine's, becomes a one-line DiskError naming the folder; the
    `.partial` is removed either way, so nothing half-written stays to fill the disk.
    """
    tmp = tmp_dir_for(final)
    try:
        # left by a killed run: a half-written folder, or the previous version a crash caught
        # between its two renames (the manifest then no longer matches: the stage is rebuilt)
        for stale in (tmp, final.parent / f".{final.name}.old"):
            if stale.exists():
                shutil.rmtree(stale)
        tmp.mkdir(parents=True)
    except OSError as exc:
        _reraise(exc, final.parent)
    try:
        yield tmp
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and not isinstance(exc, DiskError):
            mapped = disk_error(exc, final)
            if mapped is not None:
                raise mapped from exc
        raise
    replace_dir(tmp, final)


def replace_dir(tmp: Path, final: Path) -> None:
    """`tmp` becomes `final` by one rename; an existing `final` moves aside first and is
    removed after, so a reader sees the old folder or the new one, never a mix."""
    if final.exists():
        old = final.parent / f".{final.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)


def hash_files(paths: list[Path], cancel: threading.Event | None = None) -> list[str]:
    """sha256 of each path, several files at once: hashlib releases the GIL, so checkpoint
    shards hash in parallel (a 16 GB 8B checkpoint took 16 s on one thread, bench/).
    `cancel` set: every worker stops within a chunk and CancelledError is raised."""
    if len(paths) < 2:
        return [sha256_file(p, cancel) for p in paths]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(16, len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda p: sha256_file(p, cancel), paths))



# A child interpreter that prints one file's sha256: isolated (-I) and without site
# packages (-S), it starts in about 10 ms.
_HASH_CHILD = ("import hashlib, sys\nh = hashlib.sha256()\nwith open(sys.argv[1], 'rb') as f:\n"
               "    while b := f.read(1 << 20):\n        h.update(b)\nprint(h.hexdigest())")


class HashWhileWriting:
    """Hash each file as soon as a writer finishes it, in a child process, while the writer
    goes on with the next: `add(path)` after a file is closed, `finish()` once all are.

    Why a process and not a thread: safetensors holds the GIL for the whole write of a
    shard, so a hashing thread would wait for it (transformers says so at its shard loop).
    Measured on the H200 host: hashing an 8.5 GB fp8 checkpoint after the save took 1.4 s
    of the fp8-dynamic run's 16.3 s (bench/RESULTS.md). The digests land in the same
    per-process memory `sha256_file` reads (keyed by the file's stat), so the stage's
    `hash_tree` after the rename finds them and reads nothing again. A digest is kept only
    when the file's stat key is the same after the child as when it was handed over; the
    files are written into the stage's own `.partial` folder under the run lock, so no other
    writer can touch them within one timestamp tick (the racy case `sha256_file` guards).
    A child that fails just leaves the file to be hashed the usual way."""

    def __init__(self) -> None:
        self._jobs: list[tuple[Path, tuple[int, ...], subprocess.Popen[bytes]]] = []

    def add(self, path: Path | str) -> None:
        path = Path(path)
        try:
            key = _key(os.stat(path))
        except OSError:
            return
        if key is None:
            return  # small files are always re-read (see _CACHE_MIN_BYTES)
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _HASH_CHILD, str(path)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._jobs.append((path, key, proc))

    def finish(self) -> int:
        """Wait for the children and keep their digests; returns how many were kept."""
        kept = 0
        for path, key, proc in self._jobs:
            out, _ = proc.communicate()
            digest = out.decode().strip()
            try:
                same = _key(os.stat(path)) == key
            except OSError:
                same = False
            if proc.returncode == 0 and same and re.fullmatch(r"[0-9a-f]{64}", digest):
                _HASHED[key] = digest
                kept += 1
        self._jobs.clear()
        return kept

    def cancel(self) -> None:
        for _, _, proc in self._jobs:
            proc.kill()
            proc.wait()
        self._jobs.clear()


@contextlib.contextmanager
def hashed_while_written(module: Any, name: str) -> Iterator[HashWhileWriting]:
    """Wrap the writer function `module.name(obj, filename, ...)` for the duration so that
    each file it writes is hashed in the background (HashWhileWriting). When `module` has
    no such function (another library version), files are simply hashed later."""
    hashes = HashWhileWriting()
    original: Callable[..., Any] | None = getattr(module, name, None)
    if original is None:
        yield hashes
        return

    def writer(obj: Any, filename: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(obj, filename, *args, **kwargs)
        hashes.add(filename)
        return result

    setattr(module, name, writer)
    try:
        yield hashes
    except BaseException:
        hashes.cancel()
        raise
    else:
        hashes.finish()
    finally:
        setattr(module, name, original)


def hash_tree(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, keyed by its relative POSIX path."""
    files = [p for p in sorted(folder.rglob("*")) if p.is_file()]
    return dict(zip([p.relative_to(folder).as_posix() for p in files], hash_files(files),
                    strict=True))


def check_tree(folder: Path, expected: dict[str, str], what: str) -> None:
    """Refuse a folder whose files are missing, truncated or changed (ExportError, `path`)."""
    def refuse(where: Path, problem: str, hint: str) -> ExportError:
        return ExportError(compose(problem, hint, f"{what}: {where}", None, " "),
                           problem=problem, hint=hint, path=where)
    if not folder.is_dir():
        raise refuse(folder, "is missing", "re-run the stage that makes it")
    actual = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    if missing := sorted(set(expected) - actual):
        raise refuse(folder, f"lacks {missing[:3]}", "it is incomplete - delete it and re-run")
    for rel, digest in expected.items():
        if sha256_file(folder / rel) != digest:
            raise refuse(folder / rel, "does not match its recorded sha256 (changed or "
                         "truncated)", "delete it and re-run")
