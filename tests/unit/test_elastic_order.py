"""The index arithmetic of world_size_policy="elastic", with no processes: the global order is
DistributedSampler's, and any resize (any N, M, length, batch size, drop_last, consumed counts,
one resize or several) deals every position of the epoch exactly once (plus the documented
padding of at most M-1, or the documented cut), in the epoch's global order."""

from __future__ import annotations

import collections
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

import distckpt
from distckpt.state.elastic import (
    ElasticContext,
    ElasticPlan,
    Order,
    RemainderSampler,
    consumed_samples,
    remainder,
    split,
)

EXAMPLES = int(os.environ.get("DISTCKPT_HYPOTHESIS_EXAMPLES", "40"))

orders = st.builds(Order, dataset_len=st.integers(1, 120), num_replicas=st.integers(1, 9), shuffle=st.booleans(),
                   drop_last=st.booleans(), seed=st.integers(0, 2 ** 31), epoch=st.integers(0, 5))


@settings(max_examples=EXAMPLES * 3, deadline=None, derandomize=True)
@given(order=orders)
def test_the_global_order_is_the_samplers_own(order):
    """G[r::N] is exactly what DistributedSampler(rank=r) yields (padding and truncation included)."""
    g = order.global_indices()
    for rank in range(order.num_replicas):
        sampler = DistributedSampler(range(order.dataset_len), num_replicas=order.num_replicas, rank=rank,
                                     shuffle=order.shuffle, seed=order.seed, drop_last=order.drop_last)
        sampler.set_epoch(order.epoch)
        assert g[rank::order.num_replicas] == list(sampler)
        assert order.share() == len(sampler)


