"""Elastic resume: an epoch's global sample order continued at another world size.

A `DistributedSampler`'s epoch has one global order `G`, a pure function of (seed, epoch,
len(dataset), num_replicas, drop_last, shuffle): rank r of N takes the positions r, r+N,
r+2N, ... of it (with the padding or the truncation the sampler itself adds). Here an epoch's
order is tracked as *positions* into `G`, so a resize is arithmetic on positions:

* a `Segment` is one world's share of the epoch: for each of its ranks the positions assigned
  to it (`assigned(...)`), and the count it consumed before the save;
* the positions not consumed, in the order they were dealt (`G`'s order for the epoch's first
  world), are the remainder; the new world of M ranks
  splits it as DistributedSampler splits an epoch (interleaved: new rank j takes the
  remainder's j-th, (j+M)-th, ... position). When its length is not a multiple of M, the
  sampler's own rule applies: drop_last=False repeats its first positions (padding, at most
  M-1), drop_last=True drops its last ones (at most M-1), so every rank takes the same number
  of samples and DDP's ranks the same number of steps;
* a resize of a resized epoch appends one more segment (`ElasticPlan.segments`).

`RemainderSampler` stands in for the sampler inside the loader's batch sampler for the rest
of the interrupted epoch only: its first pass yields this rank's share; once that pass is over
(or the sampler's epoch moves on) it puts the user's sampler back.

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from distckpt.errors import CheckpointWarning, warn

ELASTIC_KEY = "_distckpt_elastic"  # beside torchdata's keys in a loader's saved state


@dataclass(frozen=True)
class Order:
    """What decides a DistributedSampler epoch's global order (G)."""

    dataset_len: int
    num_replicas: int
    shuffle: bool
    drop_last: bool
    seed: int
    epoch: int

    def global_indices(self) -> list[int]:
        """G, as DistributedSampler builds it (torch/utils/data/distributed.py): the epoch's
        permutation (or range), padded with its head or cut to num_replicas * num_samples; rank r
        takes G[r::num_replicas], so position p is rank p % N's (p // N)-th index.
        tests/unit/test_elastic_order.py checks it against the sampler itself."""
        n, world = self.dataset_len, self.num_replicas
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=g).tolist()
        else:
            indices = list(range(n))
        per = math.ceil((n - world) / world) if self.drop_last and n % world else math.ceil(n / world)
        total = max(per, 0) * world
        if not self.drop_last and indices:
            pad = total - len(indices)
            indices += (indices * math.ceil(pad / len(indices)))[:pad] if pad > 0 else []
        return indices[:total]

    def share(self) -> int:
        """Samples each rank takes in the epoch (DistributedSampler's num_samples)."""
        return len(self.global_indices()) // self.num_replicas if self.num_replicas else 0

    def as_record(self) -> dict[str, Any]:
        return {"dataset_len": self.dataset_len, "num_replicas": self.num_replicas, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "seed": self.seed, "epoch": self.epoch}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "Order":
        return cls(int(record["dataset_len"]), int(record["num_replicas"]), bool(record["shuffle"]),
                   bool(record["drop_last"]), int(record["seed"]), int(record["epoch"]))


@dataclass(frozen=True)
class Segment:
    """One resize: the world size that ran before it and what each of its ranks consumed."""

    world_size: int
    consumed: tuple[int, ...]


@dataclass(frozen=True)
class ElasticPlan:
    """An epoch in progress across resizes: its order, the resizes so far (oldest first) and
    the world size that runs it now. Every rank of that world holds the same plan."""

    order: Order
    segments: tuple[Segment, ...] = ()
    world_size: int = 0  # 0: the order's own num_replicas (no resize yet)

    @property
    def current_world(self) -> int:
        return self.world_size or self.order.num_replicas

    def assigned(self) -> list[list[int]]:
        """Each rank's positions into G in the current world (before any is consumed)."""
        total = len(self.order.global_indices())
        shares = [list(range(r, total, self.order.num_replicas)) for r in range(self.order.num_replicas)]
        for segment, new_world in zip(self.segments, self._worlds_after()):
            shares = split(remainder(shares, segment.consumed), new_world, self.order.drop_last)
        return shares

    def _worlds_after(self) -> list[int]:
        return [s.world_size for s in self.segments[1:]] + [self.current_world]

    def resized(self, consumed: Sequence[int], new_world: int) -> "ElasticPlan":
        """This plan after its current world consumed `consumed` (per rank) and M = new_world
        ranks take over."""
        return ElasticPlan(self.order, (*self.segments, Segment(self.current_world, tuple(consumed))), new_world)

    def as_record(self) -> dict[str, Any]:
        return {"order": self.order.as_record(), "world_size": self.current_world,
                "segments": [{"world_size": s.world_size, "consumed": list(s.consumed)} for s in self.segments]}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "ElasticPlan":
        segments = tuple(Segment(int(s["world_size"]), tuple(int(c) for c in s["consumed"]))
                         for s in record.get("segments", []))
        return cls(Order.from_record(record["order"]), segments, int(record["world_size"]))


