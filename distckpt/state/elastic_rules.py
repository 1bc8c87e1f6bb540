"""The rules of an elastic resume (world_size_policy="elastic") for what a rank holds of its own:
a data loader's position, its random streams. The index arithmetic is elastic.py's.

* A loader (torchdata's StatefulDataLoader over a `DistributedSampler`, batched by torch's or
  torchdata's BatchSampler) is described at every save (`describe`): its epoch's order, its
  batch shape, and the plan of an epoch already resized. At another world size, `plan_for`
  reads how many samples each old rank's loop took from its saved torchdata state and hands
  the remainder of the epoch to the new ranks. Anything else is refused by name.
* Random streams (the process's, a loader's generator, generators in `state`): new rank j takes
  over old rank j's when the old world had one (j < N); a new rank j >= N seeds them from
  `ElasticContext.seed` (blake2b over old rank 0's torch CPU stream at the save, j, the step and
  the stream's name), so no old rank's stream runs on two new ranks.

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DistributedSampler

from distckpt.errors import ElasticResumeError
from distckpt.state.elastic import ELASTIC_KEY, ElasticContext, ElasticPlan, Order, consumed_samples, installed
from distckpt.state.epoch_record import is_torchdata
from distckpt.state.loader_plan import DROPPED_KEY
from distckpt.state.rng import capture_process_rng, restore_process_rng

_WHAT_TO_DO = ("load with world_size_policy='reshard' to restart the epoch at the new world size (samples of it "
               "may repeat), or use a torchdata StatefulDataLoader with batch_size= over a "
               "torch.utils.data.DistributedSampler (docs: guides/elastic.md)")


# -- a loader ------------------------------------------------------------------------------------

def describe(loader: Any) -> dict[str, Any]:
    """What an elastic resume needs of `loader` at a save, or {"unsupported": why}."""
    why = unsupported(loader)
    if why:
        return {"unsupported": why}
    holder = loader.batch_sampler
    remainder = installed(loader)
    sampler = remainder.original if remainder is not None else holder.sampler
    order = Order(len(loader.dataset), sampler.num_replicas, sampler.shuffle, sampler.drop_last, sampler.seed,
                  sampler.epoch)
    plan = remainder.plan if remainder is not None and remainder.plan.order.epoch == sampler.epoch else None
    return {"order": order.as_record(), "rank": sampler.rank, "batch_size": holder.batch_size,
            "batch_drop_last": bool(holder.drop_last), "plan": None if plan is None else plan.as_record()}


def unsupported(loader: Any) -> str:
    """Why the loader's epoch cannot be continued at another world size ("" when it can)."""
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return (f"its dataset {type(dataset).__name__} is an IterableDataset: its order is the dataset's own, "
                "which distckpt cannot split across another number of ranks")
    holder = getattr(loader, "batch_sampler", None)
    if holder is None:
        return "it has no batch sampler (batch_size=None): build it with batch_size="
    if not (type(holder) is BatchSampler or is_torchdata(holder, "BatchSampler")):
        return (f"its batch sampler {type(holder).__name__} is not torch's or torchdata's BatchSampler: which "
                "samples its batches hold cannot be told")
    remainder = installed(loader)
    sampler = remainder.original if remainder is not None else holder.sampler
    if type(sampler) is not DistributedSampler:
        return (f"its sampler {type(sampler).__name__} is not a torch.utils.data.DistributedSampler: it defines no "
                "global order across ranks to continue")
    return ""


