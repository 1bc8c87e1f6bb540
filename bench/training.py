"""Training throughput with checkpoints: the demo's transformer (launch/train.py) on 2 ranks under
torchrun, checkpointing every 1, 10 and 100 steps, sync and async, against no checkpointing.

Throughput is measured inside the run, from rank 0's per-step timestamps after a warm-up of 10
steps, so process start-up and the initial load do not count. Every configuration runs the same
steps on the same data; the manager's per-step pre-emption check (one small collective) runs in
every configuration, the baseline included.
"""

from __future__ import annotations

import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "launch"))

from demo import torchrun  # noqa: E402

WARMUP_STEPS = 10
CONFIGS = [("no checkpoints", 0, False), ("every 100 steps, sync", 100, False), ("every 100 steps, async", 100, True),
           ("every 10 steps, sync", 10, False), ("every 10 steps, async", 10, True),
           ("every step, sync", 1, False), ("every step, async", 1, True)]


def step_times(log_file: str) -> list[float]:
    times = []
    with open(log_file) as f:
        for line in f:
            fields = dict(kv.split("=", 1) for kv in line.split()[2:] if "=" in kv)
            if not line.startswith("#") and "t" in fields:
                times.append(float(fields["t"]))
    return times


def steps_per_second(log_file: str) -> float:
    times = step_times(log_file)[WARMUP_STEPS:]
    return (len(times) - 1) / (times[-1] - times[0])


def run_config(root: str, label: str, every: int, async_save: bool, steps: int, ranks: int = 2,
               extra: list[str] | None = None) -> float:
    tag = label.replace(" ", "-").replace(",", "")
    args = ["--ckpt", os.path.join(root, f"ckpt-{tag}"), "--loss-log", os.path.join(root, f"log-{tag}"),
            "--steps", str(steps), "--ckpt-every", str(every), "--keep-last", "2", "--workers", "0",
            "--val-every", str(10**9)]
    if async_save:
        args.append("--async-save")
    args += extra or []
    result = torchrun(ranks, args)
    if result.returncode != 0:
        raise RuntimeError(f"{label}: torchrun failed\n{result.stderr[-3000:]}")
    return steps_per_second(os.path.join(root, f"log-{tag}", "rank-0.txt"))


def training_table(root: str, steps: int = 150, repeats: int = 2) -> str:
    """Median steps/s per configuration over `repeats` runs, interleaved."""
    rates: dict[str, list[float]] = {label: [] for label, _, _ in CONFIGS}
    for r in range(repeats):
        for label, every, async_save in CONFIGS:
            rates[label].append(run_config(os.path.join(root, f"round{r}"), label, every, async_save, steps))
    base = statistics.median(rates["no checkpoints"])
    lines = ["| training (2 ranks, gloo, demo transformer) | steps/s (median) | vs no checkpoints |",
             "|---|---:|---:|"]
    for label, _, _ in CONFIGS:
        rate = statistics.median(rates[label])
        lines.append(f"| {label} | {rate:.2f} | {rate / base:.3f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    import tempfile

    print(training_table(tempfile.mkdtemp(prefix="distckpt-train-bench-")))
