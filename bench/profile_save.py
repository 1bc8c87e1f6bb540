"""Where an async save of the demo's state spends its time, per save, on each thread.

    python bench/profile_save.py [--ranks 1 2] [--saves 40]

Runs the demo transformer's state (launch/train.py: DDP model, AdamW, scheduler, sampler,
StatefulDataLoader, generator) under torchrun, one training step and one async save per round,
and times on rank 0 the functions a save goes through: on the training thread wall time (what
the loop waits for), on the writer thread wall and CPU time (thread_time: what it takes from a
core, and, for Python code, from the GIL the training thread needs too).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _timed(acc: dict[str, float], label: str, fn: Any, clock: Any = time.perf_counter) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[label] += clock() - t0
    return wrapper


def worker(root: str, saves: int) -> None:
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    import torch
    import torch.nn.functional as F
    import train as demo
    from torch.utils.data.distributed import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    import distckpt
    from distckpt.protocol import coord, pruning, saving, session

    torch.set_num_threads(1)
    info = distckpt.init_distributed()
    data = demo.CharWindows(demo.make_corpus(), 32, stride=37)
    sampler = DistributedSampler(data, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=1,
                                 drop_last=True)
    generator = torch.Generator().manual_seed(5)
    loader = StatefulDataLoader(distckpt.with_worker_rng(data), batch_size=16, sampler=sampler,
                                num_workers=0, generator=generator, drop_last=True)
    model = demo.TinyGPT(len(data.vocab), 32)
    wrapped = demo.wrap(model, info.world_size, fsdp=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, demo.lr_lambda(10, 100))
    state = {"model": wrapped, "optimizer": opt, "scheduler": sched, "sampler": sampler, "loader": loader,
             "loader_generator": generator, "config": {"lr": 3e-3}}
    mgr = distckpt.CheckpointManager(root, keep_last=2, async_save=True, timeout=120)
    batches = iter(loader)

    def step() -> None:
        nonlocal batches
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(wrapped(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        sched.step()

    for s in range(5):  # warm-up: staging buffers, the writer's group
        step()
        mgr.save(s, state)
    training: dict[str, float] = collections.defaultdict(float)
    writer: dict[str, float] = collections.defaultdict(float)
    saving._encode_checked = _timed(training, "encode the trees (staging copies included)",
                                      saving._encode_checked)
    saving.capture_entry = _timed(training, "state_dict() of every entry", saving.capture_entry)
    saving.capture_process_rng = _timed(training, "RNG capture", saving.capture_process_rng)
    session.classify_in_world = _timed(training, "classify the state", session.classify_in_world)
    coord.GlooCoordinator.all_gather = _timed(training, "the capture's exchange (all_gather)",
                                              coord.GlooCoordinator.all_gather)
    session.AsyncWriter.wait = _timed(training, "waiting for the previous save", session.AsyncWriter.wait)
    cls = session.Session
    cls._background_save = _timed(writer, "writer thread, whole save (CPU)", cls._background_save, time.thread_time)
    pruning.Pruner.after_commit = _timed(writer, "  of which retention (CPU)", pruning.Pruner.after_commit,
                                         time.thread_time)
    saving.gather_save = _timed(writer, "  of which the gather (wall)", saving.gather_save)
    session.gather_save = saving.gather_save
    totals = []
    for s in range(5, 5 + saves):
        step()
        t0 = time.perf_counter()
        mgr.save(s, state)
        totals.append(time.perf_counter() - t0)
    mgr.close()
    if info.rank == 0:
        totals.sort()
        print(f"| training thread | save() in all (median) | {totals[len(totals) // 2] * 1e3:.2f} |")
        for label, seconds in sorted(training.items(), key=lambda kv: -kv[1]):
            print(f"| training thread | {label} | {seconds / saves * 1e3:.2f} |")
        for label in ("writer thread, whole save (CPU)", "  of which the gather (wall)", "  of which retention (CPU)"):
            print(f"| writer thread | {label.strip()} | {writer[label] / saves * 1e3:.2f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--saves", type=int, default=40)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.saves)
        return 0
    print(f"{os.cpu_count()} CPUs; command: python bench/profile_save.py --ranks "
          f"{' '.join(map(str, args.ranks))} --saves {args.saves}")
    for ranks in args.ranks:
        print(f"\n{ranks} rank(s), ms per save (rank 0):\n\n| thread | what | ms |\n|---|---|---:|", flush=True)
        root = tempfile.mkdtemp(prefix="distckpt-save-prof-")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--rdzv-backend",
               "c10d", "--rdzv-endpoint", "127.0.0.1:0", os.path.abspath(__file__), "--worker",
               os.path.join(root, "ckpt"), "--saves", str(args.saves)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            print(result.stderr[-3000:])
            return 1
        print(result.stdout.strip(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
