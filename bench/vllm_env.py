"""vLLM's CUDA build for the lent GPU machine, which has torch 2.11.0 (CUDA 13) and no network.

vLLM 0.20.2 and 0.22-0.26 pin torch 2.11.0, so the registry's vllm 0.26.0 wheel runs on that
image as is; `../shared/vllm-gpu/wheels.txt` lists it and the 22 small wheels it needs beside
the image's packages (sha256, size, name). Here:

    python -m bench.vllm_env prepare --out .carry-src     # ~2 min: download, check, slim, xz

downloads them (flashinfer-python left out: optional on Hopper; the worker then turns
FlashInfer's sampler off), checks each against the list's sha256, installs them into one
folder for Python 3.12 / x86-64, drops the files an sm_90 GPU never loads (DROP, each with
the reason from vLLM's own source), and packs the folder as `vllm-site.tar.xz` (~121 MiB
against 321 MiB of wheels). bench/carry.py cuts it into parts for consecutive calls. There:

    python3 -m bench.vllm_env install --bundle /tmp/carry/members/vllm-site.tar.xz

makes `.venv-vllm/` in the checkout: a virtual environment whose site-packages holds the vLLM
folder, with a .pth line adding the image's own site-packages (torch 2.11) after it. It is
the folder `make vllm-env` makes on a machine with a network, so `quantize verify` and
`quantize eval --engine vllm` find it the same way (quantize.vllm.host.find_vllm_python).
vLLM bundles compressed-tensors 0.17.0; the quantizing side keeps its 0.19.0 in its own
folder (PYTHONPATH), which the vLLM worker never sees (quantize.vllm.host.run_worker drops
PYTHONPATH).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS_TXT = ROOT.parent / "shared" / "vllm-gpu" / "wheels.txt"
OPTIONAL = ("flashinfer_python",)  # JIT kernels; vLLM picks FA3 and its own sampler without
PLATFORMS = ["manylinux_2_5_x86_64", "manylinux1_x86_64", "manylinux2014_x86_64",
             "manylinux_2_17_x86_64", "manylinux_2_24_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64"]
# Files an sm_90 (Hopper) GPU never loads, dropped to save ~170 MiB of transfer:
DROP = {
    # vllm_flash_attn/flash_attn_interface.py imports FA2 in a try block, and
    # v1/attention/backends/fa_utils.get_flash_attn_version picks FA3 on compute capability 9
    # (FA2 only for ALiBi, which no model measured here uses)
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": "FlashAttention 2; Hopper runs FA3",
    # envs.py: the Rust frontend runs only with VLLM_USE_RUST_FRONTEND=1
    "vllm/vllm-rs": "the optional Rust frontend (VLLM_USE_RUST_FRONTEND)",
    "vllm/third_party/fmha_sm100": "Blackwell (sm_100) attention only",
    "vllm/third_party/deep_gemm/_C.cpython-310-x86_64-linux-gnu.so": "Python 3.10 build",
    "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so": "Python 3.11 build",
    "vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so": "Python 3.13 build",
    "vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so": "Python 3.14 build",
}


def read_list(path: Path) -> list[tuple[str, int, str]]:
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            digest, size, name = line.split()
            rows.append((digest, int(size), name))
    return rows


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _fetch_exact(name: str, cache: Path) -> None:
    """One wheel file by its exact name, from PyPI's simple index (PEP 503; the sha256 is
    checked after)."""
    import re
    import urllib.request

    dist = re.sub(r"[-_.]+", "-", name.split("-")[0]).lower()
    with urllib.request.urlopen(f"https://pypi.org/simple/{dist}/", timeout=60) as r:
        page = r.read().decode()
    url = next((u for u in re.findall(r'href="([^"#]+)', page)
                if u.rsplit("/", 1)[-1] == name), None)
    if url is None:
        raise SystemExit(f"{name}: not in PyPI's index of {dist}")
    with urllib.request.urlopen(url, timeout=300) as r, (cache / name).open("wb") as f:
        shutil.copyfileobj(r, f, 1 << 22)


def prepare(out: Path, wheels_txt: Path, cache: Path, with_optional: bool) -> Path:
    rows = [r for r in read_list(wheels_txt)
            if with_optional or not r[2].startswith(OPTIONAL)]
    cache.mkdir(parents=True, exist_ok=True)
    missing = [name for digest, _, name in rows if not (cache / name).is_file()]
    if missing:
        specs = []
        for name in missing:  # "name-version-tags.whl" -> "name==version"
            dist, version = name.split("-")[:2]
            specs.append(f"{dist}=={version}")
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
               "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
               "-d", str(cache)]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        subprocess.run(cmd + specs, check=True)
    for name in missing:  # pip may pick another build of the same version: fetch the listed
        if not (cache / name).is_file():
            _fetch_exact(name, cache)
    for digest, _size, name in rows:
        got = sha256(cache / name)
        if got != digest:
            raise SystemExit(f"{name}: sha256 {got} is not the listed {digest} ({wheels_txt})")
    site = out / "vllm-site"
    shutil.rmtree(site, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
           "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
           "--target", str(site)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + [str(cache / name) for _, _, name in rows], check=True)
    dropped = {}
    for rel, why in DROP.items():
        p = site / rel
        if p.exists():
            dropped[rel] = why
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    facts = {"wheels": [name for _, _, name in rows], "dropped": dropped,
             "made": time.strftime("%Y-%m-%d %H:%M %Z")}
    (site / "QUANTIZE_VLLM_SITE.json").write_text(json.dumps(facts, indent=1))
    bundle = out / "vllm-site.tar.xz"
    # xz through the command line: two threads, ~1 min for the 400 MB folder
    with bundle.open("wb") as f:
        tar = subprocess.Popen(["tar", "-C", str(site), "-cf", "-", "."],
                               stdout=subprocess.PIPE)
        subprocess.run(["xz", "-T2", "-6", "-c"], stdin=tar.stdout, stdout=f, check=True)
        if tar.wait() != 0:
            raise SystemExit("tar failed")
    shutil.rmtree(site)
    print(json.dumps({"bundle": str(bundle), "bytes": bundle.stat().st_size,
                      "wheels": len(rows), "dropped": list(dropped)}))
    return bundle


def base_site_packages() -> Path:
    """The site-packages of the python running this (the image's, which holds torch)."""
    import torch

    return Path(torch.__file__).resolve().parent.parent


def install(bundle: Path, venv: Path) -> dict[str, str]:
    """A virtual environment at `venv` with the bundle in its site-packages and the running
    python's site-packages (torch) after it; the stamp `make vllm-env` writes, written last."""
    stamp = venv / ".installed"
    if not stamp.is_file():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        site = next((venv / "lib").glob("python3*/site-packages"))
        with tarfile.open(bundle, "r:xz") as tar:
            tar.extractall(site, filter="data")
        (site / "zz_image_site_packages.pth").write_text(f"{base_site_packages()}\n")
        stamp.write_text(f"{bundle.name}\n")
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    check = subprocess.run([str(py), "-c", "import torch, vllm, compressed_tensors as ct; "
                            "print(vllm.__version__, torch.__version__, ct.__version__)"],
                           capture_output=True, text=True, env=env)
    if check.returncode:
        raise SystemExit(f"vLLM does not import in {venv}: {check.stderr[-2000:]}")
    vllm_v, torch_v, ct_v = check.stdout.split()[-3:]
    return {"python": str(py), "vllm": vllm_v, "torch": torch_v, "compressed_tensors": ct_v}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--wheels-txt", type=Path, default=WHEELS_TXT)
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "quantize-vllm-gpu")
    p.add_argument("--with-optional", action="store_true", help="keep flashinfer-python")
    i = sub.add_parser("install")
    i.add_argument("--bundle", type=Path, required=True)
    i.add_argument("--venv", type=Path, default=ROOT / ".venv-vllm")
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        a.out.mkdir(parents=True, exist_ok=True)
        prepare(a.out, a.wheels_txt, a.cache, a.with_optional)
    else:
        print(json.dumps(install(a.bundle, a.venv)))


if __name__ == "__main__":
    main()
