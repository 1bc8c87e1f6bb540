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
refused at save when its sampler surely draws, said once otherwise. An iterator the loop had
dropped at the save (nothing but the loader held it) is restored, then the next iter() starts a
new pass, as the uninterrupted run's did.

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

import itertools
import logging
import random
import sys
import warnings
import weakref
from typing import Any, Callable, NamedTuple

import numpy as np
import torch
from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler

from distckpt.errors import (
    IncompatibleCheckpointError,
    ReplayWarning,  # noqa: F401  (re-exported where it was defined)
    UnstorableValueError,
)
from distckpt.state.capture import CheckpointWarning, _has_state_dict, has_class_named
from distckpt.state.rng import (
    as_python_state,
    numpy_global_state,
    numpy_state_into,
    numpy_to_plain,
    plain_to_numpy,
    set_numpy_global_state,
)

REPLAY_KEY = "_distckpt_sampler_replay"  # beside torchdata's keys in the loader's saved state
EPOCHS_KEY = "_distckpt_sampler_epochs"  # the samplers' epochs at the save, checked at the resumed iter()
DROPPED_KEY = "_distckpt_iterator_dropped"  # the loop had dropped the save's iterator mid-pass
_EPOCH_START = "_distckpt_epoch_start"    # on an iterator: the streams when its epoch started
_PLAN = "_distckpt_resume_plan"            # on a loader: what its next iterator is created with
_RESUMED = "_distckpt_resumed_iterator"     # on a loader: its iterator that took the restored position

log = logging.getLogger("distckpt")



# Samplers whose order follows from their attributes alone (DistributedSampler seeds a generator
# of its own from seed + epoch at each iter()): their replay needs no record.
_DRAWS_NOTHING = (SequentialSampler, DistributedSampler, range, list, tuple)


# -- the streams -------------------------------------------------------------------------------

def _stream_kind(obj: Any) -> str | None:
    if isinstance(obj, torch.Generator):
        return None if obj is torch.default_generator else "torch"  # the global one is recorded apart
    if isinstance(obj, np.random.Generator):
        return "numpy_generator"
    if isinstance(obj, np.random.RandomState):
        return "numpy_random_state"
    if isinstance(obj, random.Random):
        return "python"
    return None


def _get(obj: Any) -> Any:
    kind = _stream_kind(obj)
    if kind == "torch":
        return obj.get_state()
    if kind == "numpy_generator":
        return numpy_to_plain(obj.bit_generator.state)
    if kind == "numpy_random_state":
        return numpy_to_plain(obj.get_state(legacy=False))
    return obj.getstate()


def _set(obj: Any, state: Any) -> None:
    kind = _stream_kind(obj)
    if kind == "torch":
        obj.set_state(state)
    elif kind == "numpy_generator":
        obj.bit_generator.state = plain_to_numpy(state)
    elif kind == "numpy_random_state":
        obj.set_state(plain_to_numpy(state))
    else:
        obj.setstate(as_python_state(state))


def _scratch_copy(obj: Any) -> Any:
    """A new stream of the same kind, to try a saved state on before anything is restored."""
    kind = _stream_kind(obj)
    if kind == "torch":
        return torch.Generator(device=obj.device)
    if kind == "numpy_generator":
        return np.random.Generator(type(obj.bit_generator)())
    if kind == "numpy_random_state":
        return np.random.RandomState()
    return random.Random()


def sampling_streams(loader: Any) -> dict[str, Any]:
    """Every private stream the loader's sampling can draw from, by attribute path: the loader's
    generator, and those held by its sampler, batch sampler and the samplers inside them."""
    found: dict[str, Any] = {}
    seen: set[int] = set()

    def visit(obj: Any, path: str, depth: int) -> None:
        if id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if _stream_kind(obj) is not None:
            found[path] = obj
            return
        if not isinstance(obj, torch.utils.data.Sampler) and depth > 0 and not _holds_a_sampler(obj):
            return
        for name, value in _held(obj):
            if _stream_kind(value) is not None or isinstance(value, torch.utils.data.Sampler) \
                    or _holds_a_sampler(value):
                visit(value, f"{path}.{name}", depth + 1)

    generator = getattr(loader, "generator", None)
    if generator is not None:
        visit(generator, "generator", 1)
    for name in ("batch_sampler", "sampler"):
        sampler = getattr(loader, name, None)
        if sampler is not None:
            # A sampler need not subclass Sampler (any object with __iter__ and __len__): a bucketing
            # batch sampler holding its own torch.Generator went unseen, and a resume in its second
            # epoch replayed the first epoch's order, silently. Only plain sequences are not looked into.
            visit(sampler, name, 5 if isinstance(sampler, (list, tuple, range)) else 0)
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, torch.utils.data.IterableDataset):  # replayed item by item in this process
        for name, value in list(getattr(dataset, "__dict__", {}).items()):
            visit(value, f"dataset.{name}", 4)
    return found


