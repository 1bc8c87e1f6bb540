"""A DDP (or FSDP2) training loop under torchrun for elastic resume tests: a StatefulDataLoader
over a DistributedSampler, saving mid-epoch; every rank logs each step's sample ids.

    torchrun --nproc-per-node N elastic_loop.py --ckpt URL --records DIR [--save-at S] [--kill-after S]
        [--items 96] [--batch 2] [--workers 0] [--no-shuffle] [--drop-last] [--epochs 2] [--async]
        [--fsdp] [--sampler distributed|custom] [--tally none|plain|reshard]

Each rank appends `step epoch loss id,id,...` lines to DIR/rank-R.txt, and `# ...` lines for
events (resumed from, refused with). --kill-after S: every rank SIGKILLs itself once it has
trained step S (after the save of --save-at, so the steps after it are lost work).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import distckpt


class Items(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return i, torch.randn(4, generator=g)


class CustomSampler(DistributedSampler):
    """A user's sampler: distckpt cannot know its order."""


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--records", required=True)
    p.add_argument("--save-at", type=int, default=-1)
    p.add_argument("--kill-after", type=int, default=-1)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)  # seconds per step: time for a test to kill a node
    p.add_argument("--items", type=int, default=96)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--no-shuffle", action="store_true")
    p.add_argument("--drop-last", action="store_true")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--sampler", default="distributed")
    p.add_argument("--tally", default="none")
    p.add_argument("--policy", default="elastic")
    a = p.parse_args()

    distckpt.init_distributed(timeout=120)
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun's restart of the job
    records = a.records if restart == 0 else f"{a.records}-restart{restart}"
    os.makedirs(records, exist_ok=True)
    log = open(os.path.join(records, f"rank-{rank}.txt"), "a", buffering=1)

    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    if a.fsdp:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler_type = CustomSampler if a.sampler == "custom" else DistributedSampler
    sampler = sampler_type(Items(a.items), num_replicas=world, rank=rank, shuffle=not a.no_shuffle, seed=7,
                           drop_last=a.drop_last)
    loader = StatefulDataLoader(Items(a.items), batch_size=a.batch, sampler=sampler, num_workers=a.workers,
                                generator=torch.Generator().manual_seed(11))
    state: dict = {"model": model, "optimizer": opt, "sampler": sampler, "loader": loader,
                   "gen": torch.Generator().manual_seed(100 + rank)}
    if a.tally == "plain":
        state["tally"] = distckpt.per_rank(0)
    elif a.tally == "reshard":
        # each rank counts its samples; at another size the total is kept, spread over the new ranks
        state["tally"] = distckpt.per_rank(0, reshard=lambda olds, m: [sum(olds) // m + (r < sum(olds) % m)
                                                                         for r in range(m)])

    with distckpt.CheckpointManager(a.ckpt, timeout=60, world_size_policy=a.policy, async_save=a.async_save) as mgr:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                progress = mgr.load_latest(state)
            except distckpt.DistCkptError as e:
                log.write(f"# refused {type(e).__name__}: {e}\n")
                return 3
        for w in caught:
            if isinstance(w.message, distckpt.ReshardWarning):
                log.write(f"# warning {w.message}\n")
        step = progress.step + 1 if progress else 0
        epoch = progress.epoch if progress else 0
        if progress:
            log.write(f"# resumed from step {progress.step} epoch {progress.epoch} world {world} "
                      f"rederived {','.join(progress.rederived)} tally {getattr(state.get('tally'), 'obj', None)}\n")
        while epoch < a.epochs:
            sampler.set_epoch(epoch)
            for ids, x in loader:
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if "tally" in state:
                    state["tally"].obj += len(ids)
                log.write(f"{step} {epoch} {loss.item():.9g} {','.join(str(int(i)) for i in ids)}\n")
                distckpt.doctor_record(step, epoch=epoch, samples=ids, loss=loss.item())
                if step == a.save_at or (a.save_every and step % a.save_every == 0):
                    mgr.save(step, state, epoch=epoch)
                    mgr.wait()
                if a.step_sleep:
                    time.sleep(a.step_sleep)
                if step == a.kill_after:
                    log.close()
                    os.kill(os.getpid(), signal.SIGKILL)
                step += 1
            epoch += 1
        log.write("# done\n")
    dist.barrier()
    distckpt.shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
