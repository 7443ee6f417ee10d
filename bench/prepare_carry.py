"""Fill `.whl/` (git-ignored) with what the GPU machine lacks, on this machine:

- wheels for Python 3.12 / x86-64 of the engine and its missing dependencies (the GPU image
  has torch, transformers, accelerate, safetensors, tokenizers, pyarrow, pandas... but not
  llm-compressor, compressed-tensors, datasets, loguru or pydantic), about 4 MiB;
- the default model's tokenizer (the random-weight 8B model borrows it), 3.5 MiB;
- a snapshot of quantize/ as it is now, so a run measures the code that was checked here even
  while the working tree changes (bench/gpu.py child_env(snapshot=True) puts it first on the path).

  python -m bench.prepare_carry          # then: run(..., carry=[".whl"])
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".whl"
WHEELS = ["llmcompressor==0.14.0.1", "compressed-tensors==0.19.0", "datasets==5.2.0",
          "dill==0.4.1", "multiprocess==0.70.19", "loguru==0.7.3", "pydantic==2.14.4",
          "pydantic_core==2.50.5", "typing-inspection==0.4.5", "annotated-types==0.8.0",
          # lm-eval's HF path, for bench/eval_vs_lmeval.py (the image has its other needs)
          "lm_eval==0.4.13", "chardet==6.0.0.post1"]
# Everything `quantize run/export/eval` needs on the GPU image beyond what it has (torch 2.11,
# transformers 5.17, accelerate, safetensors, tokenizers, click, rich, psutil, matplotlib,
# huggingface-hub, scikit-learn, sacrebleu ...; KINDS.md's package list): 18 MiB, for
# bench/vllm_gpu.py. The last three are sources only on the registry (built here: pure Python).
ENGINE_WHEELS = [*WHEELS, "auto-round==0.15.1", "gguf==0.19.0", "evaluate==0.4.6",
                 "DataProperty==1.1.1", "mbstrdecoder==1.1.5", "more-itertools==11.2.1",
                 "nltk==3.10.4", "pathvalidate==3.3.1", "pytablewriter==1.2.1",
                 "pytz==2026.6", "tabledata==1.3.5", "tcolorpy==0.1.7", "typepy==1.3.5",
                 "defusedxml==0.7.1"]
BUILT_HERE = ["rouge_score==0.1.2", "sqlitedict==2.1.0", "word2number==1.1"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def download_wheels(dest: Path = CARRY, wheels: list[str] = WHEELS) -> None:
    """Wheels for Python 3.12 / x86-64 (the GPU image's) into dest; for ENGINE_WHEELS also
    the pure-Python ones the registry has as sources only, built here."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + wheels, check=True)
    if wheels is ENGINE_WHEELS:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                        str(dest), *BUILT_HERE], check=True)


def copy_tokenizer() -> None:
    from quantize.model.source import DEFAULT_DIR_NAME, cache_root, resolve_model

    src = cache_root() / "models" / DEFAULT_DIR_NAME
    if not (src / "tokenizer.json").is_file():
        print(f"{src} is missing: converting the default model once (about a minute); set "
              "QUANTIZE_CACHE to reuse an existing cache")
        src = resolve_model(None).path
    dst = CARRY / "smollm2-tokenizer"
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def snapshot_quantize() -> None:
    dst = CARRY / "quantize-src"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(ROOT / "quantize", dst / "quantize",
                    ignore=shutil.ignore_patterns("__pycache__"))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--short", "quantize"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    (dst / "SNAPSHOT.txt").write_text(f"{head}\n{dirty}\n{time.strftime('%c %Z')}\n")


def main() -> None:
    ignored = subprocess.run(["git", "check-ignore", "-q", ".whl/x"], cwd=ROOT).returncode == 0
    if not ignored:  # (a worktree's .git is a file: ask git rather than read info/exclude)
        sys.exit("add /.whl/ to .git/info/exclude first (wheels must never be committed)")
    CARRY.mkdir(exist_ok=True)
    download_wheels()
    copy_tokenizer()
    snapshot_quantize()
    size = sum(p.stat().st_size for p in CARRY.rglob("*") if p.is_file())
    print(f"{CARRY}: {size / 2**20:.1f} MiB (the limit for what travels is 64 MiB)")


if __name__ == "__main__":
    main()