def plan_for(key: str, saved: list[Any], loader: Any, context: ElasticContext,
             held: list[int] | None = None) -> ElasticPlan | None:
    """The resized plan of the interrupted epoch (None: every old rank had finished its pass, the
    next pass is a new epoch as usual), from every old rank's saved loader state."""
    where = f"state[{key!r}]"
    why = unsupported(loader)
    if why:
        raise ElasticResumeError(f"{where}: world_size_policy='elastic' cannot continue this loader's epoch at "
                                 f"{context.world_size} ranks: {why}; {_WHAT_TO_DO}")
    described: list[dict[str, Any]] = []
    for rank, s in enumerate(saved):
        d = s.get(ELASTIC_KEY) if isinstance(s, dict) else None
        if not isinstance(d, dict):
            raise ElasticResumeError(f"{where}: the loader of old rank {rank} was saved without what an elastic "
                                     f"resume needs (saved before it existed, or not a StatefulDataLoader); "
                                     f"{_WHAT_TO_DO}")
        described.append(d)
        if "unsupported" in d:
            raise ElasticResumeError(f"{where}: world_size_policy='elastic' cannot continue the saved epoch: the "
                                     f"loader of old rank {rank}: {d['unsupported']}; {_WHAT_TO_DO}")
    first = described[0]
    for rank, d in enumerate(described):
        if (d["order"], d["plan"], d["batch_size"], d["batch_drop_last"]) != \
                (first["order"], first["plan"], first["batch_size"], first["batch_drop_last"]):
            raise ElasticResumeError(f"{where}: the old ranks' loaders were in different epochs or orders (rank 0: "
                                     f"{first['order']}, rank {rank}: {d['order']}): no one global order to continue")
        if d["rank"] != rank:
            raise ElasticResumeError(f"{where}: old rank {rank}'s DistributedSampler was rank {d['rank']}: the ranks' "
                                     "samplers must be numbered as the ranks are")
    plan = ElasticPlan.from_record(first["plan"]) if first["plan"] else ElasticPlan(Order.from_record(first["order"]))
    if plan.current_world != context.old_world_size:
        raise ElasticResumeError(f"{where}: the saved sampler splits the epoch over {plan.current_world} replicas "
                                 f"but {context.old_world_size} ranks saved: num_replicas must be the world size")
    _check_live_sampler(where, plan.order, loader, context)
    shares = plan.assigned()
    held = held or [0] * len(saved)
    consumed = [_consumed(s, len(share), first, h) for s, share, h in zip(saved, shares, held)]
    if all(k == len(share) for k, share in zip(consumed, shares)):
        return None
    return plan.resized(consumed, context.world_size)


def _consumed(state: dict[str, Any], share: int, described: dict[str, Any], held: int = 0) -> int:
    """Samples of its share an old rank's loop took: torchdata's count of batches yielded (with
    workers: its snapshot's step and the batches since), less the batches a prefetching wrapper
    held ahead of the loop; all of them after a finished pass."""
    if held == 0 and (state.get("_iterator_finished") is True or state.get(DROPPED_KEY) is True):
        return share  # the pass was over (or dropped: its next iter() started a new one)
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, dict):
        batches = int(snapshot.get("_snapshot_step", 0)) + int(state.get("_steps_since_snapshot", 0))
    else:
        batches = int(state.get("_num_yielded", 0))
    if state.get("_iterator_finished") is True:  # every batch was taken from the loader, some held
        batches = -(-share // int(described["batch_size"]))
    batches -= held
    return consumed_samples(batches, int(described["batch_size"]), share, bool(described["batch_drop_last"]))


def _check_live_sampler(where: str, order: Order, loader: Any, context: ElasticContext) -> None:
    remainder = installed(loader)
    sampler = remainder.original if remainder is not None else loader.batch_sampler.sampler
    live = (len(loader.dataset), sampler.shuffle, sampler.drop_last, sampler.seed if sampler.shuffle else None)
    was = (order.dataset_len, order.shuffle, order.drop_last, order.seed if order.shuffle else None)
    if live != was:
        raise ElasticResumeError(
            f"{where}: the loader's (dataset length, shuffle, drop_last, seed) are {live} here and were {was} "
            "when saved: the saved epoch's order cannot be continued; build the dataset and the DistributedSampler "
            "as the run that saved did")
    if (sampler.num_replicas, sampler.rank) != (context.world_size, context.rank):
        raise ElasticResumeError(
            f"{where}: its DistributedSampler is rank {sampler.rank} of {sampler.num_replicas} and this is rank "
            f"{context.rank} of {context.world_size}: build it with num_replicas=world size, rank=rank")


# -- random streams --------------------------------------------------------------------------------

def seeded_like(target: Any, seed: int) -> Any:
    """A new generator of `target`'s type (and device, bit generator) seeded with `seed`."""
    if isinstance(target, torch.Generator):
        return torch.Generator(device=target.device).manual_seed(seed)
    if isinstance(target, np.random.Generator):
        return np.random.Generator(type(target.bit_generator)(seed))
    if isinstance(target, np.random.RandomState):
        return np.random.RandomState(seed % 2 ** 32)
    if isinstance(target, random.Random):
        return random.Random(seed)
    raise TypeError(f"no seeding rule for {type(target).__name__}")


def process_rng_for(sources: list[dict[str, Any]], context: ElasticContext) -> dict[str, Any]:
    """This new rank's process streams: old rank j's (j < N), else seeded from context.seed("rng")
    (Python's `random`, NumPy's global stream and torch's, CPU and devices, as torch.manual_seed
    seeds them). The live streams are put back before this returns."""
    if context.takes_over:
        rng: dict[str, Any] = sources[context.rank]["rng"]
        return rng
    seed = context.seed("rng")
    before = capture_process_rng()
    try:
        random.seed(seed)
        np.random.seed(seed % 2 ** 32)
        torch.manual_seed(seed)
        return capture_process_rng()
    finally:
        restore_process_rng(before, f"rank {context.rank}, elastic seeding")
