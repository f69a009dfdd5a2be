"""Runs jobs on a machine's GPUs in parallel, in order, within a deadline (used by tools/gpu_check.py).

Jobs start in list order: the next job waits until enough GPUs are free, and is skipped (said so
in the log) when its estimate no longer fits before the deadline. A job with ``share`` N > 1 holds
one GPU together with up to N - 1 other jobs of the same ``share`` (training runs whose loss is
wanted, not their speed; each caps its own memory). Each runs with
``CUDA_VISIBLE_DEVICES`` set to the GPUs it holds, its output in ``<logs>/<name>.log``, and is
killed (with everything it started) at the deadline. One JSON line per job goes to the log file:
name, GPUs, exit status, seconds, and the output's tail on failure.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import time

GRACE_S = 5  # the scheduler's own margin before the caller's limit


@dataclasses.dataclass
class Job:
    """One command to run on ``gpus_needed`` GPUs.

    Attributes:
        name: unique name; also the name of its log file.
        estimate_s: rough seconds it takes (decides whether it still starts before the deadline).
        gpus_needed: how many GPUs it holds while it runs.
        argv: the command.
        cwd: the folder it runs in.
        env: variables added to this process's environment.
        share: how many jobs of this ``share`` may hold one GPU at once (1: the GPU is the job's alone;
            more needs ``gpus_needed`` 1).
    """

    name: str
    estimate_s: float
    gpus_needed: int
    argv: list[str]
    cwd: str = "/tmp"
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    share: int = 1

    def __post_init__(self):
        if self.share < 1 or (self.share > 1 and self.gpus_needed != 1):
            raise ValueError(f"gpu_jobs: job {self.name}: share {self.share} needs share >= 1, and one GPU when > 1")


@dataclasses.dataclass
class _Running:
    job: Job
    gpus: list[str]
    process: subprocess.Popen
    started: float


def tail(path: pathlib.Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a text file ("" when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def place(job: Job, holders: dict[str, list[int]]) -> list[str] | None:
    """The GPUs ``job`` may take now (``holders``: each GPU's running jobs' shares), or None.

    A job alone takes empty GPUs; a shared one the least-held GPU that holds only jobs of its share,
    fewer than that share.
    """
    fits = [g for g, shares in holders.items()
            if not shares or (job.share > 1 and len(shares) < job.share and set(shares) == {job.share})]
    fits.sort(key=lambda g: len(holders[g]))
    return fits[: job.gpus_needed] if len(fits) >= job.gpus_needed else None


def run(jobs: list[Job], gpus: list[str], deadline: float, log: pathlib.Path, logs: pathlib.Path) -> int:
    """Runs ``jobs`` on ``gpus`` until all ended or ``deadline`` (a ``time.monotonic()`` value).

    Returns:
        The number of jobs that did not succeed: failed, killed at the deadline, or skipped.
    """
    logs.mkdir(parents=True, exist_ok=True)
    holders: dict[str, list[int]] = {g: [] for g in gpus}
    running: list[_Running] = []
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
                r.process.wait()
                code = "killed at deadline"
            running.remove(r)
            for g in r.gpus:
                holders[g].remove(r.job.share)
            entry = {"job": r.job.name, "gpus": ",".join(r.gpus), "rc": code, "seconds": round(now - r.started, 1)}
            if code != 0:
                failures += 1
                entry["tail"] = tail(logs / f"{r.job.name}.log")
            record(entry)
        while pending:
            job = pending[0]
            if job.gpus_needed > len(gpus):
                record({"job": job.name, "rc": "skipped", "why": f"needs {job.gpus_needed} GPUs, has {len(gpus)}"})
                failures += 1
                pending.pop(0)
                continue
            if now + job.estimate_s > deadline:
                record({"job": job.name, "rc": "skipped", "why": f"estimate {job.estimate_s:.0f} s past the deadline"})
                failures += 1
                pending.pop(0)
                continue
            held = place(job, holders)
            if held is None:
                break
            pending.pop(0)
            for g in held:
                holders[g].append(job.share)
            env = dict(os.environ, **job.env, CUDA_VISIBLE_DEVICES=",".join(held))
            with (logs / f"{job.name}.log").open("w") as out:
                process = subprocess.Popen(job.argv, cwd=job.cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True)
            running.append(_Running(job, held, process, now))
            print(f"gpu_jobs: started {job.name} on GPU {','.join(held)}", flush=True)
        time.sleep(0.5)
    return failures
