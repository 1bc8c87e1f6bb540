"""A Hugging Face Accelerate training loop, written as Hugging Face's no_trainer scripts write theirs,
run under torchrun (tests/frameworks/test_accelerate.py):

    torchrun --nproc-per-node N tests/helpers/accelerate_loop.py --ckpt DIR --loss-log DIR [--steps N]
        [--accum M] [--workers W] [--loader prepared|stateful|plain-prepared] [--async [--overlap]]
        [--every K] [--init integration|distckpt|accelerate] [--no-cpu] [--kill-at S1,S2] [--kill-rank R]
        [--save-minus-one]

--loader prepared: a plain DataLoader(shuffle=True) given to accelerator.prepare() (backed by a
StatefulDataLoader: use_stateful_dataloader=True), in `state`; stateful: the README's own
StatefulDataLoader with a DistributedSampler, kept out of prepare(); plain-prepared: prepare()
without use_stateful_dataloader. --init: make_accelerator() (the integration), init_distributed()
then Accelerator(cpu=True), or Accelerator(cpu=True) alone (its own process group). --no-cpu:
Accelerator() without cpu=True on this CPU host.

Each rank appends `step epoch x-sum loss weights` (floats as hex) to LOSS_LOG/rank-R.txt after every
micro-batch; `--kill-at` SIGKILLs rank --kill-rank at the start of that micro-batch in the first
incarnation (the second value in the second). Saves come after an optimizer step, every K of them.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import distckpt


class Noisy(Dataset):
    """Inputs with augmentation drawn from torch's stream (in the loader workers if any)."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((4,), float(i)) / 48 + 0.1 * torch.randn(4)
        return x, x.sum(0, keepdim=True)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--loss-log", dest="log", required=True)
    p.add_argument("--steps", type=int, default=30, help="micro-batches in all")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--loader", choices=["prepared", "stateful", "plain-prepared"], default="prepared")
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--overlap", action="store_true")
    p.add_argument("--every", type=int, default=2, help="save every K optimizer steps")
    p.add_argument("--init", choices=["integration", "distckpt", "accelerate"], default="integration")
    p.add_argument("--no-cpu", action="store_true")
    p.add_argument("--save-minus-one", action="store_true",
                   help="the no_trainer scripts' check on every micro-batch: save(completed_steps - 1) at the first")
    p.add_argument("--kill-at", default="")
    p.add_argument("--kill-rank", type=int, default=0)
    return p.parse_args()


def make_accelerator(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    from distckpt.integrations import accelerate as integration

    stateful = DataLoaderConfiguration(use_stateful_dataloader=args.loader != "plain-prepared")
    options = {"gradient_accumulation_steps": args.accum, "dataloader_config": stateful}
    if args.no_cpu:
        distckpt.init_distributed()
        return Accelerator(**options)
    if args.init == "integration":
        return integration.make_accelerator(**options)
    if args.init == "distckpt":
        distckpt.init_distributed()
    return Accelerator(cpu=True, **options)


def main() -> int:
    args = parse()
    accelerator = make_accelerator(args)
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    dataset = distckpt.with_worker_rng(Noisy()) if args.workers else Noisy()
    sampler = None
    if args.loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        sampler = DistributedSampler(dataset, num_replicas=accelerator.num_processes, rank=accelerator.process_index,
                                     shuffle=True, seed=0)
        loader = StatefulDataLoader(dataset, batch_size=4, sampler=sampler, num_workers=args.workers)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    else:
        loader = DataLoader(dataset, batch_size=4, shuffle=True, num_workers=args.workers)
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader}
    if sampler is not None:
        state["sampler"] = sampler
    mgr = distckpt.CheckpointManager(args.ckpt, async_save=args.async_save, overlap_snapshot=args.overlap,
                                     timeout=60)
    progress = mgr.load_latest(state)
    step = progress.step + 1 if progress else 0  # micro-batches
    epoch = progress.epoch if progress else 0
    completed = step // args.accum  # optimizer steps (saves come after one)
    if progress is not None:
        _log(args.log, rank, f"# resumed from step {progress.step} epoch {progress.epoch}")
    if sampler is not None and progress is None:
        sampler.set_epoch(epoch)
    kills = [int(s) for s in args.kill_at.split(",") if s]
    incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    iterator = iter(loader)
    while step < args.steps:
        try:
            x, y = next(iterator)
        except StopIteration:  # the next epoch
            epoch += 1
            if sampler is not None:
                sampler.set_epoch(epoch)
            iterator = iter(loader)
            continue
        if incarnation < len(kills) and step == kills[incarnation] and rank == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        weights = sum(p.double().sum() for p in model.parameters()).item()
        _log(args.log, rank, f"{step} {epoch} {x.double().sum().item().hex()} {loss.item().hex()} {weights.hex()}")
        if args.save_minus_one and completed % args.every == 0:
            mgr.save(completed - 1, state, epoch=epoch)  # checked on every micro-batch, as those scripts do
        if accelerator.sync_gradients:
            completed += 1
            if completed % args.every == 0:
                mgr.save(step, state, epoch=epoch)
        step += 1
    mgr.close()
    accelerator.end_training()
    return 0


def _log(log_dir: str, rank: int, line: str) -> None:
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, f"rank-{rank}.txt"), "a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
