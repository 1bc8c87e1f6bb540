"""A small data-parallel training loop for the memory tier's multi-node tests (run under torchrun).

    memory_loop.py URL LOG_DIR STEPS [--options JSON] [--kill-at STEP:RANK] [--no-save-after-resume]
                   [--async] [--local-dir DIR --durable-every N] [--memory-every N] [--fault POINT:RANK]

Every rank logs `<step> <loss as float.hex>` per step to LOG_DIR/rank-<r>.txt, and the resume as
`# resumed <step> <tier>` (or `# fresh`). The model's gradients are averaged by hand (all_reduce),
so the replicated entries hold the same values on every rank, as DDP's do. --kill-at SIGKILLs the
rank after that step's save returns; --fault SIGKILLs a rank at a named fault point of a save.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist

import distckpt
from distckpt.runtime import faults


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("log_dir")
    parser.add_argument("steps", type=int)
    parser.add_argument("--options", help="storage_options as JSON")
    parser.add_argument("--kill-at")
    parser.add_argument("--fault")
    parser.add_argument("--no-save-after-resume", action="store_true")
    parser.add_argument("--async", dest="async_save", action="store_true")
    parser.add_argument("--local-dir")
    parser.add_argument("--durable-every", type=int)
    parser.add_argument("--memory-every", type=int)
    parser.add_argument("--disk-every", type=int, help="every Nth save to disk, the others to memory only")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 (fully_shard)")
    args = parser.parse_args()

    distckpt.init_distributed(timeout=60)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.Tanh(),
                                torch.nn.Linear(args.width, 1))
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1000 + rank)
    state = {"model": model, "optimizer": opt, "data": data}
    options = json.loads(args.options) if args.options else None
    # a node-local directory per node: "{node}" stands for torchrun's GROUP_RANK
    local_dir = args.local_dir.replace("{node}", os.environ.get("GROUP_RANK", "0")) if args.local_dir else None
    tiers = {"local_dir": local_dir, "durable_every": args.durable_every} if local_dir else {}
    if args.fault:  # POINT[@AREA]:RANK — SIGKILL this rank there, at the first save of step 3 or later
        point, who = args.fault.rsplit(":", 1)
        point, _, area = point.partition("@")

        def hook(name: str, context: dict) -> None:
            if name == point and int(who) == rank and context.get("step", 0) >= 3 \
                    and f"/{area}" in str(context.get("area", f"/{area}")):
                os.kill(os.getpid(), signal.SIGKILL)

        faults.on_point(hook)
    mgr = distckpt.CheckpointManager(args.url, storage_options=options, memory_tier=True, keep_memory=2,
                                     memory_every=args.memory_every, disk_every=args.disk_every, timeout=30, async_save=args.async_save,
                                     **tiers)
    started = time.perf_counter()
    progress = mgr.load_latest(state)
    log = open(os.path.join(args.log_dir, f"rank-{rank}.txt"), "a", buffering=1)
    log.write(f"# resumed {progress.step} {progress.tier} {time.perf_counter() - started:.3f}\n" if progress
              else "# fresh\n")
    start = progress.step + 1 if progress else 0
    kill_step, kill_rank = (int(x) for x in args.kill_at.split(":")) if args.kill_at else (-1, -1)
    for step in range(start, args.steps):
        x = torch.randn(8, args.width, generator=data)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters() if not args.fsdp else ():  # FSDP2 reduces the gradients itself
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        log.write(f"{step} {loss.item().hex()}\n")
        if not (progress is not None and args.no_save_after_resume):
            mgr.save(step, state)
        if step == kill_step and rank == kill_rank:
            if args.async_save:
                mgr.wait()
            os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    distckpt.shutdown_distributed()


if __name__ == "__main__":
    main()
