"""Workers for distckpt.testing.run_world used by tests/unit/test_hostile_corpus.py."""

from __future__ import annotations

import torch
from torch import nn

import distckpt


def model_for(step: int) -> nn.Module:
    """The same on every rank: a replicated model whose values name the step it was saved at."""
    torch.manual_seed(step)
    return nn.Linear(32, 8)


def save_two_steps_with_split_writes(rank: int, world: int, url: str) -> None:
    """Steps 1 and 2, the replicated tensors spread over the ranks' shard files (split writes)."""
    with distckpt.CheckpointManager(url, timeout=30, split_writes=True) as mgr:
        for step in (1, 2):
            mgr.save(step, {"model": model_for(step)})