def _held(obj: Any) -> list[tuple[str, Any]]:
    """What an object holds, by name: its attributes, and the items of a list, tuple or dict it
    holds (a sampler keeping its samplers, each with its own generator, in a list or a dict: their
    generators went unseen and a resume in the second epoch drew another order, silently)."""
    out = []
    for name, value in list(getattr(obj, "__dict__", {}).items()):
        out.append((name, value))
        if isinstance(value, (list, tuple)) and len(value) <= 64:
            out += [(f"{name}[{i}]", item) for i, item in enumerate(value)]
        elif isinstance(value, dict) and len(value) <= 64:
            out += [(f"{name}[{key!r}]", item) for key, item in list(value.items())]
    return out


def _holds_a_sampler(obj: Any) -> bool:
    """An object that is no sampler but holds one: Lightning's DistributedSamplerWrapper keeps the
    loader's own sampler (and its generator) under `dataset._sampler`, a dataset view of its
    indices; unseen, a resume drew another order, silently. Other datasets are not looked into
    (a dataset's own streams are drawn per item, not at an epoch's start)."""
    if isinstance(obj, (torch.utils.data.Sampler, type)) or not hasattr(obj, "__dict__"):
        return False
    return any(isinstance(v, torch.utils.data.Sampler) for _, v in _held(obj))


def _global_states() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_global_state()}


def _set_global_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(as_python_state(states["python"]))
    set_numpy_global_state(states["numpy"])


def _states(streams: dict[str, Any]) -> dict[str, Any]:
    return {"global": _global_states(), "streams": {path: _get(obj) for path, obj in streams.items()}}


def _set_states(streams: dict[str, Any], states: dict[str, Any]) -> None:
    _set_global_states(states["global"])
    for path, state in states["streams"].items():
        _set(streams[path], state)


# -- recording each epoch's start --------------------------------------------------------------

class _IteratorRecorder:
    """Stands in for a loader's `_get_iterator`: records the streams before each iterator is
    created (before its base-seed draw and its sampler's first draws, as the epoch saw them),
    and creates the first one after a restore from the saved epoch start."""

    def __init__(self, loader: Any, replaced: Callable[[], Any] | None) -> None:
        self._loader = weakref.ref(loader)  # no cycle: the loader holds this
        self._replaced = replaced

    def __call__(self) -> Any:
        loader = self._loader()
        assert loader is not None  # called through the loader
        create = self._replaced or (lambda: type(loader)._get_iterator(loader))
        _warn_if_the_resumed_position_is_left(loader)
        _note_a_fabric_wrapper(loader)
        pending = vars(loader).get(_PLAN)
        if pending is not None:  # checked before the plan is taken: a caught refusal leaves it for the next try
            _check_epochs(loader, pending.get("epochs"), pending.get("where", "the loader"))
        plan = vars(loader).pop(_PLAN, None)
        if plan is None:
            _forget_a_restored_position(loader)
            start = _states(sampling_streams(loader))
            iterator = create()
        else:
            start, iterator = _resumed_iterator(loader, plan, create)
            if plan.get("dropped"):
                return _anew_after_a_dropped_iterator(loader, iterator, start, create)
            vars(loader)[_RESUMED] = (weakref.ref(iterator), getattr(iterator, "_num_yielded", None))
        _record(iterator, start)
        return iterator


def _forget_a_restored_position(loader: Any) -> None:
    """A pass after the resumed one starts at its beginning, as the uninterrupted run's did. A
    Hugging Face IterableDataset keeps the position it was loaded with and applies it to every
    pass while its epoch is the saved one: a loop that never calls its set_epoch (no shuffle)
    started every later pass at the saved position, silently (items 0..11 of 22 never came
    again). The loaded position has served the resumed pass; it is dropped here."""
    dataset = getattr(loader, "dataset", None)
    for candidate in (dataset, *list(getattr(dataset, "__dict__", {}).values())):  # with_worker_rng wraps it
        if _is_hf_iterable(candidate) and getattr(candidate, "_starting_state_dict", None) is not None:
            candidate._starting_state_dict = None


