"""`python -m bench`: the one way to measure, and the one way results reach the docs.

    python -m bench JOB.yaml [--out DIR] [--work DIR]   # run a job (bench/jobs/), append
                                                         # its records to DIR/JOB.jsonl
    python -m bench JOB.yaml --gpu-carry                 # print what the GPU machine needs
                                                         # and the device command for the job
    python -m bench add FILE.jsonl...                    # records back from the GPU machine
    python -m bench render [--check]                     # regenerate the results tables
    python -m bench import [--run-folder DIR --job J --row R]   # raw files into records
    python -m bench list                                 # the job files
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd = argv[0]
    if cmd == "render":
        from bench import render

        return render.main(argv[1:])
    if cmd == "add":
        from bench import records

        for p in records.add([Path(x) for x in argv[1:]]):
            print(f"appended to {p}")
        return 0
    if cmd == "import":
        from bench import legacy

        p = argparse.ArgumentParser(prog="python -m bench import")
        p.add_argument("--run-folder", type=Path)
        p.add_argument("--job", default="make-quantize-cpu")
        p.add_argument("--row", default="cold")
        a = p.parse_args(argv[1:])
        out = [legacy.run_folder(a.run_folder, a.job, a.row)] if a.run_folder \
            else legacy.import_all()
        print("\n".join(str(x) for x in dict.fromkeys(out)))
        return 0
    if cmd == "list":
        from bench.jobs import all_jobs

        for name, job in all_jobs().items():
            print(f"{name:<26} {job.driver:<15} {job.device:<5} {job.description[:70]}")
        return 0
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", help="a job file, or a job name in bench/jobs/")
    p.add_argument("--out", type=Path, default=None,
                   help="where JOB.jsonl goes (default bench/results; $OUT on the GPU)")
    p.add_argument("--work", type=Path, default=None,
                   help="keep the drivers' logs and outputs here (default: a temp folder)")
    p.add_argument("--gpu-carry", action="store_true",
                   help="print the .whl/ state and the device command that runs this job")
    a = p.parse_args(argv)
    from bench import gpu, records
    from bench.jobs import load_job

    job = load_job(a.job)
    if a.gpu_carry:
        print(gpu.carry_report(a.job, records.quantize_commit()))
        return 0
    from bench import runner

    path = runner.run_job(job, a.out or records.RESULTS, a.work)
    print(f"records appended to {path}; `python -m bench render` updates the tables")
    return 0


if __name__ == "__main__":
    sys.exit(main())
