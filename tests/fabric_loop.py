"""A Lightning Fabric training loop checkpointed as the README says (tests/test_fabric.py), under
torchrun with 2 ranks:
    python -m torch.distributed.run --nproc-per-node 2 fabric_loop.py ROOT STOP_AFTER LOG WORKERS [MODE]
MODE: "readme" (the module and optimizer fabric.setup returns in `state`, the StatefulDataLoader
iterated itself), "fabric-loader" (the loop iterates fabric.setup_dataloaders' wrapper, `state`
holds the StatefulDataLoader under it), "fabric-loader-in-state" (the wrapper in `state`).
STOP_AFTER >= 0 ends the process abruptly right after that step's save (as a kill would)."""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import torch
from lightning_fabric import Fabric
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import distckpt


class Noisy(Dataset):
    """Inputs with augmentation drawn from torch, Python and NumPy in the loader workers."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((4,), float(i)) / 48 + 0.1 * torch.randn(4) + random.random() * 0.01 + np.random.rand() * 0.01
        return x.float(), x.sum(0, keepdim=True).float()


def main() -> None:
    root, stop_after, log_path, workers = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    mode = sys.argv[5] if len(sys.argv) > 5 else "readme"
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric.launch()
    fabric.seed_everything(1234)  # torch, NumPy and Python's global streams
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer.optimizer, max_lr=1e-2, total_steps=18)
    dataset = distckpt.with_worker_rng(Noisy()) if workers else Noisy()
    sampler = DistributedSampler(dataset, num_replicas=fabric.world_size, rank=fabric.global_rank, shuffle=True,
                                 seed=0)
    loader = StatefulDataLoader(dataset, batch_size=4, sampler=sampler, num_workers=workers)
    batches = loader
    if mode != "readme":
        batches = fabric.setup_dataloaders(loader, use_distributed_sampler=False)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler,
             "loader": batches if mode == "fabric-loader-in-state" else loader}
    with distckpt.CheckpointManager(root) as mgr:
        progress = mgr.load_latest(state)
        step = progress.step + 1 if progress else 0  # micro-batches; optimizer steps every 2nd
        with open(f"{log_path}.{fabric.global_rank}", "a") as log:
            for epoch in range(progress.epoch if progress else 0, 3):
                sampler.set_epoch(epoch)
                for x, y in batches:
                    with fabric.no_backward_sync(model, enabled=step % 2 == 0):
                        loss = torch.nn.functional.mse_loss(model(x), y)
                        fabric.backward(loss)
                    if step % 2 == 1:
                        optimizer.step()
                        scheduler.step()
                        optimizer.zero_grad()
                    weights = sum(p.double().sum() for p in model.parameters()).item()
                    buffers = sum(b.double().sum() for b in model.buffers()).item()
                    log.write(f"{step} {epoch} {x.sum().item().hex()} {loss.item().hex()} {weights.hex()} "
                              f"{buffers.hex()}\n")
                    if step % 4 == 3:
                        mgr.save(step, state, epoch=epoch)
                        if step == stop_after:
                            log.flush()
                            os._exit(0)
                    step += 1


if __name__ == "__main__":
    main()