def _is_hf_iterable(obj: Any) -> bool:
    return has_class_named(obj, "IterableDataset", "datasets.")


def _warn_if_the_resumed_position_is_left(loader: Any) -> None:
    """A new iterator made while the one that took a mid-pass position from the checkpoint had
    given at most one batch: a peek at an epoch's start (the PyTorch DDP tutorial's
    `b_sz = len(next(iter(self.train_data))[0])`) ran after a mid-epoch resume, took the position,
    and the loop's own iterator started the pass over: every step after it differed, silently.
    Said, not refused: a loop that leaves its iterators there in every run is right."""
    record = vars(loader).pop(_RESUMED, None)
    if record is None:
        return
    iterator, position = record[0](), record[1]
    if iterator is None or iterator is not getattr(loader, "_iterator", None) or getattr(iterator, "_finished", True):
        return
    yielded = getattr(iterator, "_num_yielded", None)
    if not isinstance(position, int) or not isinstance(yielded, int) or position <= 0 or yielded - position > 1:
        return
    message = (f"a new iterator of a loader resumed mid-pass (at batch {position}) was made after the resumed one "
               f"gave {yielded - position} batch(es): the new one starts the pass over, so unless the uninterrupted "
               "run made a new iterator at this point too, this run does not continue as it did. Take a pass's "
               "batches from one iterator; a peek at an epoch's start (`next(iter(loader))` to read the batch "
               "size) takes the resumed position: read loader.batch_size instead. If the loop makes a new iterator here in every run (fixed-length "
               "passes with islice or break), this is expected and the run is exact")
    log.warning(message)
    warnings.warn(message, CheckpointWarning, stacklevel=4)


def _anew_after_a_dropped_iterator(loader: Any, restored: Any, start: Any, create: Callable[[], Any]) -> Any:
    """The loop had dropped the save's iterator (`next(iter(val_loader))`): the iter() after it
    started a new pass, not the dropped one's rest. So the restored iterator (its sampler's and
    dataset's states applied, every stream where the save left it) stands for the dropped one,
    and this iter() does what the uninterrupted run's did: persistent workers start the next pass
    on it by _reset; otherwise a new iterator is made."""
    _record(restored, start)
    if getattr(loader, "persistent_workers", False) and getattr(loader, "num_workers", 0) > 0:
        restored._reset(loader)  # the recorder: this pass's start is recorded
        return restored
    del restored  # its workers end with it, as the dropped iterator's did
    _forget_a_restored_position(loader)  # the new pass starts at its beginning
    start = _states(sampling_streams(loader))  # before create(), which draws the base seed (as above)
    iterator = create()
    _record(iterator, start)
    return iterator


def dropped(loader: Any) -> bool:
    """Whether the loader's current iterator is held by nothing but the loader, mid-pass: the loop
    dropped it (`next(iter(val_loader))`), so its next iter() starts a new pass, which a resume
    must do too. Call first in a capture (before state_dict(), before any local holds it)."""
    if getattr(loader, "_iterator", None) is None or getattr(loader, "_initial_iter_for_state_dict", False) \
            or getattr(loader._iterator, "_finished", True):
        return False
    return sys.getrefcount(loader._iterator) <= 2  # the loader's attribute and the call's argument


def _record(iterator: Any, start: dict[str, Any] | None) -> None:
    try:
        setattr(iterator, _EPOCH_START, start)
        if "_reset" not in vars(iterator):  # persistent workers start later epochs by _reset
            iterator._reset = _ResetRecorder(iterator)
    except (AttributeError, TypeError):  # an iterator that takes no attributes: its epochs are not recorded
        pass


class _ResetRecorder:
    """Stands in for an iterator's `_reset`, which starts the next epoch of a loader with
    persistent workers without a new iterator: records the streams first. It holds the iterator
    weakly and calls its class's method: a bound method here made a cycle, the iterator outlived
    its last reference until the cyclic collector ran, and its workers with it (10-20 s waits)."""

    def __init__(self, iterator: Any) -> None:
        self._iterator = weakref.ref(iterator)

    def __call__(self, loader: Any, *args: Any, **kwargs: Any) -> Any:
        iterator = self._iterator()
        assert iterator is not None  # called through the iterator
        setattr(iterator, _EPOCH_START, {**_states(sampling_streams(loader)), "reset": True})
        return type(iterator)._reset(iterator, loader, *args, **kwargs)


