"""A sampler that counts its own epochs at the end of its iterator — Accelerate's
SeedableRandomSampler, the Hugging Face Trainer's default — in a StatefulDataLoader with workers,
saved mid-pass within the workers' fetch-ahead of the pass's end: the workers had taken the pass's
last indices, the sampler had counted the next epoch, the save recorded that epoch, and every resume
of the committed step was refused at its iter() ("a position in the order of epoch 1 ... but that
sampler's epoch is 0"): a job that could never continue. Now the position is recorded in the order
its pass began with, and the resume is exact."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

import distckpt

ITEMS = 12  # 6 batches of 2 per epoch
STEPS = 20


class Items(Dataset):
    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, i: int) -> int:
        return i


def _build(workers: int) -> tuple[StatefulDataLoader, Any, dict]:
    seedable = pytest.importorskip("accelerate.data_loader").SeedableRandomSampler
    # as Accelerate's prepare builds it for a shuffled loader (its generator made up front; the run
    # checked by hand through prepare() resumed alike)
    sampler = seedable(Items(), data_seed=5, generator=torch.Generator())
    loader = StatefulDataLoader(Items(), batch_size=2, sampler=sampler, num_workers=workers)
    return loader, sampler, {"loader": loader}


def _run(loader: StatefulDataLoader, sampler: Any, first: int, epoch: int, save_at: int | None = None,
         mgr: distckpt.CheckpointManager | None = None, state: dict | None = None) -> list[tuple[int, list[int]]]:
    """The Trainer's loop shape: set_epoch(epoch) before each pass, the pass's batches, a save after a step."""
    out, step = [], first
    while step < STEPS:
        sampler.set_epoch(epoch)
        for batch in loader:
            out.append((step, batch.tolist()))
            if step == save_at and mgr is not None:
                mgr.save(step, state, epoch=epoch)
            step += 1
            if step >= STEPS:
                break
        else:
            epoch += 1
    return out


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("save_at", [2, 3, 4, 8, 10])  # mid-pass: far from and within the workers' fetch-ahead of its end
def test_a_sampler_counting_its_own_epochs_resumes_exactly_near_a_pass_end(tmp_path, workers, save_at):
    root = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    loader, sampler, state = _build(workers)
    with distckpt.CheckpointManager(root) as mgr:
        assert mgr.load_latest(state) is None
        reference = _run(loader, sampler, 0, 0, save_at, mgr, state)
    torch.manual_seed(99)  # the resumed process starts from other streams
    loader, sampler, state = _build(workers)
    with distckpt.CheckpointManager(root) as mgr:
        progress = mgr.load_latest(state)
    assert progress is not None and progress.step == save_at
    assert _run(loader, sampler, save_at + 1, progress.epoch) == reference[save_at + 1:]
