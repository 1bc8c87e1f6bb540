"""What an async save costs the training process, with the writer thread and the writer process.

One process, torch.set_num_threads(1), a model of --mib MiB of parameters with AdamW (as much
state again, twice), a training step, and an async save after every step. Per configuration, in a
fresh process: the mean step time (save included) against no checkpoints, and the CPU seconds the
training process spent per save (getrusage of the process, all its threads: the training thread,
the writer thread, the hash helpers) — the figure the writer process moves out of the process and
the one that does not depend on how loaded the machine is — and the writer process's own CPU.

    python bench/writer_process.py [--mib 16] [--steps 40] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIGS = [("no checkpoints", None), ("async, writer=thread", "thread"), ("async, writer=process", "process")]


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def worker(mib: int, steps: int, writer: str | None, root: str) -> dict:
    import torch

    import distckpt

    torch.set_num_threads(1)
    torch.manual_seed(0)
    width = 512
    layers = max(1, mib)  # 512x512 float32 = 1 MiB each
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(256, width)
    mgr = distckpt.CheckpointManager(root, async_save=True, writer=writer, keep_last=2) if writer else None
    state = {"model": model, "optimizer": opt}

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    for _ in range(3):  # warm up (and the writer process's start)
        step()
        if mgr is not None:
            mgr.save(0, state) if _ == 0 else None
    if mgr is not None:
        mgr.wait()
    cpu0, t0 = _cpu(resource.RUSAGE_SELF), time.perf_counter()
    for s in range(1, steps + 1):
        step()
        if mgr is not None:
            mgr.save(s, state)
    if mgr is not None:
        mgr.wait()
    wall, cpu = time.perf_counter() - t0, _cpu(resource.RUSAGE_SELF) - cpu0
    if mgr is not None:
        mgr.close()
    return {"step_ms": wall / steps * 1e3, "cpu_ms": cpu / steps * 1e3, "child_cpu_s": _cpu(resource.RUSAGE_CHILDREN)}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        out = worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] if sys.argv[4] != "none" else None, sys.argv[5])
        print(json.dumps(out))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    results: dict[str, list[dict]] = {label: [] for label, _ in CONFIGS}
    for _ in range(args.rounds):  # interleaved, each in a fresh process
        for label, writer in CONFIGS:
            root = tempfile.mkdtemp(prefix="distckpt-writer-bench-")
            out = subprocess.run([sys.executable, __file__, "--worker", str(args.mib), str(args.steps), writer or "none",
                                  root], env=env, capture_output=True, text=True, check=True)
            results[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{os.cpu_count()} CPUs; command: python bench/writer_process.py --mib {args.mib} --steps {args.steps} "
          f"--rounds {args.rounds}")
    print("| configuration | step ms (median of rounds) | vs none | training process CPU ms per step | "
          "its extra CPU per save vs none (ms) |")
    print("|---|---:|---:|---:|---:|")
    base_step = statistics.median(r["step_ms"] for r in results["no checkpoints"])
    base_cpu = statistics.median(r["cpu_ms"] for r in results["no checkpoints"])
    for label, _ in CONFIGS:
        step = statistics.median(r["step_ms"] for r in results[label])
        cpu = statistics.median(r["cpu_ms"] for r in results[label])
        print(f"| {label} | {step:.1f} | {step / base_step:.2f}x | {cpu:.1f} | {cpu - base_cpu:+.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
