"""One rank of data-parallel calibration, started by torchrun (quantize.backends.distributed):

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m quantize.backends._ddp_worker JOB.json

Reads the job, joins the process group (NCCL on GPUs, one GPU per rank; gloo on CPU), loads
the model (rank 0 reads, the others receive), calibrates on its slice of the samples, and
saves (rank 0 writes). Next to JOB.json rank 0 writes result.json; a failing rank writes
error-<rank>.json with its error line, so the parent can name the cause.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def init_process_group(device: str) -> str:
    """What compressed_tensors.offload.init_dist does (one device per local rank), plus gloo
    for CPU runs and a long timeout: a rank waits at a collective while another solves its
    modules."""
    import datetime

    import torch
    import torch.distributed as dist

    from quantize.backends.distributed import TIMEOUT_S

    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    if device == "cpu":
        dist.init_process_group("gloo", timeout=timeout)
        return "gloo"
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local))
    dist.barrier()
    return "nccl"


def _gather_peaks(rank: int, world_size: int, device: str) -> list[dict[str, int | float]]:
    """Each rank's peak host RSS and GPU memory, gathered to every rank (the parent process
    sees none of it: the work happens in these processes)."""
    import resource

    import torch
    import torch.distributed as dist

    gib = 2**30
    mine: dict[str, int | float] = {"rank": rank, "peak_rss_gib": round(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib, 2)}
    if device != "cpu":
        mine["gpu_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / gib, 2)
        mine["gpu_peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / gib, 2)
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, mine)
    return out


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def run(job_file: Path, rank: int, world_size: int) -> None:
    from transformers import AutoTokenizer

    from quantize.backends import llmcompressor as llmc
    from quantize.backends.distributed import job_from_dict, partition, shares

    job, out = job_from_dict(json.loads(job_file.read_text()))
    backend = init_process_group(job.device)
    llmc.prepare_engine(distributed=True)
    start, end = partition(len(job.samples), rank, world_size)
    src_dtype, dtype = llmc.dtypes(job)
    tokenizer = AutoTokenizer.from_pretrained(job.model_path)
    t0 = time.perf_counter()
    model = llmc.load_model(job, dtype)
    t1 = time.perf_counter()
    llmc.calibrate(model, tokenizer, job, job.samples[start:end],
                   out.parent / "logs" / f"rank{rank}")
    t2 = time.perf_counter()
    llmc.save(model, tokenizer, out, dtype, src_dtype, write=rank == 0,
              disk=job.host_tier == "disk")
    per_process = _gather_peaks(rank, world_size, job.device)
    if rank == 0:
        _write(job_file.parent / "result.json", llmc.summary(job, dtype, src_dtype) | {
            "processes": world_size, "process_group": backend,
            "samples_per_process": shares(len(job.samples), world_size),
            "per_process": per_process,
            "load_s": round(t1 - t0, 1), "oneshot_s": round(t2 - t1, 1),
            "save_s": round(time.perf_counter() - t2, 1)})


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    job_file = Path(args[0])
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    import torch.distributed as dist

    try:
        run(job_file, rank, world_size)
    except BaseException as exc:  # report every failure, with the rank, for the parent
        from quantize.errors import first_line

        _write(job_file.parent / f"error-{rank}.json", {
            "rank": rank, "time": time.time(), "error": f"{type(exc).__name__}: "
            f"{first_line(exc)}", "traceback": traceback.format_exc()[-8000:]})
        traceback.print_exc()
        sys.stderr.flush()
        # no destroy_process_group: the other ranks may sit in a collective it would wait
        # for; exiting lets torchrun stop them
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
