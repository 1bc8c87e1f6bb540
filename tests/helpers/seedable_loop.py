"""Accelerate's prepared loader over a StatefulDataLoader with its SeedableRandomSampler (which counts
its own epochs at a pass's end) and loader workers, in one process (tests/frameworks/test_accelerate_seedable.py):

    python seedable_loop.py ROOT WORKERS [SAVE_AT]

prints `step epoch batch` for every batch of 3 epochs of 8 batches; with SAVE_AT, saves after that
step and exits (as if killed); run again without it, resumes from the root."""

from __future__ import annotations

import sys

import torch
from accelerate.utils import DataLoaderConfiguration, set_seed

import distckpt
from distckpt.integrations import accelerate as dca


class Items(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> int:
        return i


def main() -> None:
    root, workers = sys.argv[1], int(sys.argv[2])
    save_at = int(sys.argv[3]) if len(sys.argv) > 3 else None
    set_seed(1234)
    accelerator = dca.make_accelerator(
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True))
    loader = accelerator.prepare(torch.utils.data.DataLoader(Items(), batch_size=4, shuffle=True, num_workers=workers))
    state = {"loader": loader}
    with distckpt.CheckpointManager(root) as mgr:
        progress = mgr.load_latest(state)
        step = progress.step + 1 if progress else 0
        for epoch in range(progress.epoch if progress else 0, 3):
            for batch in loader:
                print(step, epoch, batch.tolist(), flush=True)
                if step == save_at:
                    mgr.save(step, state, epoch=epoch)
                    return
                step += 1


if __name__ == "__main__":
    main()