def watch(loader: Any) -> None:
    """Record the streams at each of `loader`'s epoch starts from now on (once per loader)."""
    current = vars(loader).get("_get_iterator")
    if isinstance(current, _IteratorRecorder):
        return
    loader._get_iterator = _IteratorRecorder(loader, current)


# -- save --------------------------------------------------------------------------------------

def _replays_its_sampler(iterator: Any) -> bool:
    """torchdata's fallback: the index sampler and its iterator keep no state of their own, or
    its batch sampler's iterator replays the sampler inside (torchdata's BatchSampler, which a
    StatefulDataLoader given batch_size= builds over the sampler)."""
    sampler_iter: Any = getattr(iterator, "_sampler_iter", None)
    if _is_torchdata(sampler_iter, "_BatchSamplerIterator"):
        return not (_has_state_dict(sampler_iter.sampler) or _has_state_dict(sampler_iter.sampler_iter))
    return not (_has_state_dict(getattr(iterator, "_index_sampler", None)) or _has_state_dict(sampler_iter))


def _is_stateful_dataloader(loader: Any) -> bool:
    return has_class_named(loader, "StatefulDataLoader", "torchdata.")


def _is_torchdata(obj: Any, name: str) -> bool:
    return type(obj).__name__ == name and type(obj).__module__.startswith("torchdata.")


def _draws_nothing(sampler: Any, depth: int = 0) -> bool:
    if sampler is None or type(sampler).__name__ == "_InfiniteConstantSampler":
        return True
    if depth > 4:
        return False
    if type(sampler) is BatchSampler or _is_torchdata(sampler, "BatchSampler"):
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
    if iterator is None or not _is_stateful_dataloader(loader):
        return None  # another loader with state_dict resumes by its own rules
    iterable = _replays_its_dataset(loader, iterator)
    if not iterable and not _replays_its_sampler(iterator):
        return None
    sampler = getattr(iterator, "_index_sampler", None)
    streams = sampling_streams(loader)
    # The loader's own generator draws only the base seed, which torchdata restores itself.
    own_streams = [path for path in streams if path != "generator"]
    if not iterable and _draws_nothing(sampler) and not own_streams:
        return None
    start = getattr(iterator, _EPOCH_START, None)
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
        log.warning(message)
        warnings.warn(message, ReplayWarning, stacklevel=5)
    return None


def _named(sampler: Any) -> str:
    """The user's sampler inside the BatchSampler a loader given batch_size= builds."""
    for _ in range(4):
        if not (type(sampler) is BatchSampler or _is_torchdata(sampler, "BatchSampler")):
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
        for states in (saved["epoch_start"],):
            missing = sorted(set(states["streams"]) - set(streams))
            if missing:
                raise IncompatibleCheckpointError(
                    f"{where}: the loader was saved sampling from {sorted(states['streams'])} and this one has "
                    f"{sorted(streams)}: its epoch cannot be replayed; build the loader's sampler as the run did")
            for path, state in states["streams"].items():
                _set(_scratch_copy(streams[path]), state)
        start = saved["epoch_start"]["global"]
        torch.Generator().set_state(start["torch"])
        random.Random().setstate(as_python_state(start["python"]))
        numpy_state_into(np.random.RandomState(), start["numpy"])
    except IncompatibleCheckpointError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise IncompatibleCheckpointError(f"{where}: the loader's sampling streams would not restore: "
                                          f"{type(e).__name__}: {e}") from e


def make_first_iterator(loader: Any) -> None:
    """Have a torchdata loader that was never iterated make its first iterator now, before a save
    records the random streams. Its state_dict() makes it anyway, and making it draws a base seed
    (from the loader's generator or torch's global stream): drawn after the streams were recorded,
    the uninterrupted run was a draw ahead of every resume (a validation loader saved before its
    first pass; every later torch.rand differed, silently). Drawn before, the checkpoint holds the
    streams after the draw and the iterator that drew, as for a loader saved mid-pass; the loop's
    first iter() takes that iterator (torchdata's own rule)."""
    if not _is_stateful_dataloader(loader) or "_iterator" not in vars(loader) or loader._iterator is not None \
            or getattr(loader, "next_iter_state", None) is not None or _PLAN in vars(loader):
        return
    if getattr(loader, "in_order", True) is False and getattr(loader, "num_workers", 0) > 0:
        return  # refused by the save, with its reason
    loader.state_dict()


