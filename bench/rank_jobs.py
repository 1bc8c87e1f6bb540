"""What each rank does in the multi-rank benchmark rows (run by distckpt.testing.run_world)."""

from __future__ import annotations

import os
import shutil
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

import distckpt


def _state(mib: float) -> dict[str, torch.Tensor]:
    n = 8
    per = max(1, int(mib * 2**20) // 4 // n)
    g = torch.Generator().manual_seed(0)  # every rank holds the same (replicated) state
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n)}


WARMUP_ROUNDS = 2


def _timed(fn, repeats: int) -> float:
    """Median over repeats of the slowest rank's time (a collective call ends when all ranks do)."""
    times = []
    # Two warm-up rounds: the steady state of a job that keeps one checkpoint starts at its third
    # save, the first whose pages come from a deleted checkpoint (on this VM, writes into pages
    # the hypervisor took back ran ~4x slower: 1.1-1.4 s against 0.25 s for 256 MiB).
    for _ in range(repeats + WARMUP_ROUNDS):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times[WARMUP_ROUNDS:])


def _distckpt_rows(url: str, state: dict, target: dict, repeats: int, suffix: str = "",
                   **options: object) -> dict[str, float]:
    """distckpt's save and load rows. keep_last=1: the dcp row removes its previous checkpoint
    inside its timing too; piling up checkpoints instead makes later saves pay for the page
    cache's writeback (0.60 s against 0.27 s per save at 2 ranks, 256 MiB, FSDP2, measured with
    bench/profile_sharded.py)."""
    mgr = distckpt.CheckpointManager(url, timeout=300, keep_last=1, **options)  # type: ignore[arg-type]
    steps = iter(range(10**6))
    out = {f"distckpt save{suffix}": _timed(lambda: mgr.save(next(steps), state), repeats),
           f"distckpt load{suffix}": _timed(lambda: mgr.load_latest(target), repeats)}
    mgr.close()
    return out


def _fresh_dcp_save(rank: int, dcp_dir: str, state_dict: Callable[[], dict]) -> Callable[[], None]:
    """dcp.save into an emptied directory (dcp has no retention; rank 0 empties it, inside the timing)."""
    import torch.distributed.checkpoint as dcp

    def save() -> None:
        if rank == 0:
            shutil.rmtree(dcp_dir, ignore_errors=True)
        dist.barrier()
        dcp.save(state_dict(), checkpoint_id=dcp_dir)

    return save


def save_load_rows(rank: int, world: int, root: str, mib: float, repeats: int) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    state = _state(mib)
    target = {k: torch.empty_like(v) for k, v in state.items()}
    url = os.path.join(root, f"distckpt-w{world}")
    out = _distckpt_rows(url, state, target, repeats)
    out.update(_distckpt_rows(url + "-split", state, target, repeats, " (split_writes)", split_writes=True))
    dcp_dir = os.path.join(root, f"dcp-w{world}")
    out["dcp.save"] = _timed(_fresh_dcp_save(rank, dcp_dir, lambda: state), repeats)
    out["dcp.load"] = _timed(lambda: dcp.load(target, checkpoint_id=dcp_dir), repeats)
    return out


def coordination_rows(rank: int, world: int, root: str, repeats: int) -> dict[str, float]:
    """A tiny state: what is left is the protocol's collectives and small-file I/O."""
    torch.set_num_threads(1)
    mgr = distckpt.CheckpointManager(os.path.join(root, f"tiny-w{world}"), keep_last=1, timeout=300)
    state = {"x": torch.zeros(1), "g": torch.Generator().manual_seed(rank)}
    steps = iter(range(10**6))
    out = {"save (tiny state)": _timed(lambda: mgr.save(next(steps), state), repeats),
           "load (tiny state)": _timed(lambda: mgr.load_latest(state), repeats)}
    mgr.close()
    return out


def sharded_rows(rank: int, world: int, root: str, mib: float, repeats: int) -> dict[str, float]:
    """FSDP2 (fully_shard) model of `mib` MiB in all, each rank holding 1/world of it."""
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    width, layers = 1024, 8
    rows = max(world, int(mib * 2**20) // 4 // width // layers)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, rows, bias=False) for _ in range(layers)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    state = {"model": model}
    out = _distckpt_rows(os.path.join(root, f"distckpt-sharded-w{world}"), state, state, repeats)
    dcp_dir = os.path.join(root, f"dcp-sharded-w{world}")
    dcp_save = _fresh_dcp_save(rank, dcp_dir, lambda: {"model": get_model_state_dict(model)})

    def dcp_load() -> None:
        sd = {"model": get_model_state_dict(model)}
        dcp.load(sd, checkpoint_id=dcp_dir)
        set_model_state_dict(model, sd["model"])

    out["dcp.save"] = _timed(dcp_save, repeats)
    out["dcp.load"] = _timed(dcp_load, repeats)
    return out
