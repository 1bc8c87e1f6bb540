"""A small causal transformer trained with DDP under torchrun, checkpointed with distckpt.

Every source of randomness a real job has is here: a private DataLoader generator, dropout,
augmentation with Python `random` and NumPy inside loader workers, a shuffled
DistributedSampler, AdamW, a warm-up + decay schedule, and validation passes that switch the
model to eval and back. Each rank appends `step loss` lines (loss as float.hex, exact) to
LOG_DIR/rank-R.txt, so two runs can be compared bit for bit.

    torchrun --nproc-per-node 2 launch/train.py --ckpt runs/a --loss-log runs/a-log --steps 120

With ``--fsdp`` the model is sharded with FSDP2 (``fully_shard`` per block and at the root)
instead of DDP: each rank then holds and checkpoints only its shards of the parameters and of
AdamW's moments; distckpt writes them from every rank under one commit.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import signal
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, DistributedSampler

import distckpt
from distckpt.runtime import faults

CORPUS_WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
                "jovial bankers near the old mill and every checkpoint is a message to a "
                "process that does not exist yet").split()


def make_corpus(n_chars: int = 40_000, seed: int = 1234) -> str:
    """Deterministic text, generated so the repository ships no data files."""
    rng = random.Random(seed)
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < n_chars:
        words.append(rng.choice(CORPUS_WORDS))
        if rng.random() < 0.1:
            words.append(".\n")
    return " ".join(words)[:n_chars]


class CharWindows(Dataset):
    """Windows of the corpus; augmentation draws from Python `random` and NumPy's global RNG."""

    def __init__(self, text: str, block: int, stride: int) -> None:
        self.vocab = sorted(set(text))
        self.ids = torch.tensor([self.vocab.index(c) for c in text], dtype=torch.long)
        self.block, self.stride = block, stride

    def __len__(self) -> int:
        return (len(self.ids) - self.block - 2) // self.stride

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.stride + random.randint(0, 1)           # jitter: Python random
        x = self.ids[start:start + self.block].clone()
        y = self.ids[start + 1:start + self.block + 1]
        mask = np.random.random(self.block) < 0.05                # token dropout: NumPy
        x[torch.from_numpy(mask)] = 0
        return x, y


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, block: int, d: int = 64, layers: int = 2, heads: int = 4,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, block, d))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: stored once, re-tied on load

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.tok(x) + self.pos[:, : x.size(1)])
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def lr_lambda(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return f


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="checkpoint root: a local path or fsspec URL")
    p.add_argument("--loss-log", required=True, help="directory for per-rank loss logs")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--ckpt-every", type=int, default=20, help="0: never (a baseline for benchmarks)")
    p.add_argument("--val-every", type=int, default=15)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--writer", default="thread", choices=("thread", "process"), help="with --async-save: who "
                   "writes the payload files (a process of its own: off the training process's GIL)")
    p.add_argument("--staging-bytes", type=int, default=None, help="with --async-save: bound on host staging")
    p.add_argument("--overlap-snapshot", action="store_true", help="with --async-save: parameters and optimizer "
                   "state copied while the next step runs (on a GPU: on a side stream)")
    p.add_argument("--local-dir", default=None, help="two tiers: every save commits to this node-local "
                   "directory, every --durable-every'th also to --ckpt (and the pre-emption and last saves)")
    p.add_argument("--durable-every", type=int, default=None)
    p.add_argument("--memory-tier", action="store_true", help="every --memory-every'th save also to this node's "
                   "shared memory, each node's ranks' files to a partner node (docs/guides/memory-tier.md)")
    p.add_argument("--memory-every", type=int, default=1)
    p.add_argument("--keep-memory", type=int, default=2)
    p.add_argument("--disk-every", type=int, default=None, help="with --memory-tier: every Nth save to disk, "
                   "the others to memory only")
    p.add_argument("--backend", default=None, help="None: NCCL on GPUs, else gloo; gloo puts several ranks on one GPU")
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (fully_shard) instead of DDP")
    p.add_argument("--world-size-policy", default="refuse", help="see CheckpointManager (reshard: "
                   "resume at another number of ranks)")
    p.add_argument("--kill-at", default=None,
                   help="SIGKILL rank R on the first attempt: 'step:N[:R]' before step N trains, "
                        "or 'POINT:N[:R]' at a distckpt fault point during the save of step N")
    return p.parse_args(argv)


def arm_kill(spec: str | None, rank: int) -> int | None:
    """Arrange a real SIGKILL of this process (first torchrun attempt only)."""
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    where, step_s, *rest = spec.split(":")
    target_rank = int(rest[0]) if rest else 0
    if rank != target_rank:
        return None
    if where == "step":
        return int(step_s)

    def hook(name: str, context: dict) -> None:
        if name == where and context.get("step") == int(step_s):
            os.kill(os.getpid(), signal.SIGKILL)

    faults.on_point(hook)
    return None


