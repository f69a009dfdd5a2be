"""Runs the GPU check's jobs on a machine's GPUs in parallel, in order, within a deadline.

Each line of the job file is ``name|estimated seconds|GPUs needed|shell command``. Jobs start
in file order: the next job waits until enough GPUs are free, and is skipped (said so in the log)
when its estimate no longer fits before the deadline. Each runs with ``CUDA_VISIBLE_DEVICES`` set
to the GPUs it holds, its output in ``<logs>/<name>.log``, and is killed at the deadline. One JSON
line per job goes to ``--log``: name, GPUs, exit status, seconds, and the log's tail on failure.

Usage: python3 tools/gpu_jobs.py --gpus 0,1 --deadline-s 540 --log OUT/jobs.log --logs DIR jobs.txt
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import time

GRACE_S = 5  # the scheduler's own margin before the caller's limit


@dataclasses.dataclass
class Job:
    name: str
    estimate_s: float
    gpus_needed: int
    command: str


@dataclasses.dataclass
class Running:
    job: Job
    gpus: list[str]
    process: subprocess.Popen
    started: float


def parse_jobs(text: str) -> list[Job]:
    jobs = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, estimate, gpus, command = line.split("|", 3)
        jobs.append(Job(name.strip(), float(estimate), int(gpus), command.strip()))
    return jobs


def tail(path: pathlib.Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run(jobs: list[Job], gpus: list[str], deadline: float, log: pathlib.Path, logs: pathlib.Path) -> int:
    logs.mkdir(parents=True, exist_ok=True)
    free = list(gpus)
    running: list[Running] = []
    pending = list(jobs)
    failures = 0

    def record(entry: dict) -> None:
        with log.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        print("gpu_jobs:", json.dumps({k: v for k, v in entry.items() if k != "tail"}), flush=True)

    while pending or running:
        now = time.monotonic()
        for r in list(running):
            code = r.process.poll()
            if code is None and now < deadline:
                continue
            if code is None:  # past the deadline: stop it and everything it started
                os.killpg(r.process.pid, 9)
                code = r.process.wait()
                code = "killed at deadline"
            running.remove(r)
            free.extend(r.gpus)
            entry = {"job": r.job.name, "gpus": ",".join(r.gpus), "rc": code, "seconds": round(now - r.started, 1)}
            if code != 0:
                failures += 1
                entry["tail"] = tail(logs / f"{r.job.name}.log")
            record(entry)
        while pending:
            job = pending[0]
            if job.gpus_needed > len(gpus):
                record({"job": job.name, "rc": "skipped", "why": f"needs {job.gpus_needed} GPUs, has {len(gpus)}"})
                pending.pop(0)
                continue
            if now + job.estimate_s > deadline:
                record({"job": job.name, "rc": "skipped", "why": f"estimate {job.estimate_s:.0f} s past the deadline"})
                pending.pop(0)
                continue
            if len(free) < job.gpus_needed:
                break
            pending.pop(0)
            held, free = free[: job.gpus_needed], free[job.gpus_needed :]
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(held), GPU_JOB=job.name)
            with (logs / f"{job.name}.log").open("w") as out:
                process = subprocess.Popen(["bash", "-c", job.command], env=env, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True)
            running.append(Running(job, held, process, now))
            print(f"gpu_jobs: started {job.name} on GPU {','.join(held)}", flush=True)
        time.sleep(0.5)
    return failures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jobs", type=pathlib.Path)
    p.add_argument("--gpus", required=True, help="comma-separated GPU indices to share out")
    p.add_argument("--deadline-s", type=float, required=True, help="seconds from now by which every job ends")
    p.add_argument("--log", type=pathlib.Path, required=True)
    p.add_argument("--logs", type=pathlib.Path, required=True, help="folder for each job's output")
    args = p.parse_args()
    deadline = time.monotonic() + args.deadline_s - GRACE_S
    failures = run(parse_jobs(args.jobs.read_text()), args.gpus.split(","), deadline, args.log, args.logs)
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
