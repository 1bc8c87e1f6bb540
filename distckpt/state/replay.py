"""A data loader's sampling, replayed on resume from the random streams its epoch started with.

A sampler that keeps no state of its own (torch's RandomSampler, WeightedRandomSampler,
SubsetRandomSampler, a BatchSampler over one, a custom sampler) is resumed by torchdata's
StatefulDataLoader by calling iter() on it again and skipping the indices already taken. That
gives the epoch's order back only if every stream the sampler draws from is where it was when
the epoch started; on resume they are where the save left them (the sampler's generator past the
epoch's permutation, torch's global stream past the seed RandomSampler drew), so the resumed run
took another order: every batch after the resume differed, silently (33 of 48 cases of
tests/test_sampler_replay.py).

So every epoch start of a loader the manager has seen records the streams the sampling can
reach (torch's, Python's and NumPy's global streams, and every torch / NumPy / Python generator
held by the loader, its sampler, batch sampler and the samplers inside them), a save stores the
record of the current epoch, and the first iterator after a restore is created from it; then the
global streams and the loader's generator are put where the save left them, and the samplers' own
streams stay where the replay left them (it drew what the epoch drew, and possibly, prefetching,
what the uninterrupted run draws just after the save). The replay hands out the one sampler
iterator the epoch used (_EpochReplay: torch and torchdata call iter() on the sampler two or three
times while creating and restoring), drives it past the indices taken, and an unwrapped iterable dataset read in this process is
replayed the same way. A loader whose epoch started before the manager saw it cannot be replayed:
refused at save when its sampler surely draws, said once otherwise.

The record of an epoch's start is epoch_record.py's; when a loader's iterators are made, and
what a restore plans for the next one, is loader_plan.py's.

This module never touches storage or torch.distributed.
"""


from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable

import torch
from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler

from distckpt.errors import (
    IncompatibleCheckpointError,
    ReplayWarning,
    UnstorableValueError,
    warn,
)
from distckpt.state.capture import _has_state_dict
from distckpt.state.elastic import RemainderSampler
from distckpt.state.epoch_record import (
    EPOCH_START_ATTR,
    LOADER_GENERATOR,
    is_stateful_dataloader,
    is_torchdata,
    sampling_streams,
    set_states,
    states,
    trial_states,
)

REPLAY_KEY = "_distckpt_sampler_replay"  # beside torchdata's keys in the loader's saved state


# Samplers whose order follows from their attributes alone (DistributedSampler seeds a generator
# of its own from seed + epoch at each iter()): their replay needs no record.
# An elastic resume's RemainderSampler yields a list it was given.
_DRAWS_NOTHING = (SequentialSampler, DistributedSampler, RemainderSampler, range, list, tuple)


# -- save --------------------------------------------------------------------------------------

def _replays_its_sampler(iterator: Any) -> bool:
    """torchdata's fallback: the index sampler and its iterator keep no state of their own, or
    its batch sampler's iterator replays the sampler inside (torchdata's BatchSampler, which a
    StatefulDataLoader given batch_size= builds over the sampler)."""
    sampler_iter: Any = getattr(iterator, "_sampler_iter", None)
    if is_torchdata(sampler_iter, "_BatchSamplerIterator"):
        return not (_has_state_dict(sampler_iter.sampler) or _has_state_dict(sampler_iter.sampler_iter))
    return not (_has_state_dict(getattr(iterator, "_index_sampler", None)) or _has_state_dict(sampler_iter))


def _draws_nothing(sampler: Any, depth: int = 0) -> bool:
    if sampler is None or type(sampler).__name__ == "_InfiniteConstantSampler":
        return True
    if depth > 4:
        return False
    if type(sampler) is BatchSampler or is_torchdata(sampler, "BatchSampler"):
        return _draws_nothing(sampler.sampler, depth + 1)
    return type(sampler) in _DRAWS_NOTHING


def _replays_its_dataset(loader: Any, iterator: Any) -> bool:
    """torchdata's fallback for an IterableDataset without state in this process: iter() on it
    again, skipping the items already yielded (workers replay in their own processes)."""
    fetcher = getattr(iterator, "_dataset_fetcher", None) if iterator is not None else None
    return (isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset)
            and getattr(loader, "num_workers", 0) == 0
            and not _has_state_dict(loader.dataset) and not _has_state_dict(getattr(fetcher, "dataset_iter", None)))


# torch's samplers that draw on every iter(): refused rather than warned about when unreplayable
_RANDOM_SAMPLERS = (torch.utils.data.RandomSampler, torch.utils.data.WeightedRandomSampler,
                    torch.utils.data.SubsetRandomSampler)
