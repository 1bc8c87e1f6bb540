"""A loop that keeps one checkpoint: the time each save takes out of the loop, with work between.

    python bench/keep_one.py [--mib 256] [--saves 6] [--work-s 0.5]

A real loop computes between saves; a job that keeps `keep_last` checkpoints deletes one at each
save. Rows, measured in the same run, one save per round after `--work-s` seconds of CPU work
(matrix products on one thread), median over the rounds after one warm-up:
  * torch.save + fsync + os.replace over the previous file (the replace frees the old one)
  * raw write + fsync of the same bytes into a new file, then removing the previous file
  * the same raw write with the previous file removed before the work, outside the timing (the floor)
  * distckpt save (sync, keep_last=1): retention retires the previous step inside save(), and
    removes its files on a thread of its own while the next work runs
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Callable

import torch


def _work(seconds: float) -> None:
    a = torch.randn(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def _rounds(save: Callable[[int], None], saves: int, work_s: float,
            before: Callable[[int], None] = lambda i: None) -> float:
    times = []
    for i in range(saves + 1):
        before(i)
        _work(work_s)
        t0 = time.perf_counter()
        save(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def keep_one_table(mib: float, saves: int, work_s: float) -> str:
    from baselines import torch_save_durably

    import distckpt

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(max(1, int(mib * 2**20) // 4 // 16), generator=g) for i in range(16)}
    root = tempfile.mkdtemp(prefix="distckpt-keep-one-", dir=os.environ.get("BENCH_DIR"))
    try:
        def torch_save(i: int) -> None:
            torch_save_durably(state, os.path.join(root, "torch.pt"))

        def raw_write(i: int, remove: bool = True) -> None:
            with open(os.path.join(root, f"raw-{i}"), "wb") as f:
                for t in state.values():
                    f.write(t.numpy().data)
                f.flush()
                os.fsync(f.fileno())
            if i and remove:
                os.remove(os.path.join(root, f"raw-{i - 1}"))

        def remove_previous(i: int) -> None:
            if i:
                os.remove(os.path.join(root, f"raw-{i - 1}"))

        mgr = distckpt.CheckpointManager(os.path.join(root, "distckpt"), keep_last=1)
        rows = {"torch.save + fsync + replace over the previous file": _rounds(torch_save, saves, work_s),
                "raw write + fsync, then removing the previous file": _rounds(raw_write, saves, work_s),
                "raw write + fsync (the previous file removed before the work, untimed)": _rounds(
                    lambda i: raw_write(i, remove=False), saves, work_s, before=remove_previous),
                "distckpt save (sync, keep_last=1)": _rounds(lambda i: mgr.save(i, state), saves, work_s)}
        mgr.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    floor = rows["raw write + fsync (the previous file removed before the work, untimed)"]
    lines = [f"keep one checkpoint: {mib:g} MiB in 16 tensors, {work_s:g} s of CPU work before each save, "
             f"median of {saves} saves after one; torch {torch.__version__}",
             f"command: python bench/keep_one.py --mib {mib:g} --saves {saves} --work-s {work_s:g}",
             "| what | save, median s | vs the raw write alone |", "|---|---:|---:|"]
    lines += [f"| {what} | {s:.3f} | {s / floor:.2f}x the time |" for what, s in rows.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=256)
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--work-s", type=float, default=0.5)
    args = parser.parse_args()
    print(keep_one_table(args.mib, args.saves, args.work_s))


if __name__ == "__main__":
    main()
