"""A Lightning Fabric training loop checkpointed through distckpt.integrations.fabric, run under
torchrun (tests/frameworks/test_fabric.py):

    torchrun --nproc-per-node 2 tests/helpers/fabric_loop.py --ckpt DIR --loss-log DIR [--steps N] [--workers W]
        [--accum M] [--async] [--every K] [--mode integration|own-group|fabric-loader|fabric-loader-in-state]
        [--kill-at S1,S2] [--kill-rank R]

--mode integration: make_fabric() and stateful_loader(), the module and optimizer fabric.setup returns
in `state`; own-group: Fabric(...).launch() starting its own process group; fabric-loader: the loop
iterates fabric.setup_dataloaders' wrapper while `state` holds the StatefulDataLoader under it;
fabric-loader-in-state: that wrapper in `state`.

Each rank appends `step epoch x-sum loss weights buffers` (floats as hex) to LOSS_LOG/rank-R.txt
after every micro-batch; --kill-at SIGKILLs rank --kill-rank at the start of that micro-batch in
the first incarnation (the second value in the second). Saves come after an optimizer step, every
K of them.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys

import numpy as np
import torch
from torch.utils.data import Dataset

import distckpt


class Noisy(Dataset):
    """Inputs with augmentation drawn from torch, Python and NumPy (in the loader workers if any)."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((4,), float(i)) / 48 + 0.1 * torch.randn(4) + random.random() * 0.01 + np.random.rand() * 0.01
        return x.float(), x.sum(0, keepdim=True).float()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--loss-log", dest="log", required=True)
    p.add_argument("--steps", type=int, default=30, help="micro-batches in all")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--every", type=int, default=2, help="save every K optimizer steps")
    p.add_argument("--mode", choices=["integration", "own-group", "fabric-loader", "fabric-loader-in-state"],
                   default="integration")
    p.add_argument("--kill-at", default="")
    p.add_argument("--kill-rank", type=int, default=0)
    return p.parse_args()


def main() -> int:
    args = parse()
    from lightning_fabric import Fabric

    from distckpt.integrations import fabric as dcf

    if args.mode == "own-group":
        fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
        fabric.launch()
    else:
        fabric = dcf.make_fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric.seed_everything(1234)  # torch, NumPy and Python's global streams: the same weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer.optimizer, max_lr=1e-2, total_steps=args.steps)
    loader = dcf.stateful_loader(fabric, Noisy(), batch_size=4, num_workers=args.workers)
    sampler = loader.sampler
    batches = loader
    if args.mode.startswith("fabric-loader"):
        batches = fabric.setup_dataloaders(loader, use_distributed_sampler=False)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler,
             "loader": batches if args.mode == "fabric-loader-in-state" else loader}
    mgr = distckpt.CheckpointManager(args.ckpt, async_save=args.async_save, timeout=60)
    progress = mgr.load_latest(state)
    step = progress.step + 1 if progress else 0  # micro-batches; an optimizer step every --accum
    epoch = progress.epoch if progress else 0
    if progress is not None:
        _log(args.log, fabric.global_rank, f"# resumed from step {progress.step} epoch {progress.epoch}")
    else:
        sampler.set_epoch(epoch)
    kills = [int(s) for s in args.kill_at.split(",") if s]
    incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    iterator = iter(batches)
    while step < args.steps:
        try:
            x, y = fabric.to_device(next(iterator))
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            iterator = iter(batches)
            continue
        if incarnation < len(kills) and step == kills[incarnation] and fabric.global_rank == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        stepping = step % args.accum == args.accum - 1
        with fabric.no_backward_sync(model, enabled=not stepping):
            loss = torch.nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
        if stepping:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        weights = sum(p.double().sum() for p in model.parameters()).item()
        buffers = sum(b.double().sum() for b in model.buffers()).item()
        _log(args.log, fabric.global_rank,
             f"{step} {epoch} {x.double().sum().item().hex()} {loss.item().hex()} {weights.hex()} {buffers.hex()}")
        if stepping and (step + 1) // args.accum % args.every == 0:
            mgr.save(step, state, epoch=epoch)
        step += 1
    mgr.close()
    return 0


def _log(log_dir: str, rank: int, line: str) -> None:
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, f"rank-{rank}.txt"), "a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
