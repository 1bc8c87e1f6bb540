"""One training loop of the loop zoo, written the way users write theirs (run under torchrun).

    torchrun --nproc-per-node N tests/helpers/zoo_loop.py --ckpt DIR --loss-log DIR [--wrap ddp|bare|fsdp2]
        [--compile] [--accum M] [--bn-eval-at S] [--loader-gen | --no-loader-gen] [--workers W]
        [--sampler dist|random] [--prefetch] [--scaler] [--ema] [--optim adamw|sgd|adam]
        [--sched cosine|seq|onecycle] [--async [--overlap]] [--every K] [--steps N] [--kill-at S1,S2,...]
        [--aux-head] [--noise-forward] [--wrap-after-load]

Each rank appends `step loss-as-float.hex param-sum-as-float.hex` to `LOSS_LOG/rank-R.txt` after every
optimizer step; a step logged twice (before a kill and after the resume) keeps its last line.
`--kill-at 23,27` SIGKILLs rank `--kill-rank` at the start of step 23 in the first incarnation and
of step 27 in the second (torchrun's restart counter tells them apart).
Saves happen at the end of a step, after the optimizer step, so a resume starts at
`progress.step + 1`.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, DistributedSampler

import distckpt


class NoisyDataset(Dataset):
    """Random augmentation from Python, NumPy and torch in __getitem__ (in workers if any)."""

    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(8) * 0.01 + float(np.random.rand()) * 0.01 + random.random() * 0.01
        return self.x[i] + noise, self.y[i]


class Net(nn.Module):
    def __init__(self, aux_head: bool = False, noise: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(16, 1)
        self.aux = nn.Linear(16, 1) if aux_head else None  # used in training only (Inception's aux logits)
        self.noise = noise  # the forward draws its own noise, in both modes (a diffusion model's)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn(self.fc1(x))))
        if self.noise:
            h = h + torch.randn_like(h) * 0.01
        out = self.fc2(h)
        return out + 0.1 * self.aux(h) if self.aux is not None and self.training else out


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--loss-log", dest="log", required=True)
    p.add_argument("--wrap", choices=["ddp", "bare", "fsdp2"], default="ddp")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--bn-eval-at", type=int, default=-1)
    p.add_argument("--loader-gen", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--sampler", choices=["dist", "random", "torch-random"], default="dist",
                   help="torch-random: torch's RandomSampler on a generator of its own, no state_dict, not in state")
    p.add_argument("--prefetch", action="store_true")
    p.add_argument("--scaler", action="store_true")
    p.add_argument("--ema", action="store_true")
    p.add_argument("--optim", choices=["adamw", "sgd", "adam"], default="adamw")
    p.add_argument("--sched", choices=["cosine", "seq", "onecycle"], default="cosine")
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--overlap", action="store_true", help="overlap_snapshot=True (with --async)")
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--aux-head", action="store_true", help="a head used in training mode only, plain DDP")
    p.add_argument("--noise-forward", action="store_true", help="the model's forward draws torch noise")
    p.add_argument("--wrap-after-load", action="store_true", help="with --wrap bare: DDP built after load_latest")
    p.add_argument("--kill-at", default="")
    p.add_argument("--kill-rank", type=int, default=0)
    # Deliberately broken loops, for `distckpt doctor` to find (tests/tools/test_doctor.py):
    p.add_argument("--unsaved-random", action="store_true", help="noise from a random.Random not in state")
    p.add_argument("--no-worker-rng", action="store_true", help="workers without distckpt.with_worker_rng")
    p.add_argument("--no-set-epoch", action="store_true", help="never call sampler.set_epoch")
    p.add_argument("--incremental", action="store_true", help="CheckpointManager(incremental=True)")
    p.add_argument("--local-tier", action="store_true", help="two tiers: local_dir=<ckpt>-local, durable_every=2")
    p.add_argument("--freeze-fc1", action="store_true", help="fc1 frozen (not trained): a LoRA-like state")
    p.add_argument("--dump-weights", default="", help="rank 0 torch.saves the final whole state_dict here")
    p.add_argument("--forget-epoch", action="store_true",
                   help="after a resume count epochs from 0 again (set_epoch then gets the wrong epoch)")
    p.add_argument("--prefetch-unsaved", action="store_true",
                   help="draw the next batch before the step and the save, and keep it out of state")
    p.add_argument("--eval-persistent", choices=["global", "own-generator"], default=None,
                   help="an evaluation loader with persistent workers kept out of state, run every --eval-every "
                        "steps; its workers' base seed from torch's global stream, or from a generator of its own")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--prefetcher", action="store_true",
                   help="iterate the loader through a generator that holds one batch ahead (timm's PrefetchLoader)")
    p.add_argument("--val-leaves-eval-at", type=int, default=-1,
                   help="a validation pass at this step leaves the model in eval mode; model.train() "
                        "is called once after load_latest")
    return p.parse_args()


def build_optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01, amsgrad=True)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def build_scheduler(name: str, opt: torch.optim.Optimizer, steps: int) -> object:
    sched = torch.optim.lr_scheduler
    if name == "seq":
        return sched.SequentialLR(opt, [sched.LinearLR(opt, 0.1, total_iters=5),
                                        sched.CosineAnnealingLR(opt, T_max=steps)], milestones=[5])
    if name == "onecycle":
        return sched.OneCycleLR(opt, max_lr=0.02, total_steps=steps + 1)
    return sched.CosineAnnealingLR(opt, T_max=steps)


def main() -> int:
    args = parse()
    info = distckpt.init_distributed()
    rank, world = info.rank, info.world_size
    torch.manual_seed(1234)  # the same initial weights on every rank
    random.seed(rank)
    np.random.seed(rank)
    torch.use_deterministic_algorithms(True)

    net = Net(aux_head=args.aux_head, noise=args.noise_forward)
    if args.freeze_fc1:  # before wrapping: DDP and FSDP2 take the parameters that need gradients
        net.fc1.requires_grad_(False)
    if args.wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(net.fc1)
        fully_shard(net.fc2)
        fully_shard(net)
        trained: nn.Module = net
    elif args.wrap_after_load:
        trained = net  # wrapped below, once load_latest has returned
    else:
        trained = nn.parallel.DistributedDataParallel(net)
    if args.compile and not args.wrap_after_load:
        trained = torch.compile(trained, backend="eager")
    stored = net if args.wrap == "bare" else trained

    dataset = NoisyDataset()
    if args.workers and not args.no_worker_rng:
        dataset = distckpt.with_worker_rng(dataset)
    from torchdata.stateful_dataloader import StatefulDataLoader

    generator = torch.Generator().manual_seed(100 + rank) if args.loader_gen else None
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=7) \
        if args.sampler == "dist" else None
    # replayed by distckpt from its epoch's start (replay.py): it keeps no state of its own
    stateless = torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(200 + rank)) \
        if args.sampler == "torch-random" else None
    loader = StatefulDataLoader(dataset, batch_size=4, sampler=sampler or stateless,
                                shuffle=sampler is None and stateless is None,
                                num_workers=args.workers, generator=generator,
                                persistent_workers=False)
    opt = build_optimizer(args.optim, [p for p in trained.parameters() if p.requires_grad])
    sched = build_scheduler(args.sched, opt, args.steps)
    state: dict[str, object] = {"model": stored, "optimizer": opt, "scheduler": sched, "loader": loader,
                                "config": {"optim": args.optim, "accum": args.accum}}
    if sampler is not None:
        state["sampler"] = sampler
    if generator is not None:
        state["loader_generator"] = generator
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=3) if args.scaler else None
    if scaler is not None:
        state["scaler"] = scaler
    ema = None
    if args.ema:
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
        state["ema"] = ema

    tiers = {"local_dir": f"{args.ckpt}-local", "durable_every": 2} if args.local_tier else {}
    mgr = distckpt.CheckpointManager(args.ckpt, keep_last=2, async_save=args.async_save, timeout=60,
                                     incremental=args.incremental, overlap_snapshot=args.overlap, **tiers)
    epoch = 0
    batch = None
    if args.prefetch:
        state["next_batch"] = distckpt.per_rank({"x": torch.zeros(4, 8), "y": torch.zeros(4, 1)})
    progress = mgr.load_latest(state)
    if args.wrap_after_load:  # the "load, then wrap" order
        trained = nn.parallel.DistributedDataParallel(net)
        if args.compile:
            trained = torch.compile(trained, backend="eager")
    start = progress.step + 1 if progress else 0
    if progress is not None:
        epoch = 0 if args.forget_epoch else (progress.epoch or 0)
        _log_line(args.log, rank, f"# resumed from step {progress.step} epoch {progress.epoch}")
    if sampler is not None and progress is None:
        sampler.set_epoch(epoch)
    batches = _held_one_ahead if args.prefetcher else iter
    iterator = batches(loader)

    def draw() -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal iterator, epoch
        try:
            return next(iterator)
        except StopIteration:
            epoch += 1
            if sampler is not None and not args.no_set_epoch:
                sampler.set_epoch(epoch)
            iterator = batches(loader)
            return next(iterator)

    evaluation = None
    if args.eval_persistent:  # built as timm's train.py builds its evaluation loader, and left out of state
        own = torch.Generator().manual_seed(300 + rank) if args.eval_persistent == "own-generator" else None
        evaluation = torch.utils.data.DataLoader(NoisyDataset(8), batch_size=4, num_workers=2,
                                                 persistent_workers=True, generator=own)

    if args.val_leaves_eval_at >= 0:
        trained.train()  # the common "model.train() before the loop"
    if args.prefetch_unsaved:
        batch = draw()  # also after a resume: the batch drawn before the save is lost
    if args.prefetch:
        if progress is None:
            batch = draw()
        else:
            saved = state["next_batch"].obj  # type: ignore[attr-defined]
            batch = (saved["x"], saved["y"])
    hidden = random.Random(99)  # --unsaved-random: a stream the checkpoint never sees
    kills = [int(s) for s in args.kill_at.split(",") if s]
    incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step in range(start, args.steps):
        if incarnation < len(kills) and step == kills[incarnation] and rank == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.bn_eval_at:
            net.bn.eval()
        loss_sum = torch.zeros(())
        for micro in range(args.accum):
            if args.prefetch or args.prefetch_unsaved:
                x, y = batch  # type: ignore[misc]
                batch = draw()  # the next batch, drawn before the step (and before the save)
            else:
                x, y = draw()
            if args.unsaved_random:
                x = x + hidden.random() * 1e-3
            last = micro == args.accum - 1
            syncing = last or not isinstance(trained, nn.parallel.DistributedDataParallel)
            ctx = trained.no_sync() if not syncing and hasattr(trained, "no_sync") else _nullcontext()
            with ctx:
                loss = nn.functional.mse_loss(trained(x), y) / args.accum
                (scaler.scale(loss) if scaler is not None else loss).backward()
            loss_sum += loss.detach()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()  # type: ignore[attr-defined]
        if ema is not None:
            ema.update_parameters(net)
        if step == args.val_leaves_eval_at:
            trained.eval()  # validation; the loop forgets trained.train() afterwards
            with torch.no_grad():
                trained(torch.zeros(4, 8))
        if evaluation is not None and step % args.eval_every == args.eval_every - 1:
            trained.eval()
            with torch.no_grad():
                for x, _ in evaluation:
                    trained(x)
            trained.train()
        _log_line(args.log, rank, f"{step} {loss_sum.item().hex()} {_param_sum(trained, ema).hex()}")
        if (step + 1) % args.every == 0:
            if args.prefetch:
                state["next_batch"] = distckpt.per_rank({"x": batch[0], "y": batch[1]})  # type: ignore[index]
            mgr.save(step, state, epoch=epoch)
    mgr.close()
    if args.dump_weights:  # whole tensors (FSDP2: gathered, a collective) as the bare module names them
        whole = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                 for k, v in net.state_dict().items()}
        if rank == 0:
            torch.save(whole, args.dump_weights)
    distckpt.shutdown_distributed()  # as the docs tell a job to end (the gathers just above: see its docstring)
    return 0


def _held_one_ahead(loader: Any) -> Iterator[Any]:
    """The loader's batches, each taken from it one batch before it is given (timm's PrefetchLoader)."""
    first, held = True, None
    for batch in loader:
        if not first:
            yield held
        first, held = False, batch
    if not first:
        yield held


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _param_sum(model: nn.Module, ema: nn.Module | None) -> float:
    total = torch.zeros((), dtype=torch.float64)
    for p in list(model.parameters()) + (list(ema.parameters()) if ema is not None else []):
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.detach().double().sum()
    return float(total)


def _log_line(log_dir: str, rank: int, line: str) -> None:
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, f"rank-{rank}.txt"), "a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