def plan_resume(loader: Any, saved: dict[str, Any] | None, was_dropped: bool = False,
                epochs: dict[str, Any] | None = None, where: str = "the loader", restored: Any = None) -> None:
    """Have the loader's next iterator replay the saved epoch (checked by `check`); with
    `was_dropped`, then start a new pass as the uninterrupted run did. `epochs` (from
    `capture_epochs`) is checked against the samplers' epochs when that iterator is made.
    `restored`: the state given to the loader's load_state_dict (`restored_untouched`)."""
    watch(loader)
    loader.__dict__[_PLAN] = {"replay": saved, "dropped": was_dropped, "epochs": epochs, "where": where,
                              "restored": restored}


class Untouched(NamedTuple):
    """A loader as its restore left it: what a save of it holds."""
    state: dict[str, Any]          # the state its load_state_dict was given
    dropped: bool                  # the saved iterator had been dropped mid-pass
    replay: dict[str, Any] | None  # the saved epoch's start
    mid_pass: bool | None          # the saved loader was mid-pass (None: not recorded)


def restored_untouched(loader: Any) -> Untouched | None:
    """The loader's restored state when nothing has iterated it since the restore (its resume
    plan is pending and torchdata still holds the very state it was given): saved again, it is
    saved as it was loaded, as the uninterrupted run saved the same loader."""
    plan: dict[str, Any] = vars(loader).get(_PLAN) or {}
    restored: Any = plan.get("restored")
    if not isinstance(restored, dict) or getattr(loader, "_iterator", None) is not None \
            or id(getattr(loader, "next_iter_state", None)) != id(restored):  # ids: `is` narrowed it to Optional
        return None
    epochs = plan.get("epochs")
    mid_pass = epochs.get("mid_pass") if isinstance(epochs, dict) else None
    replay = plan.get("replay")
    return Untouched(state=restored, dropped=bool(plan.get("dropped")),
                     replay=replay if isinstance(replay, dict) else None,
                     mid_pass=mid_pass if isinstance(mid_pass, bool) else None)


# -- datasets whose state is not their position ------------------------------------------------

def shuffle_buffer_of(dataset: Any) -> int | None:
    """The size of a Hugging Face IterableDataset's shuffle buffer (`.shuffle(buffer_size=...)`),
    None without one. By name: `datasets` need not be installed."""
    if not _is_hf_iterable(dataset):
        return None
    pending: list[Any] = [getattr(dataset, "_ex_iterable", None)]
    seen: set[int] = set()
    while pending and len(seen) < 64:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            size = getattr(node, "buffer_size", 0)
            return size if isinstance(size, int) else 0
        pending.append(getattr(node, "ex_iterable", None))
        pending.extend(list(getattr(node, "ex_iterables", None) or []))
    return None


_LOSSY_WARNED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def warn_lossy_dataset_state(loader: Any, key: str) -> None:
    """A Hugging Face IterableDataset shuffled through a buffer saves where its source is, not
    the buffer's content (`datasets` refills the buffer on load, and says so in a log line):
    a resume read other items, fewer of them, with nothing raised. Said at the save, once per
    loader: no save of it can be resumed exactly."""
    size = shuffle_buffer_of(getattr(loader, "dataset", None))
    if size is None or loader in _LOSSY_WARNED:
        return
    _LOSSY_WARNED.add(loader)
    message = (f"state[{key!r}] reads a Hugging Face IterableDataset shuffled through a buffer "
               f"(.shuffle(buffer_size={size})): its state holds where the source is, not the {size} items in the "
               "buffer (datasets refills the buffer on load), so a resume reads other items than the uninterrupted "
               "run, and fewer of them in that epoch. For an exact resume shuffle a map-style Dataset with a "
               "sampler (DistributedSampler), or shuffle before streaming (Dataset.shuffle(seed=...).to_iterable_dataset())")
    log.warning(message)
    warnings.warn(message, CheckpointWarning, stacklevel=5)


# -- loaders left out of `state` ----------------------------------------------------------------

