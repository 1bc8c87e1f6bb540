"""Run by tests/protocol/test_crash_matrix.py on every rank of a real gloo world (distckpt.testing)."""

from __future__ import annotations

import hashlib
import os
import signal
import time

import torch
from torch import nn

import distckpt
from distckpt.runtime import faults

TIMEOUT_S = 8.0


def state_for(step: int, rank: int) -> dict:
    """Replicated weights that depend on the step; per-rank generators on (step, rank)."""
    torch.manual_seed(step)
    model = nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "gen": torch.Generator().manual_seed(1000 * step + rank),
            "config": {"width": 64}}


def blank_state(rank: int) -> dict:
    state = state_for(0, rank)
    with torch.no_grad():
        for p in state["model"].parameters():
            p.zero_()
    return state


def fingerprint(state: dict) -> str:
    h = hashlib.sha256()
    for t in state["model"].state_dict().values():
        h.update(t.numpy().tobytes())
    for group in state["optimizer"].state.values():
        for v in group.values():
            h.update(v.numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    h.update(state["gen"].get_state().numpy().tobytes())
    return h.hexdigest()


def _kill_at(point: str, victim: int, rank: int) -> None:
    def hook(name: str, context: dict) -> None:
        if name == point and rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
    faults.on_point(hook)


def crash_during(rank: int, world: int, url: str, options: dict | None, point: str, victim: int) -> dict:
    """Commit step 1 (and 2 for load points), then SIGKILL `victim` at `point` of the next phase."""
    mgr = distckpt.CheckpointManager(url, storage_options=options, timeout=TIMEOUT_S, keep_last=1)
    mgr.save(1, state_for(1, rank), epoch=0)
    if point.startswith("load/"):
        mgr.save(2, state_for(2, rank), epoch=0)
    _kill_at(point, victim, rank)
    start = time.monotonic()
    try:
        if point.startswith("load/"):
            mgr.load_latest(blank_state(rank))
        else:
            mgr.save(2, state_for(2, rank), epoch=0)
        return {"error_type": None, "seconds": time.monotonic() - start}
    except distckpt.DistCkptError as e:
        return {"error_type": type(e).__name__, "error": str(e)[:500], "seconds": time.monotonic() - start}


def resume_and_continue(rank: int, world: int, url: str, options: dict | None) -> dict:
    """What the restarted job does: load the newest commit, check it, save the next step."""
    with distckpt.CheckpointManager(url, storage_options=options, timeout=30, keep_last=1) as mgr:
        state = blank_state(rank)
        progress = mgr.load_latest(state)
        out = {"step": progress.step, "loaded": fingerprint(state),
               "expected": fingerprint(state_for(progress.step, rank))}
        nxt = progress.step + 1
        mgr.save(nxt, state_for(nxt, rank), epoch=0)
        again = blank_state(rank)
        out["next"] = (mgr.load_latest(again).step, fingerprint(again) == fingerprint(state_for(nxt, rank)))
    return out
