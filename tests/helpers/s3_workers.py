"""Rank functions for multi-process S3 tests."""

from __future__ import annotations

import torch

import distckpt


def save_once(rank: int, world: int, url: str, options: dict) -> None:
    with distckpt.CheckpointManager(url, storage_options=options, timeout=60) as mgr:
        mgr.save(1, {"w": torch.ones(10), "g": torch.Generator().manual_seed(rank)})
