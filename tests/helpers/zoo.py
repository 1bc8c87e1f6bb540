"""Run a loop of the zoo (tests/helpers/zoo_loop.py) uninterrupted and killed-and-resumed under torchrun,
and compare every (rank, step) line bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
LOOP = os.path.join(HERE, "zoo_loop.py")
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository


@dataclass
class ZooResult:
    identical: bool
    first_difference: str
    resumes: list[str]
    lines: int


def torchrun(nproc: int, args: list[str], max_restarts: int, timeout: float = 600,
             loop: str = LOOP) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", "--monitor-interval", "0.5", loop, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def read_log(log_dir: str) -> tuple[dict[tuple[int, int], str], list[str]]:
    lines: dict[tuple[int, int], str] = {}
    resumes: list[str] = []
    for name in sorted(os.listdir(log_dir)):
        rank = int(name[len("rank-"):-len(".txt")])
        with open(os.path.join(log_dir, name)) as f:
            for line in f:
                if line.startswith("#"):
                    if rank == 0:
                        resumes.append(line.strip("# \n"))
                    continue
                step, rest = line.split(" ", 1)
                lines[(rank, int(step))] = rest.strip()
    return lines, resumes


def run_zoo_pair(workdir: str, nproc: int, options: list[str], kill_at: str, kill_rank: int = 0,
                 steps: int = 30, loop: str = LOOP) -> ZooResult:
    """`loop` (tests/helpers/zoo_loop.py, or a framework's loop taking the same arguments) run
    uninterrupted and killed at `kill_at`, every (rank, step) line compared."""
    common = ["--steps", str(steps), *options]
    restarts = len(kill_at.split(","))
    for label, more, max_restarts in (("reference", [], 0),
                                      ("killed", ["--kill-at", kill_at, "--kill-rank", str(kill_rank)], restarts)):
        result = torchrun(nproc, ["--ckpt", os.path.join(workdir, f"ckpt-{label}"),
                                  "--loss-log", os.path.join(workdir, f"log-{label}"), *common, *more], max_restarts,
                          loop=loop)
        if result.returncode != 0:
            raise RuntimeError(f"the {label} run of {options} failed ({result.returncode}):\n"
                               f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    reference, _ = read_log(os.path.join(workdir, "log-reference"))
    killed, resumes = read_log(os.path.join(workdir, "log-killed"))
    first = ""
    for key in sorted(reference, key=lambda k: (k[1], k[0])):
        if killed.get(key) != reference[key]:
            first = f"rank {key[0]} step {key[1]}: {reference[key]} uninterrupted, {killed.get(key)} resumed"
            break
    if not first and set(killed) != set(reference):
        first = f"logged steps differ: {sorted(set(killed) ^ set(reference))[:5]}"
    return ZooResult(not first and bool(reference), first, resumes, len(reference))
