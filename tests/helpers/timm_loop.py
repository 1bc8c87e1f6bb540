"""A loop written as timm's train.py writes its own, checkpointed through distckpt.integrations.timm,
run under torchrun (tests/frameworks/test_timm.py):

    torchrun --nproc-per-node N tests/helpers/timm_loop.py --ckpt DIR --loss-log DIR [--steps N] [--workers W]
        [--accum M] [--async] [--every K] [--kill-at S1,S2] [--kill-rank R] [--timm-prefetcher]
        [--replicated-scheduler]

A tiny timm model with drop path under DDP and bf16 autocast, timm's AdamW and cosine scheduler
with warm-up (step_update with each rank's running loss as its metric), an EMA (ModelEmaV3),
Mixup/CutMix, RandAugment, random erasing in the prefetcher, a persistent-workers evaluation loader
run every epoch, in `state`. --timm-prefetcher: timm's own create_loader and PrefetchLoader (over a
StatefulDataLoader) instead of the integration's; --replicated-scheduler: the scheduler in `state`
as it is, not through scheduler_state.

Each rank appends `step epoch loss weights` (floats as hex) to LOSS_LOG/rank-R.txt after every
optimizer step; --kill-at SIGKILLs rank --kill-rank at the start of that step in the first
incarnation (the second value in the second).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys

import cpu_torchvision  # noqa: F401  (before timm: torchvision's operators on a CPU build of torch)
import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

import distckpt


class Pictures(Dataset):
    """Small RGB pictures (PIL, as timm's transforms take them) with 4 classes."""

    def __init__(self, n: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.pictures = rng.integers(0, 256, size=(n, 24, 24, 3), dtype=np.uint8)
        self.transform = None

    def __len__(self) -> int:
        return len(self.pictures)

    def __getitem__(self, i: int) -> tuple[object, int]:
        picture = Image.fromarray(self.pictures[i])
        return (self.transform(picture) if self.transform is not None else picture), i % 4


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--loss-log", dest="log", required=True)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps in all")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--timm-prefetcher", action="store_true")
    p.add_argument("--replicated-scheduler", action="store_true")
    p.add_argument("--kill-at", default="")
    p.add_argument("--kill-rank", type=int, default=0)
    return p.parse_args()


def main() -> int:
    args = parse()
    import timm
    from timm.data import Mixup
    from timm.loss import SoftTargetCrossEntropy
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2
    from timm.utils import ModelEmaV3

    from distckpt.integrations import timm as dct

    info = distckpt.init_distributed()
    rank = info.rank
    torch.manual_seed(42)  # the same initial weights on every rank
    np.random.seed(rank)  # Mixup draws from NumPy's stream, RandAugment and random erasing from Python's
    random.seed(rank)
    torch.use_deterministic_algorithms(True)
    model = timm.create_model("test_resnet", num_classes=4, drop_path_rate=0.2)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ema = ModelEmaV3(model, decay=0.9)
    optimizer = create_optimizer_v2(model, "adamw", lr=2e-3, weight_decay=0.05)
    train_options = dict(input_size=(3, 24, 24), batch_size=4, is_training=True, use_prefetcher=True,
                         device=torch.device("cpu"), auto_augment="rand-m9-mstd0.5", re_prob=0.5, scale=(0.5, 1.0),
                         num_workers=args.workers, distributed=True, persistent_workers=True)
    eval_options = dict(input_size=(3, 24, 24), batch_size=4, is_training=False, use_prefetcher=True,
                        device=torch.device("cpu"), num_workers=2, distributed=True, persistent_workers=True)
    if args.timm_prefetcher:  # timm's own prefetcher over a StatefulDataLoader: it holds a batch no one saves
        from timm.data import create_loader

        loader = create_loader(Pictures(64, 0), **train_options)
        loader.loader = dct.stateful_loader(loader.loader)
        in_state: object = loader.loader
    else:
        loader = in_state = dct.create_loader(Pictures(64, 0), **train_options)
    evaluation = dct.create_loader(Pictures(16, 1), **eval_options)
    updates_per_epoch = len(loader) // args.accum
    scheduler, _ = create_scheduler_v2(optimizer, sched="cosine", num_epochs=6, warmup_epochs=1,
                                       updates_per_epoch=updates_per_epoch)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, prob=1.0, switch_prob=0.5, label_smoothing=0.1, num_classes=4)
    criterion = SoftTargetCrossEntropy()
    state = {"model": ddp, "optimizer": optimizer, "ema": ema, "loader": in_state, "eval_loader": evaluation,
             "scheduler": scheduler if args.replicated_scheduler else dct.scheduler_state(scheduler)}
    mgr = distckpt.CheckpointManager(args.ckpt, async_save=args.async_save, timeout=60, keep_last=2)
    progress = mgr.load_latest(state)
    step = progress.step + 1 if progress else 0  # optimizer steps
    epoch = progress.epoch if progress else 0
    if progress is not None:
        _log(args.log, rank, f"# resumed from step {progress.step} epoch {progress.epoch}")
    loader.sampler.set_epoch(epoch)  # as train.py does at each epoch's start, resumed or not
    kills = [int(s) for s in args.kill_at.split(",") if s]
    incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    batches = iter(loader)

    def draw() -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal batches, epoch
        try:
            return next(batches)
        except StopIteration:  # an epoch's end: evaluation, the scheduler's epoch step, the next epoch
            _evaluate(ema.module, evaluation)
            epoch += 1
            scheduler.step(epoch)
            loader.sampler.set_epoch(epoch)
            batches = iter(loader)
            return next(batches)

    while step < args.steps:
        if incarnation < len(kills) and step == kills[incarnation] and rank == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        total = torch.zeros(())
        for micro in range(args.accum):
            x, y = draw()
            x, y = mixup(x, y)
            syncing = micro == args.accum - 1
            with ddp.no_sync() if not syncing else _nothing():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = criterion(ddp(x), y) / args.accum
                loss.backward()
            total += loss.detach().float()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update(model, step=step)
        scheduler.step_update(num_updates=step + 1, metric=float(total))  # each rank's own loss
        weights = sum(p.double().sum() for p in model.parameters()).item()
        _log(args.log, rank, f"{step} {epoch} {total.item().hex()} {weights.hex()}")
        if (step + 1) % args.every == 0:
            mgr.save(step, state, epoch=epoch)
        step += 1
    mgr.close()
    return 0


def _evaluate(model: torch.nn.Module, loader: object) -> None:
    model.eval()
    with torch.no_grad():
        for x, _ in loader:  # type: ignore[attr-defined]
            model(x)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _log(log_dir: str, rank: int, line: str) -> None:
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, f"rank-{rank}.txt"), "a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
