"""Rank functions for cooperative loads (tests/distributed/test_cooperative.py)."""

from __future__ import annotations

import os
import signal
import time
import warnings

import torch

import distckpt
from distckpt.runtime import faults


def replicated_tensors(seed: int, mib: float = 4.0) -> dict[str, torch.Tensor]:
    """Every dtype the bitwise promise covers, empty tensors and non-contiguous views, with one
    large tensor so the file is worth splitting (about `mib` MiB in all)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(mib * 2**20),), dtype=torch.uint8, generator=g)
    big = raw.view(torch.float32)  # any bits: NaNs and infinities of every kind too
    grid = torch.randn(64, 48, generator=g, dtype=torch.float64)
    return {
        "big": big,
        "bf16": torch.randn(333, generator=g).to(torch.bfloat16),
        "f16": torch.randn(17, 5, generator=g).to(torch.float16),
        "int8": torch.randint(-128, 128, (1001,), dtype=torch.int8, generator=g),
        "uint8": torch.randint(0, 256, (77,), dtype=torch.uint8, generator=g),
        "int64": torch.randint(-2**62, 2**62, (9,), dtype=torch.int64, generator=g),
        "bool": torch.randint(0, 2, (123,), generator=g).to(torch.bool),
        "empty": torch.empty(0, dtype=torch.float32),
        "empty_2d": torch.empty(3, 0, dtype=torch.bfloat16),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "transposed": grid.t(),                    # a non-contiguous view, saved as its own bytes
        "strided": grid[::3, 1::2],                # every third row, every other column
        "slice": raw[1000:1013],                   # 13 bytes of the big buffer
    }


def bits(t: torch.Tensor) -> bytes:
    """A tensor's bytes in row-major order (0-dim and empty tensors too)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _state(rank: int, seed: int, mib: float) -> dict:
    return {"r": dict(replicated_tensors(seed, mib)), "gen": torch.Generator().manual_seed(100 + rank)}


def _counting() -> dict[str, int]:
    seen = {"exchanges": 0}

    def hook(name: str, context: dict) -> None:
        if name == "load/cooperative-exchange":
            seen["exchanges"] += 1
    faults.on_point(hook)
    return seen


def save(rank: int, world: int, url: str, options: dict, steps: tuple[int, ...] = (), mib: float = 4.0) -> None:
    """Step 1 of seed 0; with `steps`, each of them with the step as its seed."""
    with distckpt.CheckpointManager(url, storage_options=options, timeout=60) as mgr:
        for step in steps or (1,):
            mgr.save(step, _state(rank, step if steps else 0, mib))


def load(rank: int, world: int, url: str, options: dict, mib: float = 4.0) -> dict:
    """Load into empty destinations; every tensor's bytes, dtype, shape, and whether the
    replicated file was exchanged between the ranks."""
    seen = _counting()
    state = {"r": {}, "gen": torch.Generator()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distckpt.CheckpointManager(url, storage_options=options, timeout=60) as mgr:
            progress = mgr.load_latest(state)
    return {"step": progress.step,
            "tensors": {k: (str(t.dtype), tuple(t.shape), bits(t)) for k, t in state["r"].items()},
            "exchanges": seen["exchanges"],
            "fallbacks": [str(w.message) for w in caught if w.category is distckpt.CheckpointFallbackWarning]}


def die_during_load(rank: int, world: int, url: str, options: dict, timeout_s: float, point: str) -> dict:
    """Rank 1 is SIGKILLed at `point` of a cooperative load; the others say what they raised
    and whether their live state changed."""
    if rank == 1:
        faults.on_point(lambda name, ctx: os.kill(os.getpid(), signal.SIGKILL) if name == point else None)
    state = {"r": {"big": torch.zeros(4)}, "gen": torch.Generator().manual_seed(7)}
    before = (state["r"]["big"].clone(), state["gen"].get_state().clone())
    started = time.monotonic()
    with distckpt.CheckpointManager(url, storage_options=options, timeout=timeout_s) as mgr:
        try:
            mgr.load_latest(state)
            raised = None
        except distckpt.DistCkptError as e:
            raised = (type(e).__name__, str(e))
    unchanged = (list(state["r"]) == ["big"] and torch.equal(state["r"]["big"], before[0])
                 and torch.equal(state["gen"].get_state(), before[1]))
    return {"raised": raised, "elapsed": time.monotonic() - started, "unchanged": unchanged}


def exchange_generated_sizes(rank: int, world: int, examples: int) -> int:
    """Every rank runs the same derandomized hypothesis examples (no database, no shrinking, so
    the draws are identical on every rank): per example a message size for each rank, from 0
    bytes to past the old 64 KiB slot, and each rank checks every message it receives through
    all_gather, gather and broadcast byte for byte. Returns the examples run."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from distckpt.protocol.coord import SLOT_BYTES, GlooCoordinator

    edges = [0, 1, SLOT_BYTES - 64, SLOT_BYTES, SLOT_BYTES + 1, 64 << 10, (64 << 10) + 1, 200 << 10]
    size = st.one_of(st.sampled_from(edges), st.integers(0, 3 * SLOT_BYTES), st.integers(0, 160 << 10))
    coord = GlooCoordinator(timeout_s=60)
    ran = [0]

    def payload(who: int, n: int, i: int) -> dict:
        return {"rank": who, "blob": bytes((who * 7 + i + k) % 256 for k in range(min(n, 64))) * (n // 64)
                + bytes(n % 64), "text": "é" * (n % 5)}

    @settings(max_examples=examples, derandomize=True, database=None, phases=[Phase.generate],
              deadline=None, suppress_health_check=list(HealthCheck))
    @given(sizes=st.lists(size, min_size=world, max_size=world))
    def check(sizes: list[int]) -> None:
        i = ran[0]
        ran[0] += 1
        expected = [payload(r, n, i) for r, n in enumerate(sizes)]
        assert coord.all_gather(expected[rank], f"test/all-gather {i}") == expected
        gathered = coord.gather(expected[rank], f"test/gather {i}")
        assert gathered == (expected if rank == 0 else None)
        assert coord.broadcast(expected[0] if rank == 0 else None, f"test/broadcast {i}") == expected[0]

    try:
        check()
    finally:
        coord.close()
    return ran[0]
