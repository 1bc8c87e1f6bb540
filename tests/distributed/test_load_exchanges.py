"""How many exchanges a load makes as the ranks grow, and that merging them kept the guarantees:
a failure on one rank in the load's one apply exchange is the same error on every rank, and what
can be put back is, on every rank."""

from __future__ import annotations

import pytest

from distckpt.testing import run_world

W = "exchange_workers"

# A tiny state (a tensor, a generator, a plain value): the request with the choice of step, the
# read's outcomes, one apply exchange, whatever the world size.
TINY = {"load/request": 1, "load/read": 1, "load/apply": 1}


@pytest.mark.parametrize("world", [2, 4])
def test_a_tiny_load_makes_three_exchanges_at_any_world_size(ckpt_dir, world):
    results = run_world(f"{W}:count_load_exchanges", world, url=ckpt_dir, state="tiny")
    for r in results:
        assert r.error is None, r.error
        assert r.value == {"latest": TINY, "explicit": TINY}, (r.rank, r.value)


def test_a_plain_module_is_restored_in_the_one_apply_exchange(ckpt_dir):
    for r in run_world(f"{W}:count_load_exchanges", 2, url=ckpt_dir, state="module"):
        assert r.error is None, r.error
        assert r.value == {"latest": TINY, "explicit": TINY}, (r.rank, r.value)


def test_an_early_entry_that_may_fail_on_one_rank_keeps_the_exchange_between_the_phases_on_every_rank(ckpt_dir):
    """Rank 1's module has a load hook (restored early, its restore may refuse); rank 0's has
    none. Both ranks agree between the phases: had rank 0 restored everything at once, a refusal
    on rank 1 would have found rank 0's late entries already changed."""
    two = {**TINY, "load/apply-modules": 1}
    for r in run_world(f"{W}:count_load_exchanges", 2, url=ckpt_dir, state="hooked-on-1"):
        assert r.error is None, r.error
        assert r.value == {"latest": two, "explicit": two}, (r.rank, r.value)


@pytest.mark.parametrize("failing", [0, 1])
def test_a_rank_failing_in_the_one_apply_exchange_is_the_same_error_on_every_rank(ckpt_dir, failing):
    results = run_world(f"{W}:fail_after_the_restore", 2, url=ckpt_dir, failing=failing)
    firsts = set()
    for r in results:
        assert r.error is None, r.error
        assert r.value["error_type"] == "IncompatibleCheckpointError", r.value
        assert f"rank(s) [{failing}]" in r.value["error"] and "injected" in r.value["error"], r.value
        firsts.add(r.value["error"])
        assert r.value["exchanges"] == TINY, r.value  # the one apply exchange: the phases were merged
        assert all(r.value["put_back"].values()), (r.rank, r.value["put_back"])
        assert r.value["then"] == 1
    assert len(firsts) == 1, firsts
