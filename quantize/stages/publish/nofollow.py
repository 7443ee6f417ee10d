"""Reading a run folder for release without following links.

Below the run folder every path component is checked with lstat and opened with O_NOFOLLOW
(a symbolic link anywhere inside the run is refused, never followed); a file must be a
regular file (no FIFO, socket or device: they are refused before they are opened); a path a
manifest lists must be a plain relative path (no `..`, no absolute path, no empty part). A
hard link is the file itself: its bytes must still hash to what the manifest recorded.

The run folder itself (the user's argument) may be reached through links; nothing below it.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path

from quantize.errors import PublishError
from quantize.stages.publish.messages import refused

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC
_FILE = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC
_CHUNK = 8 << 20
_FIX = ("publish uploads only the regular files the run wrote, never through a link: remove "
        "it and re-run the stage that writes it")


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a folder" if stat.S_ISDIR(mode) else "not a regular file"


def _not_regular(path: Path, mode: int) -> PublishError:
    return refused(f"{path} is {_kind(mode)}", _FIX, path)


def parts_of(rel: str, listed_in: Path) -> tuple[str, ...]:
    """The parts of a relative path a manifest lists; refused when it could leave its folder
    or name something odd (absolute, `..`, `.`, empty parts, backslashes, control bytes)."""
    parts = tuple(rel.split("/"))
    if (not rel or rel.startswith("/") or "\\" in rel or any(ord(c) < 32 for c in rel)
            or any(p in ("", ".", "..") for p in parts)):
        raise refused(f"{listed_in} lists {rel!r}, which is not a plain path inside its folder",
                      "the manifest was edited: re-run the stage that wrote it", listed_in)
    return parts


def _open_dir(dfd: int, name: str, path: Path) -> int:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        raise refused(f"{path} is missing", "re-run the stage that writes it", path) from None
    if not stat.S_ISDIR(st.st_mode):
        raise _not_regular(path, st.st_mode) if stat.S_ISLNK(st.st_mode) else \
            refused(f"{path} is not a folder", _FIX, path)
    try:
        return os.open(name, _DIR, dir_fd=dfd)
    except OSError:  # replaced by a link (ELOOP/ENOTDIR) since the lstat
        raise refused(f"{path} changed while publish read it", _FIX, path) from None


def open_file(root: Path, parts: Sequence[str]) -> int:
    """An O_NOFOLLOW descriptor of the regular file `root/parts...`, each folder on the way
    opened without following links (the caller closes it)."""
    dfd = os.open(root, _DIR & ~_NOFOLLOW)
    try:
        here = root
        for name in parts[:-1]:
            here = here / name
            nfd = _open_dir(dfd, name, here)
            os.close(dfd)
            dfd = nfd
        path = here / parts[-1]
        try:
            st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            raise refused(f"{path} is missing", "re-run the stage that writes it",
                          path) from None
        if not stat.S_ISREG(st.st_mode):  # refused before an open could block (FIFO)
            raise _not_regular(path, st.st_mode)
        try:
            fd = os.open(parts[-1], _FILE, dir_fd=dfd)
        except OSError:
            raise refused(f"{path} changed while publish read it", _FIX, path) from None
    finally:
        os.close(dfd)
    got = os.fstat(fd)
    if not stat.S_ISREG(got.st_mode) or (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise refused(f"{path} changed while publish read it", _FIX, path)
    return fd


def sha256_fd(fd: int) -> tuple[int, str]:
    """(size, sha256) of an open file, read from its start whatever its offset."""
    h, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, _CHUNK, offset):
        h.update(chunk)
        offset += len(chunk)
    return offset, h.hexdigest()


def read_file(root: Path, parts: Sequence[str], limit: int = 64 << 20) -> bytes:
    """The bytes of a small regular file below `root`, read without following links."""
    fd = open_file(root, parts)
    try:
        if os.fstat(fd).st_size > limit:
            path = root.joinpath(*parts)
            raise refused(f"{path} is larger than {limit >> 20} MiB", "re-run its stage", path)
        out, offset = b"", 0
        while chunk := os.pread(fd, _CHUNK, offset):
            out += chunk
            offset += len(chunk)
        return out
    finally:
        os.close(fd)


def regular_files(root: Path, parts: Sequence[str]) -> set[str]:
    """Every regular file under the folder `root/parts...` (relative POSIX paths); anything
    else in it (a link, FIFO, socket or device), and a link on the way to it, is refused."""
    dfd = os.open(root, _DIR & ~_NOFOLLOW)
    try:
        here = root
        for name in parts:
            here = here / name
            nfd = _open_dir(dfd, name, here)
            os.close(dfd)
            dfd = nfd
        return _walk(dfd, here, "")
    finally:
        os.close(dfd)


def _walk(dfd: int, here: Path, prefix: str) -> set[str]:
    found: set[str] = set()
    with os.scandir(dfd) as entries:
        names = sorted((e.name, e.stat(follow_symlinks=False).st_mode) for e in entries)
    for name, mode in names:
        if stat.S_ISREG(mode):
            found.add(prefix + name)
        elif stat.S_ISDIR(mode):
            sub = _open_dir(dfd, name, here / name)
            try:
                found |= _walk(sub, here / name, f"{prefix}{name}/")
            finally:
                os.close(sub)
        else:
            raise _not_regular(here / name, mode)
    return found


def check_folders(root: Path, parts: Iterable[str]) -> None:
    """Each existing folder on the way from `root` down `parts` is a real folder, no link (a
    folder publish is about to write into); the first missing one ends the check."""
    here = root
    for name in parts:
        here = here / name
        try:
            st = here.lstat()
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            raise _not_regular(here, st.st_mode) if stat.S_ISLNK(st.st_mode) else \
                refused(f"{here} is not a folder", f"remove it; publish writes {here} itself",
                        here)