_WARNED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def capture(loader: Any, key: str) -> dict[str, Any] | None:
    """What replaying the loader's current epoch needs: its start and the streams now. Call after
    `loader.state_dict()` (which creates the iterator when there is none yet)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is None or not is_stateful_dataloader(loader):
        return None  # another loader with state_dict resumes by its own rules
    iterable = _replays_its_dataset(loader, iterator)
    if not iterable and not _replays_its_sampler(iterator):
        return None
    sampler = getattr(iterator, "_index_sampler", None)
    streams = sampling_streams(loader)
    # The loader's own generator draws only the base seed, which torchdata restores itself.
    own_streams = [path for path in streams if path != LOADER_GENERATOR]
    if not iterable and _draws_nothing(sampler) and not own_streams:
        return None
    start = getattr(iterator, EPOCH_START_ATTR, None)
    if start is not None:
        return {"epoch_start": start}
    replayed = f"IterableDataset {type(loader.dataset).__name__}" if iterable else _named(sampler)
    problem = (f"state[{key!r}]: this loader's {replayed} keeps no state, so a resume replays its epoch, which is "
               "exact only from the random streams the epoch started with, and this epoch started before the "
               "checkpoint manager saw the loader")
    remedy = ("call mgr.load_latest(state) before iterating the loader (it returns None on a fresh start)"
              + ("" if iterable else ", or use a sampler with state_dict (shuffle=True, or torchdata's samplers)"))
    if own_streams or _draws_from_torch(sampler):
        raise UnstorableValueError(f"{problem}: a resume would draw another order. {remedy[0].upper()}{remedy[1:]}")
    if loader not in _WARNED:  # it may draw nothing (a fixed order, files read in turn): said once
        _WARNED.add(loader)
        message = f"{problem}: if it draws random numbers, a resume will not continue it exactly; {remedy}"
        warn(message, ReplayWarning)
    return None


def _named(sampler: Any) -> str:
    """The user's sampler inside the BatchSampler a loader given batch_size= builds."""
    for _ in range(4):
        if not (type(sampler) is BatchSampler or is_torchdata(sampler, "BatchSampler")):
            break
        sampler = sampler.sampler
    return type(sampler).__name__


def _draws_from_torch(sampler: Any, depth: int = 0) -> bool:
    if isinstance(sampler, _RANDOM_SAMPLERS):
        return True
    inner = getattr(sampler, "sampler", None)
    return depth < 4 and inner is not None and _draws_from_torch(inner, depth + 1)


# -- load --------------------------------------------------------------------------------------

def check(loader: Any, saved: Any, where: str) -> None:
    """IncompatibleCheckpointError unless `saved` (from capture) can be replayed into `loader`."""
    if saved is None:
        return
    streams = sampling_streams(loader)
    try:
        start = saved["epoch_start"]
        missing = sorted(set(start["streams"]) - set(streams))
        if missing:
            raise IncompatibleCheckpointError(
                f"{where}: the loader was saved sampling from {sorted(start['streams'])} and this one has "
                f"{sorted(streams)}: its epoch cannot be replayed; build the loader's sampler as the run did")
        trial_states(streams, start)
    except IncompatibleCheckpointError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise IncompatibleCheckpointError(f"{where}: the loader's sampling streams would not restore: "
                                          f"{type(e).__name__}: {e}") from e


def resumed_iterator(loader: Any, plan: dict[str, Any], create: Callable[[], Any]) -> tuple[Any, Any]:
    """The first iterator after a restore, created as the epoch's was: from the epoch-start
    streams when the sampler is replayed. Afterwards every stream is where the save left it:
    creating an iterator always draws a base seed (from loader.generator, or from torch's global
    stream), which the uninterrupted run drew before the save (12 of 16 steps of a 2-worker loop
    differed when it was drawn a second time)."""
    replay = plan["replay"]
    streams = sampling_streams(loader)
    # Put back afterwards: the global streams and the loader's generator (its base seed), where
    # the save left them. The samplers' own streams stay where the replay leaves them: it drew
    # what the epoch drew, and it may have drawn past the save (prefetching, the extra index
    # pulled below) what the uninterrupted run draws after it; putting them back to their state at
    # the save lost those draws and the next epoch differed.
    kept = {p: s for p, s in streams.items() if p == LOADER_GENERATOR}
    now = states(kept)
    slot = None
    if replay is not None:
        set_states(streams, replay["epoch_start"])
        if not _replays_its_dataset(loader, None):
            slot = _EpochReplay.install(loader, streams, bool(replay["epoch_start"].get("reset")))
    try:
        iterator = create()
        if replay is not None:
            _draw_the_skipped_indices(iterator)
    finally:
        if slot is not None:
            slot.remove(locals().get("iterator"))
        set_states(kept, now)
    return (replay["epoch_start"] if replay is not None else None), iterator