def remainder(shares: Sequence[Sequence[int]], consumed: Sequence[int]) -> list[int]:
    """The positions not consumed, in dealing order: rank r's i-th position stood at r + W*i of
    the sequence dealt to these W ranks (G itself for the epoch's first world; a rest, padding
    at its end, after a resize), and keeps its place in it."""
    if len(consumed) != len(shares):
        raise ValueError(f"{len(consumed)} consumed counts for {len(shares)} ranks")
    for share, k in zip(shares, consumed):
        if not 0 <= k <= len(share):
            raise ValueError(f"a rank consumed {k} of its {len(share)} samples")
    longest = max((len(share) for share in shares), default=0)
    return [share[i] for i in range(longest) for share, k in zip(shares, consumed) if k <= i < len(share)]


def split(rest: Sequence[int], world: int, drop_last: bool) -> list[list[int]]:
    """`rest` shared by `world` ranks as DistributedSampler shares an epoch: interleaved, padded
    with its head (drop_last=False) or cut (drop_last=True) to a multiple of `world`."""
    rest = list(rest)
    if rest and len(rest) % world:
        if drop_last:
            rest = rest[: len(rest) - len(rest) % world]
        else:
            pad = world - len(rest) % world
            rest += (rest * (pad // len(rest) + 1))[:pad]
    return [rest[r::world] for r in range(world)]


def consumed_samples(batches: int, batch_size: int, share: int, batch_drop_last: bool) -> int:
    """Samples a rank's loop took after `batches` batches of its share of `share` samples."""
    taken = batches * batch_size
    if batch_drop_last:  # the incomplete last batch was never made: its samples stay in the remainder
        return min(taken, share - share % batch_size if batch_size else share)
    return min(taken, share)


# -- the rest of the epoch, in a loader --------------------------------------------------------

class RemainderSampler(torch.utils.data.Sampler[int]):
    """Yields `indices` (this rank's share of the interrupted epoch's remainder) for that epoch's
    pass, then gives the loader's batch sampler its own sampler back. Draws nothing."""

    def __init__(self, original: Any, holder: Any, plan: ElasticPlan, indices: list[int]) -> None:
        self.original, self.holder, self.plan, self.indices = original, holder, plan, indices
        self.spent = False  # a pass of the remainder ran to its end

    def active(self) -> bool:
        """Still the interrupted epoch's remainder (the user's sampler has not moved on)."""
        return not self.spent and getattr(self.original, "epoch", self.plan.order.epoch) == self.plan.order.epoch

    def __iter__(self) -> Iterator[int]:
        if not self.active():
            if not self.spent:  # the loop moved the sampler on before the rest was served
                warn(f"the rest of epoch {self.plan.order.epoch} ({len(self.indices)} samples on this rank) continued "
                     f"by an elastic resume was not served: the loader's sampler is at epoch "
                     f"{getattr(self.original, 'epoch', '?')} at its first pass after the load; call "
                     "sampler.set_epoch(epoch) with the epoch load_latest returned", CheckpointWarning)
            self.uninstall()
            return iter(self.original)
        return self._pass()

    def _pass(self) -> Iterator[int]:
        yield from self.indices
        self.spent = True

    def __len__(self) -> int:
        return len(self.indices) if self.active() else len(self.original)

    def uninstall(self) -> None:
        if getattr(self.holder, "sampler", None) is self:
            self.holder.sampler = self.original


def installed(loader: Any) -> RemainderSampler | None:
    """The loader's remainder sampler when it runs one, else None."""
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    return sampler if isinstance(sampler, RemainderSampler) else None


def install(loader: Any, plan: ElasticPlan, rank: int) -> None:
    """Have the loader's next pass yield this rank's share of `plan`'s remainder."""
    holder = loader.batch_sampler
    current = holder.sampler
    original = current.original if isinstance(current, RemainderSampler) else current
    positions = plan.assigned()[rank]
    g = plan.order.global_indices()
    holder.sampler = RemainderSampler(original, holder, plan, [g[p] for p in positions])


@dataclass(frozen=True)
class ElasticContext:
    """What a kind's elastic rule knows: the new rank and world, the old world, the step, and a
    seed source for the streams a new rank has no old rank of its own to take over from."""

    rank: int
    world_size: int
    old_world_size: int
    step: int
    base: bytes = field(default=b"", repr=False)  # old rank 0's torch CPU stream at the save

    def seed(self, what: str) -> int:
        """The documented seed of new rank `rank`'s stream `what` (a state key, or "rng"):
        blake2b over old rank 0's torch CPU stream, the new rank, the step and `what`; 63 bits."""
        h = hashlib.blake2b(digest_size=8, person=b"distckpt-elast")
        for part in (self.base, self.rank.to_bytes(8, "little"), self.step.to_bytes(8, "little", signed=True),
                     what.encode()):
            h.update(len(part).to_bytes(8, "little") + part)
        return int.from_bytes(h.digest(), "little") >> 1

    @property
    def takes_over(self) -> bool:
        """This new rank has an old rank of the same number: it takes over that rank's streams."""
        return self.rank < self.old_world_size
