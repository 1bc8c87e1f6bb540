"""Rank bodies for the writer-process and bounded-staging tests (run by distckpt.testing.run_world)."""

from __future__ import annotations

import os
import signal

import torch

import distckpt
from distckpt.runtime import faults


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    return {"model": model, "extra": torch.arange(1000, dtype=torch.float64)}


def killed_writer(rank: int, world: int, url: str, kill_on: int, split_writes: bool) -> dict:
    """Step 1 commits; during step 2 rank `kill_on`'s writer process is SIGKILLed just before
    its payload write; every rank reports what wait() raised; step 3 then commits with a new
    writer process."""
    mgr = distckpt.CheckpointManager(url, timeout=60, async_save=True, writer="process", split_writes=split_writes)
    writer = mgr._session.process_writer
    point = "save/gathered" if (kill_on == 0 and not split_writes) else "save/rank-files-written"

    def kill(name: str, context: dict) -> None:
        if name == point and context.get("step") == 2 and rank == kill_on and writer.pid is not None:
            os.kill(writer.pid, signal.SIGKILL)

    faults.on_point(kill)
    state = _state()
    mgr.save(1, state)
    mgr.wait()
    first_pid = writer.pid
    mgr.save(2, state)
    error = None
    try:
        mgr.wait()
    except distckpt.AsyncSaveError as e:
        error = str(e)
    mgr.save(3, state)
    mgr.wait()
    out = {"error": error, "steps": mgr.committed_steps(), "restarted": writer.pid != first_pid}
    mgr.close()
    return out


def bounded_peak(rank: int, world: int, url: str, mib: int, staging_fraction: float | None,
                 writer: str = "thread") -> dict:
    """Peak extra host memory of one async save on this rank (VmHWM after, minus RSS before)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(mib)])  # 1 MiB each
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bound = None if staging_fraction is None else int(state_bytes * staging_fraction)
    mgr = distckpt.CheckpointManager(url, timeout=120, async_save=True, staging_bytes=bound, writer=writer)
    mgr.save(0, {"warm": torch.zeros(1)})  # a writer process has started and imported torch
    mgr.wait()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from the current RSS
    before = _status("VmRSS")
    mgr.save(1, {"model": model})
    mgr.wait()
    peak = _status("VmHWM")
    stall = mgr._session.staging.stats() if bound is not None else None
    mgr.close()
    return {"extra": (peak - before) / state_bytes, "stats": stall}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)