class _EpochReplay:
    """Stands in, while the first iterator after a restore is created, for the sampler torchdata
    replays: every iter() on it gives the one iterator the epoch's start made. torchdata calls
    iter() on it twice (creating the iterator, then restoring it); a sampler that draws inside
    __iter__ (HF's LengthGroupedSampler returns iter(list)) drew its order the second time from
    the streams the first draw had moved: another order, silently."""

    _calls: int
    _used_call: int

    def __init__(self, owner: Any, name: str, inner: Any, streams: dict[str, Any], reset_started: bool,
                 used_call: int) -> None:
        self._owner, self._name, self._inner = owner, name, inner
        self._streams, self._reset_started = streams, reset_started
        self._iterator: Any = None
        self._open = True
        self._calls, self._used_call = 0, used_call

    @classmethod
    def install(cls, loader: Any, streams: dict[str, Any], reset_started: bool) -> "_EpochReplay | None":
        batch_sampler = getattr(loader, "batch_sampler", None)
        if batch_sampler is None:
            owner, name = loader, "sampler"
        elif is_torchdata(batch_sampler, "BatchSampler"):  # built from batch_size=: it replays the sampler
            owner, name = batch_sampler, "sampler"
        else:
            owner, name = loader, "batch_sampler"
        inner = vars(owner).get(name)
        if inner is None or _has_state_dict(inner):
            return None
        # Which iter() of the creation made the epoch's iterator: with workers torch's creation calls
        # iter() twice (in __init__, then in _reset after the base seed) and keeps the second; an
        # epoch that persistent workers started by _reset made one.
        used_call = 2 if getattr(loader, "num_workers", 0) > 0 and not reset_started else 1
        slot = cls(owner, name, inner, streams, reset_started, used_call)
        vars(owner)[name] = slot  # past DataLoader's __setattr__, which refuses a new sampler
        return slot

    def remove(self, iterator: Any) -> None:
        self._open = False
        vars(self._owner)[self._name] = self._inner
        for holder, name in ((iterator, "_index_sampler"), (getattr(iterator, "_sampler_iter", None), "sampler")):
            if holder is not None and getattr(holder, name, None) is self:
                setattr(holder, name, self._inner)

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:  # what torchdata asks of the sampler (state_dict: absent)
        if name in ("_owner", "_name", "_inner", "_streams", "_reset_started", "_iterator", "_open", "_calls",
                    "_used_call"):
            raise AttributeError(name)  # not set yet (copy, pickle): never the sampler's
        return getattr(self._inner, name)

    def __iter__(self) -> Any:
        if not self._open:
            return iter(self._inner)
        self._calls += 1
        if self._iterator is None:
            if self._calls < self._used_call:
                return iter(self._inner)  # drawn as the epoch's start drew it, then dropped as it was
            self._iterator = _FirstDraw(iter(self._inner), self._streams, self._reset_started)
        return self._iterator


class _FirstDraw:
    """The epoch's sampler iterator. An epoch a persistent-workers loader started by `_reset` drew
    no base seed between iter() and the sampler's first lazy draw, as the resumed iterator's
    creation does: the streams are put back to where iter() left them first."""

    def __init__(self, iterator: Any, streams: dict[str, Any], reset_started: bool) -> None:
        self._iterator = iterator
        self._streams = streams
        self._after_iter = states(streams) if reset_started else None

    def __iter__(self) -> "_FirstDraw":
        return self

    def __next__(self) -> Any:
        if self._after_iter is not None:
            set_states(self._streams, self._after_iter)
            self._after_iter = None
        return next(self._iterator)


def _draw_the_skipped_indices(iterator: Any) -> None:
    """Drive the replayed sampler past the indices already taken now, inside the epoch-start
    streams: without workers torchdata skips lazily, at the first batch, when a sampler drawing
    from a global stream would draw from the streams of the save."""
    sampler_iter: Any = getattr(iterator, "_sampler_iter", None)
    if not isinstance(sampler_iter, itertools.islice) or getattr(iterator, "_sampler_iter_yielded", 0) <= 0:
        return
    try:
        first = next(sampler_iter)
    except StopIteration:
        iterator._sampler_iter = iter(())
        return
    iterator._sampler_iter = itertools.chain([first], sampler_iter)