_ITERATORS: "weakref.WeakSet[Any]" = weakref.WeakSet()  # every data loader iterator made since tracking began
_FABRIC_WRAPPED = "_distckpt_iterated_through_fabric"  # on a loader: Fabric's wrapper made an iterator of it


def track_iterators() -> None:
    """From now on, remember every data loader iterator made (weakly), so a save can tell a
    loop's loader left out of `state` without a scan of every object in the process (a scan of
    the collector's ~170,000-250,000 objects cost 25-250 ms at a fresh process's first saves).
    Installed once, by the first manager."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    original = _BaseDataLoaderIter.__init__
    if getattr(original, "_distckpt_tracking", False):
        return

    def init(self: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
        original(self, loader, *args, **kwargs)
        try:
            _ITERATORS.add(self)
        except TypeError:  # an iterator class that takes no weak reference
            pass

    init._distckpt_tracking = True  # type: ignore[attr-defined]
    _BaseDataLoaderIter.__init__ = init  # type: ignore[method-assign]


def _note_a_fabric_wrapper(loader: Any) -> None:
    """Whether this iterator of `loader` is being made by Lightning Fabric's loader wrapper
    (`fabric.setup_dataloaders`), whose __iter__ calls set_epoch on the sampler with its own count
    of iter() calls, restarting at 0 in a resumed process: marked on the loader, refused at its
    next save. A look at a few frames up, once per pass."""
    try:
        frame = sys._getframe(2)
    except ValueError:  # called from the bottom of the stack: nothing above it
        return
    for _ in range(6):
        if frame is None:
            return
        code = frame.f_code
        if code.co_name == "__iter__" and code.co_filename.replace("\\", "/").endswith(
                ("lightning_fabric/wrappers.py", "lightning/fabric/wrappers.py")):
            vars(loader)[_FABRIC_WRAPPED] = True
            return
        frame = frame.f_back  # type: ignore[assignment]


def refuse_a_fabric_wrapper(loader: Any, key: str) -> None:
    if vars(loader).get(_FABRIC_WRAPPED):
        raise UnstorableValueError(
            f"state[{key!r}] is iterated through Lightning Fabric's loader wrapper (fabric.setup_dataloaders): "
            "each iter() of the wrapper sets the sampler's epoch to its own count of iter() calls, which restarts at "
            "0 in a resumed process, so a resume would take another epoch's order. Iterate the StatefulDataLoader "
            "itself and call sampler.set_epoch(epoch) at each epoch start; move batches with fabric.to_device "
            "(README: Lightning Fabric)")


def positions_left_out(loaders: list[Any]) -> list[str]:
    """Data loader iterators in the middle of a pass, in use, that no loader in `loaders` holds:
    a loop that keeps its sampler in `state` but not its loader resumed a mid-epoch save from the
    epoch's first batch, silently (the batches already taken came again, the run ran longer); so
    did one whose `state` held a loader a framework had replaced by another over the same dataset
    (Lightning Fabric's setup_dataloaders)."""
    covered = {id(getattr(loader, "_iterator", None)) for loader in loaders}
    found = []
    for iterator in list(_ITERATORS):
        yielded = getattr(iterator, "_num_yielded", 0)
        if not isinstance(yielded, int) or yielded <= 0 or getattr(iterator, "_finished", False) \
                or id(iterator) in covered:
            continue
        # An iterator nothing but its loader keeps (torchdata's loaders keep theirs, torch's with
        # persistent workers) is no pass under way: a validation loop broken off after two batches.
        # Held here by the list, the loop's name and the call's argument (3), by its loader (1).
        kept_by_its_loader = _is_torchdata(iterator, type(iterator).__name__) or getattr(iterator, "_persistent_workers", False)
        if sys.getrefcount(iterator) <= 3 + int(bool(kept_by_its_loader)):
            continue
        try:
            total = len(iterator)
        except TypeError:  # an iterable dataset without a length: where its pass ends is unknown
            continue
        if yielded < total:
            found.append(f"a loader over {type(iterator._dataset).__name__} at batch {yielded} of {total}")
    return found


def warn_positions_left_out(loaders: list[Any]) -> None:
    found = positions_left_out(loaders)
    if not found:
        return
    message = (f"{found[0]} is in the middle of its pass and no loader in `state` is iterating it: its position "
               "does not travel, so a resume from this checkpoint takes that pass's batches from the start again "
               "and the run does not continue as it did. Put the loader in `state` (a torchdata "
               "StatefulDataLoader): skipping the batches already taken after a resume is not exact either, as the "
               "new iterator draws its seed from torch's global stream again. A loader outside the training loop "
               "(a validation pass under way at this save) may be left out")
    log.warning(message)
    warnings.warn(message, CheckpointWarning, stacklevel=4)


# -- the samplers' epochs ------------------------------------------------------------------------

def epoch_samplers(loader: Any) -> dict[str, Any]:
    """Every sampler in the loader that has an epoch (DistributedSampler and its kin: an int
    `epoch` and a `set_epoch`), by attribute path."""
    found: dict[str, Any] = {}
    seen: set[int] = set()

    def visit(obj: Any, path: str, depth: int) -> None:
        if obj is None or isinstance(obj, (list, tuple, range)) or id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        epoch = getattr(obj, "__dict__", {}).get("epoch")
        if isinstance(epoch, int) and not isinstance(epoch, bool) and callable(getattr(obj, "set_epoch", None)):
            found[path] = obj
        # Every sampler it holds, under any name (a batch sampler's `inner`; Lightning's wrapper keeps
        # the loader's own sampler under `dataset._sampler`): only `.sampler` was followed, and a
        # DistributedSampler held as `inner` resumed in another epoch's order, silently.
        for name, value in _held(obj):
            if isinstance(value, torch.utils.data.Sampler) or _holds_a_sampler(value):
                visit(value, f"{path}.{name}", depth + 1)

    for name in ("sampler", "batch_sampler"):
        visit(getattr(loader, name, None), name, 0)
    return found


def sampler_epochs(loader: Any) -> dict[str, int]:
    """The epoch of every sampler in the loader that has one, by attribute path."""
    return {path: sampler.epoch for path, sampler in epoch_samplers(loader).items()}


# A sampler's settings that decide its order besides its epoch (DistributedSampler's): a position
# saved under one and resumed under another continues another order (shuffle=False after a
# shuffled save gave the items in sequence from the saved count on), silently.
_ORDER_SETTINGS = ("shuffle", "drop_last")


def sampler_settings(loader: Any) -> dict[str, dict[str, bool]]:
    """The order-deciding settings of every sampler with an epoch, by attribute path; nothing
    restores them, so they are checked at the load (the seed, which a sampler in `state` has
    restored, is checked at the resumed iter())."""
    out: dict[str, dict[str, bool]] = {}
    for path, sampler in epoch_samplers(loader).items():
        settings = {name: value for name in _ORDER_SETTINGS
                    if isinstance(value := getattr(sampler, "__dict__", {}).get(name), bool)}
        if settings:
            out[path] = settings
    return out


def _sampler_seeds(loader: Any, samplers: dict[str, Any] | None = None) -> dict[str, int]:
    """Seeds that decide an order: not a sampler's built with shuffle=False, which ignores it (a
    validation sampler rebuilt with another seed was refused, its order unchanged). `samplers`:
    the loader's `epoch_samplers`, when the caller walked them already."""
    samplers = epoch_samplers(loader) if samplers is None else samplers
    return {path: seed for path, sampler in samplers.items()
            if isinstance(seed := getattr(sampler, "__dict__", {}).get("seed"), int) and not isinstance(seed, bool)
            and getattr(sampler, "__dict__", {}).get("shuffle", True) is not False}


def capture_epochs(loader: Any, was_dropped: bool, mid_pass: bool | None = None) -> dict[str, Any] | None:
    """What the resumed iter() checks: the samplers' epochs now, and whether the loader is in
    the middle of a pass (its position then lies in this epoch's order; `mid_pass` given: a
    restored loader not iterated since, as it was saved). Call after `loader.state_dict()`."""
    samplers = epoch_samplers(loader)  # one walk of the loader for the epochs and the seeds
    if not samplers:
        return None
    epochs = {path: sampler.epoch for path, sampler in samplers.items()}
    iterator = getattr(loader, "_iterator", None)
    yielded = getattr(iterator, "_num_yielded", 0)
    if mid_pass is None:
        mid_pass = (not was_dropped and iterator is not None and not getattr(iterator, "_finished", True)
                    and isinstance(yielded, int) and yielded > 0)
    return {"epochs": epochs, "mid_pass": mid_pass, "seeds": _sampler_seeds(loader, samplers)}


def _check_epochs(loader: Any, saved: Any, where: str) -> None:
    """The first iterator after a restore: a sampler whose epoch was changed after load_latest
    (Lightning Fabric's loader wrapper calls set_epoch with its own count of iter() calls, which
    restarts at 0 in a new process) resumed a mid-epoch position in another epoch's order, or
    started the next pass in an earlier epoch's: every batch after the resume differed, silently."""
    if not isinstance(saved, dict) or not isinstance(saved.get("epochs"), dict):
        return
    now = sampler_epochs(loader)
    changed = {path: (epoch, now[path]) for path, epoch in saved["epochs"].items()
               if isinstance(epoch, int) and path in now and now[path] != epoch}
    if saved.get("mid_pass"):
        changed_now = changed
    else:  # a new pass: a later epoch is what the loop does; an earlier one is a count restarted
        changed_now = {p: (was, is_) for p, (was, is_) in changed.items() if is_ < was}
    _check_seeds(loader, saved, where)
    if not changed_now:
        return
    path, (was, is_) = sorted(changed_now.items())[0]
    cause = ("something set the sampler's epoch after load_latest from a count that restarted with the process "
             "(a loop's own counter, or Lightning Fabric's loader wrapper, which calls set_epoch with its count of "
             "iter() calls); call sampler.set_epoch(epoch) with the epoch load_latest returned, and iterate the "
             "StatefulDataLoader itself (README: Lightning Fabric)")
    if saved.get("mid_pass"):
        raise IncompatibleCheckpointError(
            f"{where}: the loader resumes in the middle of an epoch, at a position in the order of epoch {was} of its "
            f"{path}, but that sampler's epoch is {is_} at this iter(): the batches after the resume would not be "
            f"the uninterrupted run's. {cause[0].upper()}{cause[1:]}")
    message = (f"{where}: the loader was saved at the end of a pass in epoch {was} of its {path}, and its next pass "
               f"starts in epoch {is_}, an earlier one: unless the uninterrupted run went back too, the run does "
               f"not continue as it did; {cause}")
    log.warning(message)
    warnings.warn(message, CheckpointWarning, stacklevel=4)


def _check_seeds(loader: Any, saved: dict[str, Any], where: str) -> None:
    """A sampler's seed, as the resumed iter() sees it: one in `state` has the saved seed back by
    now, so a different one is a sampler left out of `state` and built with another seed (its
    order differs from the uninterrupted run's from the resumed batch on, silently before)."""
    seeds = saved.get("seeds")
    if not isinstance(seeds, dict):
        return  # saved before seeds were recorded
    now = _sampler_seeds(loader)
    changed = sorted((path, seed, now[path]) for path, seed in seeds.items()
                     if isinstance(seed, int) and path in now and now[path] != seed)
    if not changed:
        return
    path, was, is_ = changed[0]
    what = (f"{where}: its {path} was saved with seed={was} and has seed={is_} at this iter(), so its order is not "
            "the uninterrupted run's: build the sampler with the saved seed, or put it in `state` (its seed "
            "travels with it)")
    if saved.get("mid_pass"):
        raise IncompatibleCheckpointError(f"{what}; the loader resumes in the middle of an epoch")
    log.warning(what)
    warnings.warn(what, CheckpointWarning, stacklevel=4)


def _resumed_iterator(loader: Any, plan: dict[str, Any], create: Callable[[], Any]) -> tuple[Any, Any]:
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
    kept = {p: s for p, s in streams.items() if p == "generator"}
    now = _states(kept)
    slot = None
    if replay is not None:
        _set_states(streams, replay["epoch_start"])
        if not _replays_its_dataset(loader, None):
            slot = _EpochReplay.install(loader, streams, bool(replay["epoch_start"].get("reset")))
    try:
        iterator = create()
        if replay is not None:
            _draw_the_skipped_indices(iterator)
    finally:
        if slot is not None:
            slot.remove(locals().get("iterator"))
        _set_states(kept, now)
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
        elif _is_torchdata(batch_sampler, "BatchSampler"):  # built from batch_size=: it replays the sampler
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
        self._after_iter = _states(streams) if reset_started else None

    def __iter__(self) -> "_FirstDraw":
        return self

    def __next__(self) -> Any:
        if self._after_iter is not None:
            _set_states(self._streams, self._after_iter)
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
