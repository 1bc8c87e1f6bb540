"""Two tiers against one: what a training loop pays per step, and how long a resume takes.

* Training: the demo's transformer (launch/train.py) on 2 ranks under torchrun, checkpointing
  every 10 steps (a) to S3 only, (b) to a node-local tier with every 10th save also made durable
  on S3 (`local_dir=`, `durable_every=10`), (c) to local disk only (one tier), against (d) no
  checkpoints; steps/s from rank 0's per-step timestamps after a warm-up.
* Resume: a fresh process (interpreter start, manager, `load_latest`, close) loading a state of
  `mib` MiB committed on both tiers, from the local tier and, with the local tier gone, from S3.

The S3 server is SeaweedFS on loopback, as in the tests; in the field an object store is slower
than this, a node-local NVMe faster than this VM's disk.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "launch"))

from demo import torchrun  # noqa: E402
from training import steps_per_second  # noqa: E402

RESUME_SCRIPT = """
import sys, time, torch, distckpt
start = time.perf_counter()
url, local, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
state = {f"t{i}": torch.empty(mib * 2**18 // 16) for i in range(16)}
mgr = distckpt.CheckpointManager(url, local_dir=local)
built = time.perf_counter()
progress = mgr.load_latest(state)
loaded = time.perf_counter()
mgr.close()
print(progress.tier, built - start, loaded - built)
"""

SAVE_SCRIPT = """
import sys, torch, distckpt
url, local, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
state = {f"t{i}": torch.randn(mib * 2**18 // 16) for i in range(16)}
with distckpt.CheckpointManager(url, local_dir=local, durable_every=1) as mgr:
    mgr.load_latest(state)
    mgr.save(1, state)
"""


def _train(root: str, label: str, ckpt: str, extra: list[str], env: dict[str, str], steps: int) -> float:
    tag = label.split(":")[0].replace(" ", "-")
    log = os.path.join(root, f"log-{tag}")
    result = torchrun(2, ["--ckpt", ckpt, "--loss-log", log, "--steps", str(steps), "--keep-last", "2",
                          "--workers", "0", "--val-every", str(10**9), *extra], env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{label}: torchrun failed\n{result.stderr[-3000:]}")
    return steps_per_second(os.path.join(log, "rank-0.txt"))


def training_rows(root: str, server, steps: int, repeats: int) -> list[str]:
    env = server.env()
    configs = {
        "no checkpoints": (os.path.join(root, "none"), ["--ckpt-every", "0"]),
        "S3 only, every 10 steps": ("s3://bench/train-{r}", ["--ckpt-every", "10"]),
        "local tier every 10 steps, S3 every 100": (
            "s3://bench/tiered-{r}", ["--ckpt-every", "10", "--local-dir", os.path.join(root, "local-{r}"),
                                      "--durable-every", "10"]),
        "local disk only (one tier), every 10 steps": (os.path.join(root, "disk-{r}"), ["--ckpt-every", "10"]),
    }
    rates: dict[str, list[float]] = {label: [] for label in configs}
    for r in range(repeats):
        for label, (ckpt, extra) in configs.items():
            run_root = os.path.join(root, f"round{r}")
            rates[label].append(_train(run_root, label, ckpt.format(r=r), [a.format(r=r) for a in extra], env, steps))
    base = statistics.median(rates["no checkpoints"])
    lines = ["| training (2 ranks, demo transformer, S3 on loopback) | steps/s (median) | vs no checkpoints |",
             "|---|---:|---:|"]
    for label in configs:
        rate = statistics.median(rates[label])
        lines.append(f"| {label} | {rate:.2f} | {rate / base:.3f}x |")
    return lines


def _python(script: str, *args: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", script, *args], env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def resume_rows(root: str, server, mib: int, repeats: int) -> list[str]:
    env = server.env()
    url, local = "s3://bench/resume", os.path.join(root, "resume-local")
    subprocess.run([sys.executable, "-c", SAVE_SCRIPT, url, local, str(mib)], check=True,
                   env={**os.environ, **env, "OMP_NUM_THREADS": "1"})
    backup = local + ".kept"
    shutil.copytree(local, backup)
    times: dict[str, list[float]] = {"local": [], "durable": []}
    builds: dict[str, list[float]] = {"local": [], "durable": []}
    walls: dict[str, list[float]] = {"local": [], "durable": []}
    for _ in range(repeats):
        for tier in ("local", "durable"):
            shutil.rmtree(local, ignore_errors=True)
            if tier == "local":
                shutil.copytree(backup, local)
            start = time.perf_counter()
            got, build, inner = _python(RESUME_SCRIPT, url, local, str(mib), env=env).split()
            wall = time.perf_counter() - start
            if got != tier:
                raise RuntimeError(f"expected a resume from the {tier} tier, got {got}")
            times[tier].append(float(inner))
            builds[tier].append(float(build))
            walls[tier].append(wall)
    local_s, s3_s = statistics.median(times["local"]), statistics.median(times["durable"])
    wall_l, wall_s = statistics.median(walls["local"]), statistics.median(walls["durable"])
    build_l, build_s = statistics.median(builds["local"]), statistics.median(builds["durable"])
    return [f"| resume in a fresh process ({mib} MiB, 16 tensors) | load_latest, median s | vs from S3 "
            "| manager construction (S3 client), s | whole process incl. interpreter and torch import, s | vs from S3 |",
            "|---|---:|---:|---:|---:|---:|",
            f"| from the local tier | {local_s:.3f} | {s3_s / local_s:.2f}x faster | {build_l:.3f} | {wall_l:.3f} "
            f"| {wall_s / wall_l:.2f}x faster |",
            f"| from S3 (local tier gone) | {s3_s:.3f} | 1.00x | {build_s:.3f} | {wall_s:.3f} | 1.00x |"]


def tier_tables(root: str, mib: int = 256, steps: int = 150, repeats: int = 2, training: bool = True) -> str:
    from seaweed import SeaweedS3

    server = SeaweedS3(os.path.join(root, "seaweedfs")).start()
    try:
        server.make_bucket("bench")
        lines = training_rows(root, server, steps, repeats) + [""] if training else []
        lines += resume_rows(root, server, mib, max(repeats, 3))
    finally:
        server.stop()
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--resume-only", action="store_true", help="skip the training rows")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="distckpt-tier-bench-")
    try:
        print(f"command: python bench/tiers.py --mib {args.mib} --steps {args.steps} --repeats {args.repeats}"
              + (" --resume-only" if args.resume_only else ""))
        print(tier_tables(work, args.mib, args.steps, args.repeats, not args.resume_only))
    finally:
        shutil.rmtree(work, ignore_errors=True)
