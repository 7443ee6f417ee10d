"""The files of one upload, pinned: each staged file opened once, without following links,
and hashed again through that descriptor just before any request; what the Hub client then
reads is that same open file (`/proc/self/fd/N`, or the file object where there is no /proc),
so a file renamed or linked over its path after the check is never what goes up.

A file whose bytes no longer hash to the digest the run manifest recorded (or publish wrote,
for the card and the raw results), and a staged folder holding anything else, are refused
before the first request: nothing is uploaded.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from quantize.stages.publish.messages import refused
from quantize.stages.publish.nofollow import open_file, parts_of, regular_files, sha256_fd

if TYPE_CHECKING:
    from huggingface_hub import CommitOperationAdd

_PROC_FD = Path("/proc/self/fd")


class Pinned:
    """rel path → (open descriptor, size, sha256) of every file of the upload."""

    def __init__(self, fds: dict[str, int], plan: dict[str, tuple[int, str]]) -> None:
        self.fds, self.plan = fds, plan

    def ops(self) -> list[CommitOperationAdd]:
        """One add operation per file, reading the pinned descriptor (new ones per attempt:
        the client keeps state on them); the sha256 is the one checked, so the client does
        not read the file again to hash it."""
        from huggingface_hub import CommitOperationAdd

        out = []
        for rel in sorted(self.fds):
            fd = self.fds[rel]
            source: str | io.BufferedReader
            if _PROC_FD.is_dir():
                source = str(_PROC_FD / str(fd))
            else:  # no /proc: a file object over the same descriptor (no Xet upload then)
                source = io.BufferedReader(io.FileIO(os.dup(fd), "rb"))
            op = CommitOperationAdd(path_in_repo=rel, path_or_fileobj=source)
            op.upload_info.sha256 = bytes.fromhex(self.plan[rel][1])
            out.append(op)
        return out


def _hash_all(fds: dict[str, int]) -> dict[str, tuple[int, str]]:
    if len(fds) < 2:
        return {rel: sha256_fd(fd) for rel, fd in fds.items()}
    from concurrent.futures import ThreadPoolExecutor

    rels = sorted(fds)
    with ThreadPoolExecutor(max_workers=min(16, len(rels), os.cpu_count() or 1)) as pool:
        return dict(zip(rels, pool.map(lambda r: sha256_fd(fds[r]), rels), strict=True))


@contextmanager
def pinned(root: Path, folder: tuple[str, ...], plan: dict[str, tuple[int, str]]
           ) -> Iterator[Pinned]:
    """Open and re-hash every file of `plan` (rel path → (size, sha256)) under the staged
    folder `root/folder...`; refuse any mismatch, and any file the plan does not name."""
    here = root.joinpath(*folder)
    extra = sorted(regular_files(root, folder) - set(plan))
    if extra:
        raise refused(f"{here / extra[0]} is not a file publish staged",
                      "remove it and run publish again", here / extra[0])
    fds: dict[str, int] = {}
    try:
        for rel in sorted(plan):
            fds[rel] = open_file(root, (*folder, *parts_of(rel, here)))
        for rel, (size, sha) in _hash_all(fds).items():
            if (size, sha) != plan[rel]:
                raise refused(f"{here / rel} changed after publish checked it (its sha256 is "
                              "not the one the run recorded)", "nothing was uploaded; run "
                              "publish again (if the export really changed, re-run `quantize "
                              "run`)", here / rel)
        yield Pinned(fds, plan)
    finally:
        for fd in fds.values():
            os.close(fd)
