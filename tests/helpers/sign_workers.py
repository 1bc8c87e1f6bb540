"""Functions run on every rank by distckpt.testing.run_world for the signing tests."""

from __future__ import annotations

import distckpt


def signing_on_rank_zero_only(rank: int, world: int, url: str, key: bytes) -> None:
    distckpt.CheckpointManager(url, timeout=30, signing_key=key if rank == 0 else None).close()
