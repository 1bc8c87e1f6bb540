"""Loaders a resume cannot continue exactly: said at the save, or refused.

A loop's loader left out of `state` (its position does not travel), a loader iterated through
Lightning Fabric's wrapper (it sets the sampler's epoch from a count that restarts with the
process), a Hugging Face IterableDataset shuffled through a buffer (its state holds where the
source is, not the buffer).

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from distckpt.errors import UnstorableValueError, warn
from distckpt.runtime.iterators import tracked_iterators
from distckpt.state.capture import CheckpointWarning, has_class_named
from distckpt.state.epoch_record import is_torchdata
from distckpt.state.workers import WorkerRngDataset, WorkerRngIterableDataset


def is_hf_iterable(obj: Any) -> bool:
    return has_class_named(obj, "IterableDataset", "datasets.")


# -- datasets whose state is not their position ------------------------------------------------

def shuffle_buffer_of(dataset: Any) -> int | None:
    """The size of a Hugging Face IterableDataset's shuffle buffer (`.shuffle(buffer_size=...)`),
    None without one. By name: `datasets` need not be installed."""
    if not is_hf_iterable(dataset):
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
    warn(message, CheckpointWarning)


# -- loaders left out of `state` ----------------------------------------------------------------

_FABRIC_WRAPPED = "_distckpt_iterated_through_fabric"  # on a loader: Fabric's wrapper made an iterator of it
_PREFETCHED = "_distckpt_iterated_through_a_prefetcher"  # on a loader: a wrapper holding a batch ahead iterates it
# Wrappers known to take a batch from the loader before the loop asks for it, by the file and function
# whose frame makes the loader's iterator: timm's PrefetchLoader (distckpt.integrations.timm's says
# which batch it holds, and is saved whole)
_PREFETCHERS = {("timm/data/loader.py", "__iter__"): "timm's PrefetchLoader"}


def note_a_fabric_wrapper(loader: Any) -> None:
    """Whether this iterator of `loader` is being made by Lightning Fabric's loader wrapper
    (`fabric.setup_dataloaders`), whose __iter__ calls set_epoch on the sampler with its own count
    of iter() calls, restarting at 0 in a resumed process, or by a known prefetcher (_PREFETCHERS):
    marked on the loader, refused at its next save. A look at a few frames up, once per pass."""
    try:
        frame = sys._getframe(2)
    except ValueError:  # called from the bottom of the stack: nothing above it
        return
    for _ in range(6):
        if frame is None:
            return
        code = frame.f_code
        filename = code.co_filename.replace("\\", "/")
        if code.co_name == "__iter__" and filename.endswith(
                ("lightning_fabric/wrappers.py", "lightning/fabric/wrappers.py")):
            vars(loader)[_FABRIC_WRAPPED] = True
            return
        prefetcher = next((name for (where, function), name in _PREFETCHERS.items()
                           if code.co_name == function and filename.endswith(where)), None)
        if prefetcher is not None:
            vars(loader)[_PREFETCHED] = prefetcher
            return
        frame = frame.f_back  # type: ignore[assignment]


def refuse_a_fabric_wrapper(loader: Any, key: str) -> None:
    """Refuse a loader iterated through a wrapper a resume cannot continue: Lightning Fabric's,
    or one that holds a batch ahead of the loop and does not say which (timm's PrefetchLoader)."""
    prefetcher = vars(loader).get(_PREFETCHED)
    if prefetcher:
        raise UnstorableValueError(
            f"state[{key!r}] is iterated by {prefetcher}, which takes each batch from it before the loop asks for "
            "it (moved to the device, normalized, random erasing applied): at a save the loader is a batch ahead of "
            "what the loop consumed, and a resume would skip that batch. Build the loader with "
            "distckpt.integrations.timm.create_loader (its PrefetchLoader says which batch it holds, and the "
            "checkpoint keeps it) and put what it returns in `state`")
    if vars(loader).get(_FABRIC_WRAPPED):
        raise UnstorableValueError(
            f"state[{key!r}] is iterated through Lightning Fabric's loader wrapper (fabric.setup_dataloaders): "
            "each iter() of the wrapper sets the sampler's epoch to its own count of iter() calls, which restarts at "
            "0 in a resumed process, so a resume would take another epoch's order. Iterate the StatefulDataLoader "
            "itself and call sampler.set_epoch(epoch) at each epoch start; move batches with fabric.to_device "
            "(docs: guides/frameworks.md, Lightning Fabric)")


def _covered(loaders: list[Any]) -> set[int]:
    """The ids of the iterators the loaders in `state` hold, also through a wrapper saved whole
    that keeps its loader as `.loader` (timm's PrefetchLoader from distckpt.integrations.timm, a
    prefetcher of your own): its loader's pass was taken for one left out of `state`, and every
    run of a documented timm loop was warned at its first saves."""
    covered: set[int] = set()
    for loader in loaders:
        for _ in range(4):  # a wrapper of a wrapper
            covered.add(id(getattr(loader, "_iterator", None)))
            loader = getattr(loader, "loader", None)
            if loader is None:
                break
    return covered


def positions_left_out(loaders: list[Any]) -> list[str]:
    """Data loader iterators in the middle of a pass, in use, that no loader in `loaders` holds:
    a loop that keeps its sampler in `state` but not its loader resumed a mid-epoch save from the
    epoch's first batch, silently (the batches already taken came again, the run ran longer); so
    did one whose `state` held a loader a framework had replaced by another over the same dataset
    (Lightning Fabric's setup_dataloaders)."""
    covered = _covered(loaders)
    found = []
    for iterator in tracked_iterators():
        yielded = getattr(iterator, "_num_yielded", 0)
        if not isinstance(yielded, int) or yielded <= 0 or getattr(iterator, "_finished", False) \
                or id(iterator) in covered:
            continue
        # An iterator nothing but its loader keeps (torchdata's loaders keep theirs, torch's with
        # persistent workers) is no pass under way: a validation loop broken off after two batches.
        # Held here by the list, the loop's name and the call's argument (3), by its loader (1).
        kept_by_its_loader = is_torchdata(iterator, type(iterator).__name__) or getattr(iterator, "_persistent_workers", False)
        if sys.getrefcount(iterator) <= 3 + int(bool(kept_by_its_loader)):
            continue
        try:
            total = len(iterator)
        except TypeError:  # an iterable dataset without a length: where its pass ends is unknown
            continue
        if yielded < total:
            found.append(f"a loader over {type(iterator._dataset).__name__} at batch {yielded} of {total}")
    return found


def first_pass_draws_left_out(loaders: list[Any]) -> list[str]:
    """Loaders with persistent workers, none of `loaders` (those in `state`), whose workers were
    made by a pass so far and seeded from torch's global stream. Such a loader draws its workers'
    base seed at its first pass only: a resumed process draws it again at its first pass after
    the resume (an evaluation loader, typically), which the uninterrupted run did not, so every
    later draw of torch's stream (dropout, drop path, augmentation) is one off, silently. Also those
    over a with_worker_rng dataset whatever their generator: their workers' streams go on from pass
    to pass, and a resumed process starts them anew."""
    return [_described(iterator) for iterator in _first_pass_iterators(loaders)]


def _first_pass_iterators(loaders: list[Any]) -> list[Any]:
    covered = _covered(loaders)
    return [iterator for iterator in tracked_iterators()
            if id(iterator) not in covered and getattr(iterator, "_persistent_workers", False)
            and (getattr(iterator, "_distckpt_seeded_globally", False) or _draws_in_workers(iterator))
            and not getattr(iterator, "_shutdown", False)]


def _draws_in_workers(iterator: Any) -> bool:
    """Its dataset was wrapped by with_worker_rng: its workers draw random numbers (augmentation),
    from streams that persistent workers carry from pass to pass, and a resumed process starts anew."""
    return isinstance(getattr(iterator, "_dataset", None), (WorkerRngDataset, WorkerRngIterableDataset))


def _described(iterator: Any) -> str:
    return f"a loader over {type(getattr(iterator, '_dataset', None)).__name__} with persistent workers"


_FIRST_PASS_WARNED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def warn_first_pass_draws_left_out(loaders: list[Any]) -> list[str]:
    """Warn of first_pass_draws_left_out, once per loader iterator found; returns what it found."""
    found = _first_pass_iterators(loaders)
    for iterator in found:
        if iterator in _FIRST_PASS_WARNED:
            continue
        _FIRST_PASS_WARNED.add(iterator)
        warn(_first_pass_message(iterator), CheckpointWarning)
    return [_described(iterator) for iterator in found]


def _first_pass_message(iterator: Any) -> str:
    if getattr(iterator, "_distckpt_seeded_globally", False) and not _draws_in_workers(iterator):
        return (f"{_described(iterator)} is not in `state` and drew its workers' base seed from torch's global "
                "stream at its first pass: a process resumed from this checkpoint draws it again at that loader's "
                "first pass after the resume, which this run does not, so torch's stream is one draw off from "
                "there on (dropout, augmentation) and the run does not continue as it did. Put the loader in "
                "`state` (a torchdata StatefulDataLoader), or give it a generator of its own "
                "(generator=torch.Generator().manual_seed(...)) so that it never draws from the global stream")
    return (f"{_described(iterator)} is not in `state`, and its workers draw random numbers (its dataset is "
            "wrapped by with_worker_rng): in this run they carry their streams from one pass to the next, a "
            "process resumed from this checkpoint starts them anew, so what they draw (augmentation) differs from "
            "that loader's first pass after the resume on. Put the loader in `state` (a torchdata "
            "StatefulDataLoader): its workers' streams are then saved and restored")


def warn_positions_left_out(loaders: list[Any]) -> list[str]:
    """Warn of positions_left_out (`loaders`: the loaders in `state`); returns what it found."""
    found = positions_left_out(loaders)
    if not found:
        return found
    message = (f"{found[0]} is in the middle of its pass and no loader in `state` is iterating it: its position "
               "does not travel, so a resume from this checkpoint takes that pass's batches from the start again "
               "and the run does not continue as it did. Put the loader in `state` (a torchdata "
               "StatefulDataLoader): skipping the batches already taken after a resume is not exact either, as the "
               "new iterator draws its seed from torch's global stream again. A loader outside the training loop "
               "(a validation pass under way at this save) may be left out")
    warn(message, CheckpointWarning)
    return found