def _expected_after(rest: list[int], world: int, drop_last: bool) -> list[int]:
    """What a new world of `world` ranks takes of `rest`, in dealing order (independent of split())."""
    if not rest or len(rest) % world == 0:
        return list(rest)
    if drop_last:
        return rest[: len(rest) // world * world]
    pad = world - len(rest) % world
    return rest + [rest[i % len(rest)] for i in range(pad)]


def _interleave(shares: list[list[int]]) -> list[int]:
    out = []
    for i in range(max((len(s) for s in shares), default=0)):
        out.extend(s[i] for s in shares if i < len(s))
    return out


@st.composite
def resizes(draw):
    order = draw(orders)
    plan = ElasticPlan(order)
    history = []  # (shares before, consumed, new world)
    for _ in range(draw(st.integers(1, 3))):
        shares = plan.assigned()
        lockstep = draw(st.booleans())
        if lockstep:
            k = draw(st.integers(0, min(len(s) for s in shares)))
            consumed = [k] * len(shares)
        else:
            consumed = [draw(st.integers(0, len(s))) for s in shares]
        new_world = draw(st.integers(1, 9))
        history.append((shares, consumed, new_world, lockstep))
        plan = plan.resized(consumed, new_world)
    return order, plan, history


@settings(max_examples=EXAMPLES * 3, deadline=None, derandomize=True)
@given(case=resizes())
def test_every_position_is_dealt_exactly_once_across_resizes(case):
    order, plan, history = case
    total = len(order.global_indices())
    taken: collections.Counter = collections.Counter()
    padding = 0
    for shares, consumed, new_world, _ in history:
        for share, k in zip(shares, consumed):
            taken.update(share[:k])
        rest = remainder(shares, consumed)
        padding += max(0, len(_expected_after(rest, new_world, order.drop_last)) - len(rest))
    final = plan.assigned()
    assert len(final) == history[-1][2]
    assert len({len(s) for s in final}) <= 1  # every new rank the same number of samples: DDP's same steps
    taken.update(p for s in final for p in s)
    assert set(taken) <= set(range(total))
    repeats = sum(c - 1 for c in taken.values() if c > 1)
    missing = total - len(taken)
    if order.drop_last:
        assert repeats == 0  # the cut: at most M-1 positions per resize, never a repeat
        assert missing <= sum(w - 1 for *_, w, _ in history)
    else:
        assert missing == 0  # nothing lost
        assert repeats == padding <= sum(w - 1 for *_, w, _ in history)


@settings(max_examples=EXAMPLES * 3, deadline=None, derandomize=True)
@given(case=resizes())
def test_lockstep_resizes_keep_the_global_order(case):
    """Ranks that consumed the same count (a DDP loop's): what was consumed, then each new world's
    deal, read in dealing order, is G from its start (with the documented padding / cut), computed
    here without the library's arithmetic: a lockstep world consumes a prefix of its sequence."""
    order, plan, history = case
    if not all(lockstep for *_, lockstep in history):
        return
    sequence = list(range(len(order.global_indices())))  # positions of G, in the first world's dealing order
    consumed_in_order: list[int] = []
    for shares, consumed, new_world, _ in history:
        taken = consumed[0] * len(shares)
        consumed_in_order += sequence[:taken]
        sequence = _expected_after(sequence[taken:], new_world, order.drop_last)
    assert _interleave(plan.assigned()) == sequence
    first = history[0]
    assert consumed_in_order[: first[1][0] * len(first[0])] == list(range(first[1][0] * len(first[0])))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(case=resizes())
def test_a_plan_round_trips_through_its_record(case):
    _, plan, _ = case
    again = ElasticPlan.from_record(plan.as_record())
    assert again == plan and again.assigned() == plan.assigned()


@settings(max_examples=EXAMPLES * 2, deadline=None, derandomize=True)
@given(share=st.integers(0, 50), batch=st.integers(1, 9), batches=st.integers(0, 60), drop=st.booleans())
def test_consumed_samples_count_whole_batches(share, batch, batches, drop):
    k = consumed_samples(batches, batch, share, drop)
    assert 0 <= k <= share
    full = share // batch * batch if drop else share
    assert k == min(batches * batch, full)


def test_split_deals_like_the_sampler():
    assert split([0, 1, 2, 3, 4], 2, drop_last=False) == [[0, 2, 4], [1, 3, 0]]
    assert split([0, 1, 2, 3, 4], 2, drop_last=True) == [[0, 2], [1, 3]]
    assert split([7], 3, drop_last=False) == [[7], [7], [7]]
    assert split([], 3, drop_last=False) == [[], [], []]
    with pytest.raises(ValueError):
        remainder([[0, 2], [1, 3]], [3, 0])


def test_the_remainder_sampler_serves_one_pass_of_its_epoch():
    original = DistributedSampler(range(10), num_replicas=2, rank=0, shuffle=True, seed=1)
    holder = torch.utils.data.BatchSampler(original, batch_size=2, drop_last=False)
    plan = ElasticPlan(Order(10, 2, True, False, 1, 0))
    remainder_sampler = RemainderSampler(original, holder, plan, [5, 6, 7])
    holder.sampler = remainder_sampler
    assert len(holder) == 2 and list(holder) == [[5, 6], [7]]  # the rest of the epoch
    assert list(holder) == [list(b) for b in torch.utils.data.BatchSampler(list(original), 2, False)]
    assert holder.sampler is original  # the next pass is the user's sampler again
    holder.sampler = RemainderSampler(original, holder, plan, [5, 6, 7])
    original.set_epoch(1)  # the loop moved on before the pass: the remainder is not served, and that is said
    with pytest.warns(distckpt.CheckpointWarning, match="rest of epoch 0"):
        assert list(holder)[0] == list(original)[:2] and holder.sampler is original


def test_new_ranks_past_the_old_world_get_distinct_seeds():
    contexts = [ElasticContext(r, 6, 2, 40, b"state") for r in range(6)]
    seeds = {c.seed(what) for c in contexts for what in ("rng", "gen", "loader/generator")}
    assert len(seeds) == 18  # none shared between ranks or streams
    assert ElasticContext(3, 6, 2, 40, b"state").seed("rng") == contexts[3].seed("rng")  # deterministic
    assert ElasticContext(3, 6, 2, 41, b"state").seed("rng") != contexts[3].seed("rng")  # the step enters
    assert [c.takes_over for c in contexts] == [True, True, False, False, False, False]
