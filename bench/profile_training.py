"""Where checkpointing's cost lands in training: per-step times of the demo's transformer on 2
(or more) ranks under torchrun, grouped by distance from the last save (the save step itself,
the next steps, the rest), for checkpoints every N steps, sync and async, against no checkpoints.

    python bench/profile_training.py [--every 10] [--steps 200] [--ranks 2 4] [--writers thread process]

Every run's training sets torch.set_num_threads(1) (launch/train.py): at 1 rank on 2 cores, one
core trains and one is free for a writer; `--writers` adds an async row per writer.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from training import run_config, step_times  # noqa: E402


def step_costs(log_file: str, every: int, warmup: int = 10) -> dict[str, list[float]]:
    """Milliseconds of each step (its timestamp minus the previous one), by steps since a save."""
    times = step_times(log_file)
    groups: dict[str, list[float]] = collections.defaultdict(list)
    for step in range(warmup + 1, len(times)):
        since = (step - 1) % every if every else every
        label = "save step" if since == 0 and every else "step after" if since == 1 else "others"
        groups[label].append((times[step] - times[step - 1]) * 1e3)
    return groups


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--writers", nargs="+", default=["thread"], choices=("thread", "process"))
    p.add_argument("--no-sync", action="store_true", help="leave out the sync row")
    p.add_argument("--memory-disk-every", type=int, default=None, metavar="N",
                   help="add async rows with the memory tier: every save to memory, every Nth to disk")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="distckpt-train-prof-")
    # the memory tier's rows: each run's own memory root in shared memory, removed at the end
    memory_root = tempfile.mkdtemp(prefix="distckpt-bench-", dir="/dev/shm")
    print(f"{os.cpu_count()} CPUs; command: python bench/profile_training.py --every {args.every} "
          f"--steps {args.steps} --ranks {' '.join(map(str, args.ranks))} --writers {' '.join(args.writers)}"
          + (" --no-sync" if args.no_sync else "")
          + (f" --memory-disk-every {args.memory_disk_every}" if args.memory_disk_every else ""))
    print("| ranks | configuration | step kind | steps | median ms | mean ms | total ms | mean vs none |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for ranks in args.ranks:
        base = None
        configs = [("no checkpoints", 0, False, [])]
        if not args.no_sync:
            configs.append((f"every {args.every}, sync", args.every, False, []))
        configs += [(f"every {args.every}, async, writer={w}", args.every, True, ["--writer", w]) for w in args.writers]
        if args.memory_disk_every:
            n = args.memory_disk_every
            configs.append((f"every {args.every}, async, memory tier, disk every {n}", args.every, True,
                            ["--memory-tier", "--disk-every", str(n)]))
        for label, every, async_save, extra in configs:
            run_root = os.path.join(root, f"r{ranks}")
            os.environ["DISTCKPT_MEMORY_DIR"] = os.path.join(memory_root, f"r{ranks}-{len(label)}-{every}")
            run_config(run_root, label, every, async_save, args.steps, ranks, extra)
            tag = label.replace(" ", "-").replace(",", "")  # as run_config names the log
            groups = step_costs(os.path.join(run_root, f"log-{tag}", "rank-0.txt"), every or args.every)
            every_step = [ms for kind in groups for ms in groups[kind]]
            mean = statistics.mean(every_step)
            base = base if base is not None else mean
            for kind in ("save step", "step after", "others"):
                ms = groups.get(kind, [])
                if ms:
                    print(f"| {ranks} | {label} | {kind} | {len(ms)} | {statistics.median(ms):.1f} | "
                          f"{statistics.mean(ms):.1f} | {sum(ms):.0f} | {mean / base:.2f}x |", flush=True)
    shutil.rmtree(memory_root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
