"""A Hugging Face Accelerate training loop checkpointed as the README says (tests/test_loop_patterns.py):
    python accelerate_loop.py ROOT STOP_AFTER LOG WORKERS [prepared-loader]
STOP_AFTER >= 0 ends the process abruptly right after that step's save (as a kill would)."""

from __future__ import annotations

import os
import sys

import torch
from accelerate import Accelerator
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import distckpt


class Noisy(Dataset):
    """Inputs with augmentation drawn in the loader workers."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((4,), float(i)) / 24 + 0.1 * torch.randn(4)
        return x, x.sum(0, keepdim=True)


def main() -> None:
    root, stop_after, log_path, workers = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    dataset = distckpt.with_worker_rng(Noisy())
    sampler = DistributedSampler(dataset, num_replicas=accelerator.num_processes, rank=accelerator.process_index,
                                 shuffle=True, seed=0)
    loader = StatefulDataLoader(dataset, batch_size=4, sampler=sampler, num_workers=workers)
    if sys.argv[5:] == ["prepared-loader"]:
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    else:  # the README's way: the loader stays out of prepare()
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler, "loader": loader}
    with distckpt.CheckpointManager(root) as mgr:
        progress = mgr.load_latest(state)
        step = progress.step + 1 if progress else 0  # micro-batches; optimizer steps every 2nd
        with open(log_path, "a") as log:
            for epoch in range(progress.epoch if progress else 0, 3):
                sampler.set_epoch(epoch)
                for x, y in loader:
                    with accelerator.accumulate(model):
                        loss = torch.nn.functional.mse_loss(model(x), y)
                        accelerator.backward(loss)
                        if accelerator.sync_gradients:
                            accelerator.clip_grad_norm_(model.parameters(), 1.0)
                        optimizer.step()
                        scheduler.step()
                        optimizer.zero_grad()
                    weights = sum(p.double().sum() for p in model.parameters()).item()
                    log.write(f"{step} {epoch} {x.sum().item().hex()} {loss.item().hex()} {weights.hex()}\n")
                    if accelerator.sync_gradients and (step + 1) % 4 == 0:
                        mgr.save(step, state, epoch=epoch)
                        if step == stop_after:
                            log.flush()
                            os._exit(0)
                    step += 1


if __name__ == "__main__":
    main()
