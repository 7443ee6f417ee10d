"""Kernel-held locks: one owner per run folder, one writer per shared cache entry.

The lock is `fcntl.flock` on a file: the kernel releases it when its owner exits, however it
exits (SIGKILL included), so there is no stale lock to detect and clear, and no window in
which two processes that both found a stale lock each take it (the defect of the earlier
create-exclusive-then-write-pid lock: tests/unit/run/test_lock.py starts racing processes
on a folder holding a stale lock and checks that no two are ever inside at once).

Why not `filelock.FileLock`: it opens the lock file with O_TRUNC, so every refused
contender would wipe the pid the owner wrote there, and the refusal could no longer say which
process holds the folder. The owner's pid is written after the lock is taken, for messages
and for people; it is never what decides ownership.

The lock file of a run folder is removed on release, so that a folder whose run wrote
nothing can be removed again. Removing a held lock file is safe only because a taker checks,
after flock succeeds, that the path still names the inode it locked (else it retries on the
new file): a process that opened the old file before it was unlinked never owns the folder.

The lock file is opened without following a link (O_NOFOLLOW) and must be a regular file:
a `.lock` planted as a link to another file would otherwise be truncated, as would a FIFO or
a device. A run folder that is a file, a folder in which no file can be made (/proc), or a
`.lock` that is a folder, is refused in one line (DiskError) before anything is written.
Taking a run folder's lock also removes what killed writers left there (`sweep_leftovers`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from quantize.errors import DiskError, LockedError, compose
from quantize.run.files import disk_error

LOCK_NAME = ".lock"
# What a writer of a run folder leaves only when it was killed: a stage's `.NAME.partial`
# folder, the `.NAME.old` one a crash caught between atomic_dir's renames (or after its
# last), the manifest's atomic write `.manifest.json.XXXX.tmp`. None is valid once the
# folder's lock is taken.
_LEFTOVER_DIR = re.compile(r"^\.[a-z][a-z0-9_-]*\.(partial|old)$")
_LEFTOVER_FILE = re.compile(r"^\.manifest\.json\.[^/]+\.tmp$")


def private_dir(path: Path) -> None:
    """Create `path` (or tighten it) with user-only permissions (0o700): for folders that
    hold what was fetched or published with the user's Hub token."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)


def _holder(path: Path, settle_s: float = 0.0) -> str:
    """Who holds the lock, as its pid. The holder writes its pid just after taking the lock,
    so a waiter that came at that moment reads an empty file: `settle_s` gives it that long
    for the pid to appear (a holder that died first leaves none: "another process")."""
    deadline = time.monotonic() + settle_s
    while True:
        try:
            pid = path.read_text().strip()
        except OSError:
            pid = ""
        if pid.isdigit():
            return f"process {pid}"
        if time.monotonic() >= deadline:
            return "another process"
        time.sleep(0.01)


def _take(path: Path, *, wait_s: float,
          refused: Callable[[str], tuple[str, str]] | None = None,
          on_wait: Callable[[str], None] | None = None) -> int:
    """An open fd of `path` holding an exclusive flock; LockedError after `wait_s` (the run
    folder as `path`, or with `refused(holder)`'s problem and hint, the lock file).
    `on_wait(holder)` is called once, when the lock is first found held."""
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        fd = _open_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                holder = _holder(path)
                if refused is None:
                    raise LockedError(path=path.parent, path_sep=" ",
                                      problem=f"is in use by {holder}",
                                      hint="wait for it to finish or use another --out folder"
                                      ) from None
                problem, hint = refused(holder)  # the lock file sits inside the sentence
                raise LockedError(compose(problem, hint), problem=problem, hint=hint,
                                  path=path) from None
            if on_wait is not None and not waited:
                on_wait(_holder(path, settle_s=0.5))
            waited = True
            time.sleep(0.05)
            continue
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the file was removed (released) after we opened it: take the new one


def _open_lock(path: Path) -> int:
    """The lock file opened for writing, never through a link; only a regular file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        if exc.errno in (errno.EISDIR, errno.ELOOP, errno.ENXIO):
            raise _not_a_lock(path, "a folder" if exc.errno == errno.EISDIR else
                              "a link" if exc.errno == errno.ELOOP else "a special file"
                              ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _not_a_lock(path, "a special file (a FIFO or device)")
    return fd


def _write_pid(fd: int) -> None:
    """The owner's pid, for messages and people only (a full disk may refuse even that)."""
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)