def wrap(model: TinyGPT, world_size: int, fsdp: bool) -> nn.Module:
    """DDP (replicated parameters), or FSDP2 (every rank holds a shard of each parameter)."""
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)  # the root group holds the tied embedding / head weight once
        return model
    return nn.parallel.DistributedDataParallel(model) if world_size > 1 else model


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    # cuBLAS is deterministic only with a fixed workspace; without it deterministic mode raises on GPUs
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    info = distckpt.init_distributed(backend=args.backend)
    logging.basicConfig(level=logging.INFO, format=f"[rank {info.rank}] %(message)s")
    kill_step = arm_kill(args.kill_at, info.rank)

    seed = 1234
    random.seed(seed + info.rank)
    np.random.seed(seed + info.rank)
    torch.manual_seed(seed)  # same initial weights on every rank

    block = 32
    data = CharWindows(make_corpus(), block, stride=37)
    from torchdata.stateful_dataloader import StatefulDataLoader

    sampler = DistributedSampler(data, num_replicas=info.world_size, rank=info.rank, shuffle=True,
                                 seed=seed, drop_last=True)
    generator = torch.Generator().manual_seed(seed + 100 + info.rank)
    loader = StatefulDataLoader(distckpt.with_worker_rng(data), batch_size=args.batch,
                                sampler=sampler, num_workers=args.workers, generator=generator,
                                drop_last=True)
    model = TinyGPT(len(data.vocab), block).to(info.device)
    ddp = wrap(model, info.world_size, args.fsdp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(10, args.steps))
    val_x, val_y = (t.unsqueeze(0).repeat(4, 1).to(info.device) for t in data[0])

    state = {"model": ddp, "optimizer": opt, "scheduler": sched, "sampler": sampler,
             "loader": loader, "loader_generator": generator,
             "config": {"lr": 3e-3, "batch_size": args.batch, "block": block, "workers": args.workers}}
    mgr = distckpt.CheckpointManager(args.ckpt, keep_last=args.keep_last, async_save=args.async_save,
                                     timeout=120, world_size_policy=args.world_size_policy,
                                     local_dir=args.local_dir, durable_every=args.durable_every,
                                     overlap_snapshot=args.overlap_snapshot,
                                     **({"memory_tier": True, "memory_every": args.memory_every,
                                         "keep_memory": args.keep_memory, "disk_every": args.disk_every}
                                        if args.memory_tier else {}),
                                     **({"writer": args.writer, "staging_bytes": args.staging_bytes}
                                        if args.async_save else {}))
    load_started = time.perf_counter()
    progress = mgr.load_latest(state)
    load_seconds = time.perf_counter() - load_started
    step = progress.step + 1 if progress else 0
    epoch = progress.epoch if progress else 0
    os.makedirs(args.loss_log, exist_ok=True)
    log = open(os.path.join(args.loss_log, f"rank-{info.rank}.txt"), "a", buffering=1)
    if progress:
        tier = f" ({progress.tier} tier)" if args.local_dir or args.memory_tier else ""
        log.write(f"# resumed from step {progress.step} epoch {progress.epoch}{tier}\n")
        if args.memory_tier:  # the wall clock: make compose-demo-memory counts S3's requests up to it
            log.write(f"# load_latest {load_seconds:.3f} s, returned at {time.time():.6f}\n")

    val_loss = float("nan")
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if step == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = x.to(info.device), y.to(info.device)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            sched.step()
            log.write(f"{step} {loss.item().hex()} epoch={epoch} t={time.perf_counter():.6f}\n")
            if step % args.val_every == 0:
                model.eval()
                with torch.no_grad():
                    val_loss = F.cross_entropy(model(val_x).flatten(0, 1), val_y.flatten()).item()
                model.train()
            if args.ckpt_every and step % args.ckpt_every == 0 and step > 0:
                mgr.save(step, state, epoch=epoch, metric=val_loss if math.isfinite(val_loss) else None)
            elif mgr.preemption_requested():  # SIGTERM on any rank: all save this step, then exit
                mgr.save(step, state, epoch=epoch, metric=val_loss if math.isfinite(val_loss) else None)
                mgr.close()
                log.write(f"# pre-empted after step {step}\n")
                log.close()
                sys.exit(distckpt.PREEMPTED_EXIT_CODE)
            step += 1
            if step >= args.steps:
                break
        else:
            epoch += 1
    mgr.close()
    log.write(f"# done params {float(sum(_whole(p).double().sum() for p in model.parameters())).hex()}\n")
    log.close()
    del ddp, state  # release the DDP reducer before the process group goes away
    distckpt.shutdown_distributed()


def _whole(p: torch.Tensor) -> torch.Tensor:
    """A parameter's full value (FSDP2 holds DTensor shards; collective then)."""
    return p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()


if __name__ == "__main__":
    sys.exit(main())
