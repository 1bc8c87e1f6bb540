"""Worker for tests/protocol/test_fencing.py: one independent job (world of one) saving a step."""

from __future__ import annotations

import time

import torch

import distckpt


def save_at(url: str, storage_options: dict | None, who: int, step: int, start_at: float) -> dict:
    mgr = distckpt.CheckpointManager(url, storage_options=storage_options)
    state = {"w": torch.full((4,), float(who))}
    time.sleep(max(0.0, start_at - time.time()))  # both writers start together
    try:
        mgr.save(step, state)
        return {"who": who, "ok": True}
    except distckpt.DistCkptError as e:
        return {"who": who, "ok": False, "error_type": type(e).__name__, "error": str(e)}
    finally:
        mgr.close()