def _not_a_lock(path: Path, what: str) -> DiskError:
    problem = f"is {what}, not a lock file"
    hint = "remove it (no run keeps anything there) and re-run"
    return DiskError(compose(problem, hint, str(path), None, " "), problem=problem, hint=hint,
                     path=path)


@contextlib.contextmanager
def _disk_errors(path: Path) -> Iterator[None]:
    """A refused write as one line: no space, read-only, permission (disk_error), or a folder
    where no file can be made (a file, /proc, /dev/null)."""
    try:
        yield
    except OSError as exc:
        mapped = disk_error(exc, path)
        if mapped is None:
            where = exc.filename or path
            problem = (f"cannot create {where} ({exc.strerror or type(exc).__name__}): it is "
                       "not in a folder files can be written to")
            hint = "give a folder on a writable file system (--out for a run folder)"
            raise DiskError(compose(problem, hint), problem=problem, hint=hint,
                            path=where) from exc
        raise mapped from exc


def _check_folder(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        problem = "is a file, not a folder" if run_dir.is_file() else "is not a folder"
        hint = "give --out a new folder or a run folder"
        raise DiskError(compose(problem, hint, str(run_dir), None, " "), problem=problem,
                        hint=hint, path=run_dir)


def sweep_leftovers(folder: Path) -> list[str]:
    """Remove what killed writers left in the run folder `folder` (called holding its lock):
    a `.export.old` beside an export that is up to date is never rebuilt, so nothing else
    would ever remove it. Only in a run folder (it has a manifest.json: `--out ~` never loses
    a `.something.old` of the user's), only those names. Returns the names removed."""
    gone: list[str] = []
    if not (folder / "manifest.json").is_file():
        return gone
    with contextlib.suppress(OSError):
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if entry.is_dir(follow_symlinks=False) and _LEFTOVER_DIR.match(entry.name):
                shutil.rmtree(entry.path, ignore_errors=True)
            elif entry.is_file(follow_symlinks=False) and _LEFTOVER_FILE.match(entry.name):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
            else:
                continue
            gone.append(entry.name)
    return gone


def _release(fd: int, path: Path, *, remove: bool) -> None:
    if remove:
        with contextlib.suppress(OSError):  # gone, or a folder turned read-only meanwhile
            path.unlink()  # while still held: a later taker's inode check sees the new file
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


@contextlib.contextmanager
def run_lock(run_dir: Path, *, private: bool = False) -> Iterator[None]:
    """Own the run folder for the duration; a second live process is refused at once.

    `private` makes the folder user-only (0o700). A folder this call created is removed again
    when the run wrote nothing into it (a refused input leaves no empty run folder behind).
    """
    created = not run_dir.exists()
    path = run_dir / LOCK_NAME
    _check_folder(run_dir)
    with _disk_errors(run_dir):  # a read-only or full output folder: one line, not a crash
        if private:
            private_dir(run_dir)
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
        fd = _take(path, wait_s=0.0)
    _write_pid(fd)
    sweep_leftovers(run_dir)
    try:
        yield
    finally:
        _release(fd, path, remove=True)
        if created:
            with contextlib.suppress(OSError):
                run_dir.rmdir()  # only succeeds when empty


def _say_waiting(what: str, path: Path) -> Callable[[str], None]:
    def say(holder: str) -> None:
        from quantize.progress import info

        info(f"waiting for {holder} to finish {what} (lock {path}; it is released the moment "
             "that process exits, however it exits)")

    return say


@contextlib.contextmanager
def entry_lock(path: Path, *, what: str = "writing a cache entry",
               wait_s: float = 6 * 3600) -> Iterator[None]:
    """Serialise writers of one shared cache entry (`path` is the entry's lock file): a
    second process says what it waits for (`what`, the holder's pid), waits, then finds the
    entry made. A dead holder's lock is gone with it (the kernel drops a process's flocks on
    exit, SIGKILL included). The file stays (removing it would let a waiter that opened
    it lock an orphan inode while a newcomer locks a new file)."""
    with _disk_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _take(path, wait_s=wait_s, on_wait=_say_waiting(what, path),
                   refused=lambda holder: (f"gave up waiting for {holder} to finish {what} "
                                           f"after {wait_s:.0f} s (lock {path})",
                                           "if it is stuck, stop it and re-run"))
    _write_pid(fd)  # for the waiters' message only
    try:
        yield
    finally:
        _release(fd, path, remove=False)
