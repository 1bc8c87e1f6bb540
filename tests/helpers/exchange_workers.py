"""Functions run on every rank by distckpt.testing.run_world: how many exchanges a load makes,
and what one failing rank does to the others in the load's one apply exchange."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn

import distckpt
from distckpt.runtime import faults


def _tiny(rank: int, value: int = 0) -> dict[str, Any]:
    """What bench/protocol_scaling.py loads: a tensor, a per-rank generator, and a plain value."""
    return {"x": torch.full((4,), float(value)), "g": torch.Generator().manual_seed(rank), "n": {"count": value}}


def _with_module(rank: int, hooked: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    if hooked:  # load logic of its own: restored early, and its restore may fail
        model.register_load_state_dict_post_hook(lambda module, keys: None)
    return {"model": model, "g": torch.Generator().manual_seed(rank)}


def _counted(mgr: distckpt.CheckpointManager, call: Any) -> dict[str, int]:
    exchanges = mgr._coord.exchanges  # type: ignore[attr-defined]
    before = dict(exchanges)
    call()
    return {k: v - before.get(k, 0) for k, v in exchanges.items() if v != before.get(k, 0)}


def count_load_exchanges(rank: int, world: int, url: str, state: str) -> dict[str, dict[str, int]]:
    """The exchanges of a load_latest and of a load(step), per phase, on this rank. `state`:
    "tiny", "module" (a plain module), or "hooked-on-1" (rank 1's module has a load hook)."""
    make = {"tiny": lambda: _tiny(rank), "module": lambda: _with_module(rank, False),
            "hooked-on-1": lambda: _with_module(rank, rank == 1)}[state]
    with distckpt.CheckpointManager(url, timeout=60) as mgr:
        mgr.save(1, make())
        loaded = make()
        return {"latest": _counted(mgr, lambda: mgr.load_latest(loaded)),
                "explicit": _counted(mgr, lambda: mgr.load(loaded, 1))}


def fail_after_the_restore(rank: int, world: int, url: str, failing: int) -> dict[str, Any]:
    """Rank `failing` raises once everything is restored (the fault point after the RNG streams):
    every rank's error, exchanges, and whether what can be put back was, everywhere."""
    with distckpt.CheckpointManager(url, timeout=60) as mgr:
        mgr.save(1, _tiny(rank))
        state = _tiny(rank, value=10)
        state["g"].manual_seed(1000 + rank)
        random.seed(7)
        np.random.seed(7)
        torch.manual_seed(7)
        before = {"g": state["g"].get_state().clone(), "n": dict(state["n"]), "rng": torch.get_rng_state().clone(),
                  "py": random.getstate(), "np": np.random.get_state()[1].copy()}
        remove = faults.on_point(lambda name, ctx: _raise() if name == "load/applied" and rank == failing else None)
        out: dict[str, Any] = {}

        def load() -> None:
            try:
                mgr.load_latest(state)
            except distckpt.DistCkptError as e:
                out["error_type"], out["error"] = type(e).__name__, str(e).splitlines()[0]

        out["exchanges"] = _counted(mgr, load)
        out["put_back"] = {"g": torch.equal(before["g"], state["g"].get_state()), "n": state["n"] == before["n"],
                           "rng": torch.equal(before["rng"], torch.get_rng_state()), "py": random.getstate() == before["py"],
                           "np": bool((np.random.get_state()[1] == before["np"]).all())}
        remove()
        out["then"] = mgr.load(_tiny(rank), 1).step  # the group still works: the failure was agreed
    return out


def _raise() -> None:
    raise RuntimeError("injected after every entry was restored")
