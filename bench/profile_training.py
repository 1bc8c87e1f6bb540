"""Where checkpointing's cost lands in training: per-step times of the demo's transformer on 2
ranks under torchrun, grouped by distance from the last save (the save step itself, the next
steps, the rest), for checkpoints every N steps, sync and async, against no checkpoints.

    python bench/profile_training.py [--every 10] [--steps 200]
"""

from __future__ import annotations

import argparse
import collections
import os
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
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="distckpt-train-prof-")
    print(f"command: python bench/profile_training.py --every {args.every} --steps {args.steps}")
    print("| configuration | step kind | steps | median ms | mean ms | total ms |")
    print("|---|---|---:|---:|---:|---:|")
    for label, every, async_save in (("no checkpoints", 0, False), (f"every {args.every}, sync", args.every, False),
                                     (f"every {args.every}, async", args.every, True)):
        run_config(root, label, every, async_save, args.steps)
        tag = label.replace(" ", "-").replace(",", "")
        groups = step_costs(os.path.join(root, f"log-{tag}", "rank-0.txt"), every or args.every)
        for kind in ("save step", "step after", "others"):
            ms = groups.get(kind, [])
            if ms:
                print(f"| {label} | {kind} | {len(ms)} | {statistics.median(ms):.1f} | "
                      f"{statistics.mean(ms):.1f} | {sum(ms):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
