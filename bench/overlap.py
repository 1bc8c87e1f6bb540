"""What a save costs the training loop when the snapshot overlaps with compute.

A model of 4096x4096 linear layers (64 MiB each, fp32) with SGD momentum (as much state again),
one process. Each round runs one training step (forward, backward, optimizer step) and, before
it, one of: nothing; distckpt async save (the copy into host memory before save() returns);
distckpt async save with overlap_snapshot=True (the copy runs while forward and backward do;
the optimizer step waits for it); dcp.async_save of the model's and optimizer's state dicts.
Reported: the time save() takes to return, and the step's time against the step without a save
(what the loop loses in all: the stall plus whatever the copy in the background slows or
delays), medians over the rounds, interleaved.

    python bench/overlap.py [--sizes 256 512] [--rounds 5] [--device cuda]

On a GPU (`--device cuda`) the model and its optimizer state live on the device, the copy goes to
pinned host memory, and each timing ends with a device synchronisation.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch
from torch import nn

import distckpt

LAYER_BYTES = 4096 * 4096 * 4


def make_model(param_mib: int, device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = max(1, param_mib * 2**20 // LAYER_BYTES)
    model = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(layers)]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    return model, opt


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()


def sync(device: str) -> None:
    """Wait for the device's queued work, so a timing holds what it launched."""
    if device != "cpu":
        torch.cuda.synchronize()


def measure(param_mib: int, rounds: int, root: str, device: str = "cpu") -> list[tuple[str, float, float]]:
    import torch.distributed.checkpoint as dcp

    model, opt = make_model(param_mib, device)
    x = torch.randn(16, 4096, device=device)
    train_step(model, opt, x)  # momentum buffers exist
    state = {"model": model, "optimizer": opt}
    staged = distckpt.CheckpointManager(os.path.join(root, "staged"), async_save=True, keep_last=1)
    overlapped = distckpt.CheckpointManager(os.path.join(root, "overlap"), async_save=True, keep_last=1,
                                            overlap_snapshot=True)
    steps = iter(range(10**6))
    pending: list[Any] = []

    def dcp_save() -> None:
        shutil.rmtree(os.path.join(root, "dcp"), ignore_errors=True)
        pending.append(dcp.async_save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                                      checkpoint_id=os.path.join(root, "dcp")))

    configs: dict[str, Callable[[], None] | None] = {
        "no save": None,
        "distckpt async_save": lambda: staged.save(next(steps), state),
        "distckpt async_save, overlap_snapshot": lambda: overlapped.save(next(steps), state),
        "dcp.async_save": dcp_save,
    }
    stalls: dict[str, list[float]] = {k: [] for k in configs}
    totals: dict[str, list[float]] = {k: [] for k in configs}
    for r in range(rounds + 1):
        for name, save in configs.items():
            staged.wait()
            overlapped.wait()
            while pending:
                pending.pop().result()
            sync(device)
            t0 = time.perf_counter()
            if save is not None:
                save()
            t1 = time.perf_counter()
            train_step(model, opt, x)
            sync(device)
            t2 = time.perf_counter()
            if r:  # the first round allocates staging buffers and warms up
                stalls[name].append(t1 - t0)
                totals[name].append(t2 - t0)
    staged.close()
    overlapped.close()
    base = statistics.median(totals["no save"])
    return [(name, statistics.median(stalls[name]), statistics.median(totals[name]) / base) for name in configs]


def overlap_table(sizes: list[int], rounds: int, device: str = "cpu") -> str:
    lines = ["| parameters (+ momentum) | save method | save() stall s | stall vs dcp.async_save | "
             "save + training step vs step alone |", "|---|---|---:|---:|---:|"]
    for size in sizes:
        root = tempfile.mkdtemp(prefix="distckpt-overlap-")
        try:
            rows = measure(size, rounds, root, device)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        dcp_stall = next(s for name, s, _ in rows if name == "dcp.async_save")
        for name, stall, total in rows:
            versus = f"{stall / dcp_stall:.2f}x" if name != "no save" else ""
            lines.append(f"| {size} MiB (+{size}) | {name} | {stall:.4f} | {versus} | {total:.2f}x |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[256, 512], help="parameter MiB (state is twice that)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu", help="cpu, or cuda: the model and its state on the GPU")
    args = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    print(f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}; median of {args.rounds}; command: "
          f"python bench/overlap.py --sizes {' '.join(map(str, args.sizes))} --rounds {args.rounds} --device {args.device}")
    if args.device != "cpu":
        print(f"device: {torch.cuda.get_device_name()}")
    print(overlap_table(args.sizes, args.rounds, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
