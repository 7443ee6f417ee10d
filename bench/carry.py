"""Files too big for one call of the GPU machine, sent as parts over consecutive calls.

A call carries at most 64 MiB (the working tree included), and the machine keeps what a call
left in /tmp only while it stays warm (30 s between calls). So a bundle of files (the vLLM
site, the engine's wheels, the default model's GGUF) is cut into numbered parts here, one
folder per part, each holding the part and the whole bundle's manifest (member names, sizes
and sha256; part names, sizes and sha256). There, each call hands its part to `receive`,
which checks the part's sha256 and keeps it; once every part is in, the members are cut back
out of the joined parts and each is checked against its own sha256. A part that arrives
twice, or a call repeated after a failure, changes nothing: `receive` resumes.

    python -m bench.carry pack --out .carry --part-mib 56 FILE...      # here
    python -m bench.carry receive --part .carry/p1 --into /tmp/carry    # there, once a call
    python -m bench.carry status --into /tmp/carry                       # there: what is in

`receive` prints one JSON line: {"state": "waiting", "have": [...], "missing": [...],
"members": {...}} or {"state": "complete", "members": {name: path}}; a member is listed (cut
out and checked) as soon as every part it spans is in. Exit status 1 on a checksum mismatch (the
bad part is deleted, so the same call can be made again).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
CHUNK = 1 << 22


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def pack(files: list[Path], out: Path, part_bytes: int) -> dict[str, Any]:
    """Cut the files, joined in order, into parts of at most `part_bytes` under out/pK/."""
    if part_bytes < 1:
        raise ValueError("part size must be positive")
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise ValueError(f"member names must be unique: {names}")
    members, offset = [], 0
    for f in files:
        size = f.stat().st_size
        members.append({"name": f.name, "size": size, "offset": offset,
                        "sha256": sha256_file(f)})
        offset += size
    total = offset
    count = max(1, -(-total // part_bytes))
    shutil.rmtree(out, ignore_errors=True)
    parts = []
    stream = _joined(files)
    for k in range(1, count + 1):
        folder = out / f"p{k}"
        folder.mkdir(parents=True)
        want = min(part_bytes, total - (k - 1) * part_bytes)
        h = hashlib.sha256()
        with (folder / "part").open("wb") as dst:
            left = want
            while left:
                block = stream.read(min(left, CHUNK))
                if not block:
                    raise RuntimeError("the files changed while they were packed")
                h.update(block)
                dst.write(block)
                left -= len(block)
        parts.append({"name": f"p{k}", "size": want, "sha256": h.hexdigest()})
    stream.close()
    manifest = {"members": members, "parts": parts, "total": total}
    for p in parts:
        (out / p["name"] / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


class _joined:
    """The files read one after another as one stream."""

    def __init__(self, files: list[Path]) -> None:
        self.files = list(files)
        self.current = None

    def read(self, n: int) -> bytes:
        while True:
            if self.current is None:
                if not self.files:
                    return b""
                self.current = self.files.pop(0).open("rb")
            block = self.current.read(n)
            if block:
                return block
            self.current.close()
            self.current = None

    def close(self) -> None:
        if self.current is not None:
            self.current.close()


def receive(part_dir: Path | None, into: Path) -> dict[str, Any]:
    """Keep one part (checked) and, once all are in, cut the members out (checked)."""
    parts_dir = into / "parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    if part_dir is not None:
        manifest = json.loads((part_dir / MANIFEST).read_text())
        mine = next(p for p in manifest["parts"] if p["name"] == part_dir.name)
        dst = parts_dir / mine["name"]
        if not dst.is_file() or dst.stat().st_size != mine["size"]:
            tmp = dst.with_suffix(".tmp")
            shutil.copyfile(part_dir / "part", tmp)
            if sha256_file(tmp) != mine["sha256"]:
                tmp.unlink()
                raise ChecksumError(f"part {mine['name']}: sha256 differs from the manifest")
            tmp.replace(dst)
        (into / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return status(into)


class ChecksumError(Exception):
    pass


def status(into: Path) -> dict[str, Any]:
    """What is in: each member is cut out (and checked) as soon as every part it spans has
    arrived, so a bundle's first members can be used while its last parts travel."""
    mf = into / MANIFEST
    if not mf.is_file():
        return {"state": "waiting", "have": [], "missing": ["(no part yet)"], "members": {}}
    manifest = json.loads(mf.read_text())
    members_dir = into / "members"
    if (into / "COMPLETE").is_file():
        return {"state": "complete",
                "members": {m["name"]: str(members_dir / m["name"])
                            for m in manifest["members"]}}
    parts = manifest["parts"]
    have = [p["name"] for p in parts if (into / "parts" / p["name"]).is_file()]
    ready: dict[str, str] = {}
    for m in manifest["members"]:
        dst = members_dir / m["name"]
        if not dst.is_file():
            if not all(p["name"] in have for p in _spanned(parts, m)):
                continue
            _extract(parts, m, into)
        ready[m["name"]] = str(dst)
    missing = [p["name"] for p in parts if p["name"] not in have]
    if len(ready) == len(manifest["members"]):
        shutil.rmtree(into / "parts")  # the disk is small there: keep the members only
        (into / "COMPLETE").write_text("\n".join(ready) + "\n")
        return {"state": "complete", "members": ready}
    return {"state": "waiting", "have": have, "missing": missing, "members": ready}


def _spanned(parts: list[dict[str, Any]], member: dict[str, Any]) -> list[dict[str, Any]]:
    """The parts that hold the member's bytes."""
    out, start = [], 0
    lo, hi = member["offset"], member["offset"] + member["size"]
    for p in parts:
        end = start + p["size"]
        if (start < hi and end > lo) or (member["size"] == 0 and start <= lo < end):
            out.append(p)
        start = end
    return out


def _extract(parts: list[dict[str, Any]], member: dict[str, Any], into: Path) -> None:
    dst = into / "members" / member["name"]
    dst.parent.mkdir(exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    h = hashlib.sha256()
    pos, lo, hi = 0, member["offset"], member["offset"] + member["size"]
    with tmp.open("wb") as out:
        for p in parts:
            end = pos + p["size"]
            a, b = max(lo, pos), min(hi, end)
            if a < b:
                with (into / "parts" / p["name"]).open("rb") as f:
                    f.seek(a - pos)
                    left = b - a
                    while left:
                        block = f.read(min(left, CHUNK))
                        if not block:
                            raise ChecksumError(f"member {member['name']}: part {p['name']} "
                                                "is short")
                        h.update(block)
                        out.write(block)
                        left -= len(block)
            pos = end
    if h.hexdigest() != member["sha256"]:
        tmp.unlink()
        raise ChecksumError(f"member {member['name']}: sha256 differs from the manifest")
    tmp.replace(dst)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--part-mib", type=float, default=56.0)
    p.add_argument("files", type=Path, nargs="+")
    r = sub.add_parser("receive")
    r.add_argument("--part", type=Path, required=True)
    r.add_argument("--into", type=Path, required=True)
    s = sub.add_parser("status")
    s.add_argument("--into", type=Path, required=True)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "pack":
            m = pack(a.files, a.out, int(a.part_mib * 2**20))
            print(json.dumps({"parts": [(p["name"], p["size"]) for p in m["parts"]],
                              "total": m["total"]}))
            return 0
        res = receive(a.part, a.into) if a.cmd == "receive" else status(a.into)
    except ChecksumError as exc:
        print(json.dumps({"state": "error", "error": str(exc)}))
        return 1
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
