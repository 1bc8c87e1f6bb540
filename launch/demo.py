"""The main job: train, SIGKILL mid-run, let torchrun restart and resume, compare bit for bit.

    python launch/demo.py [--nproc 2] [--steps 120] [--kill-at step:50] [--workers 0] [--ckpt-root DIR]

Runs `launch/train.py` twice under torchrun: once uninterrupted, once with a real SIGKILL of
one worker (torchrun's `--max-restarts 1` restarts the job, which resumes from the last
committed checkpoint). Prints each step's loss from both runs and a verdict: bitwise identical,
or the first step that differs. Exit status 0 only when identical.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "train.py")


def torchrun(nproc: int, train_args: list[str], max_restarts: int = 0, timeout: float = 600,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Launch train.py under a real torchrun on this machine (free port, own rendezvous)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", "--monitor-interval", "0.5", TRAIN, *train_args]
    env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def read_losses(log_dir: str) -> dict[int, dict[int, str]]:
    """{rank: {step: loss as float.hex}}; a step logged twice (before a kill and after the
    resume) keeps its last value, which is the resumed run's."""
    out: dict[int, dict[int, str]] = {}
    for name in sorted(os.listdir(log_dir)):
        if not (name.startswith("rank-") and name.endswith(".txt")):
            continue
        rank = int(name[5:-4])
        steps: dict[int, str] = {}
        with open(os.path.join(log_dir, name)) as f:
            for line in f:
                if line.startswith("#") or not line.strip():
                    continue
                step, loss = line.split()[:2]
                steps[int(step)] = loss
        out[rank] = steps
    return out


def resumed_from(log_dir: str) -> list[str]:
    with open(os.path.join(log_dir, "rank-0.txt")) as f:
        return [line.strip("# \n") for line in f if line.startswith("# resumed")]


@dataclass
class Comparison:
    identical: bool
    first_difference: tuple[int, int] | None  # (rank, step)
    steps: int
    table: str


def compare(reference: dict[int, dict[int, str]], resumed: dict[int, dict[int, str]],
            show_steps: list[int] | None = None) -> Comparison:
    first = None
    lines = [f"{'step':>5} | {'rank':>4} | {'uninterrupted':>14} | {'resumed':>14} | same"]
    count = 0
    for rank in sorted(reference):
        for step in sorted(reference[rank]):
            a, b = reference[rank][step], resumed.get(rank, {}).get(step)
            count += 1
            if a != b and first is None:
                first = (rank, step)
            if show_steps is None or step in show_steps or a != b:
                lines.append(f"{step:>5} | {rank:>4} | {float.fromhex(a):>14.9f} | "
                             f"{float.fromhex(b) if b else float('nan'):>14.9f} | {'yes' if a == b else 'NO'}")
    missing = any(set(resumed.get(r, {})) != set(reference[r]) for r in reference)
    identical = first is None and not missing and bool(reference)
    return Comparison(identical, first, count, "\n".join(lines))


def run_pair(workdir: str, nproc: int, steps: int, kill_at: str, workers: int,
             ckpt_url: str | None = None, extra: list[str] | None = None,
             show_steps: list[int] | None = None, env: dict[str, str] | None = None,
             killed_extra: list[str] | None = None) -> tuple[Comparison, list[str]]:
    """The uninterrupted run and the killed-and-resumed run (with `killed_extra` arguments
    too); returns the comparison."""
    extra = extra or []
    common = ["--steps", str(steps), "--workers", str(workers), *extra]
    ref_ckpt = os.path.join(workdir, "ckpt-reference")
    killed_ckpt = ckpt_url or os.path.join(workdir, "ckpt-killed")
    for label, ckpt, more, restarts in (("reference", ref_ckpt, [], 0),
                                        ("killed", killed_ckpt, ["--kill-at", kill_at, *(killed_extra or [])], 1)):
        result = torchrun(nproc, ["--ckpt", ckpt, "--loss-log", os.path.join(workdir, f"log-{label}"),
                                  *common, *more], max_restarts=restarts, env=env)
        if result.returncode != 0:
            raise RuntimeError(f"the {label} run failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    reference = read_losses(os.path.join(workdir, "log-reference"))
    resumed = read_losses(os.path.join(workdir, "log-killed"))
    return compare(reference, resumed, show_steps), resumed_from(os.path.join(workdir, "log-killed"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--kill-at", default="step:53", help="see train.py --kill-at")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ckpt-root", default=None, help="where runs go (default: a temporary directory)")
    p.add_argument("--s3", action="store_true",
                   help="checkpoint the killed run to S3: starts a SeaweedFS server on loopback")
    args = p.parse_args()
    workdir = args.ckpt_root or tempfile.mkdtemp(prefix="distckpt-demo-")
    if args.ckpt_root:
        shutil.rmtree(workdir, ignore_errors=True)
        os.makedirs(workdir)
    server, url, env = None, None, None
    if args.s3:
        from seaweed import SeaweedS3

        server = SeaweedS3(os.path.join(workdir, "seaweedfs")).start()
        server.make_bucket("demo")
        url, env = "s3://demo/run", server.env()
    where = url + f" (SeaweedFS at {server.endpoint})" if server else workdir
    print(f"distckpt demo: {args.nproc} ranks, {args.steps} steps, loader workers {args.workers}, "
          f"SIGKILL at {args.kill_at}, checkpoints every 20 steps under {where}", flush=True)
    try:
        result, resumes = run_pair(workdir, args.nproc, args.steps, args.kill_at, args.workers, ckpt_url=url,
                                   show_steps=list(range(0, args.steps, 10)), env=env)
    finally:
        if server:
            server.stop()
    print(result.table)
    print(f"resumes seen: {resumes or 'none'}")
    if result.identical and resumes:
        print(f"VERDICT: bitwise identical — all {result.steps} (rank, step) losses of the killed-and-resumed run "
              "equal the uninterrupted run's")
        return 0
    where = f"first difference at rank {result.first_difference[0]}, step {result.first_difference[1]}" \
        if result.first_difference else "the runs logged different steps"
    print(f"VERDICT: NOT identical — {where}" + ("" if resumes else " (the run never resumed)"))
    return 1


if __name__ == "__main__":
    sys.exit(main())
