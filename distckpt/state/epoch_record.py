"""The record of a loader's epoch start: the random streams its sampling draws from, their
states when the epoch started, and the epochs, seeds and settings of its samplers.

The samplers' replay (replay.py) creates the first iterator after a restore from this record;
loader_plan.py records it at every epoch start of a loader the manager has seen.

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from distckpt.errors import IncompatibleCheckpointError, warn
from distckpt.state.capture import CheckpointWarning, has_class_named
from distckpt.state.streams import EPOCH_START, PrivateStream, private_stream_of

EPOCHS_KEY = "_distckpt_sampler_epochs"  # the samplers' epochs at the save, checked at the resumed iter()
EPOCH_START_ATTR = "_distckpt_epoch_start"  # on an iterator: the streams when its epoch started
EPOCHS_AT_START_ATTR = "_distckpt_sampler_epochs_at_start"  # on an iterator: its samplers' epochs as its pass began
LOADER_GENERATOR = "generator"  # the loader's own generator= among its sampling streams (an attribute path)


def is_torchdata(obj: Any, name: str) -> bool:
    return type(obj).__name__ == name and type(obj).__module__.startswith("torchdata.")


def is_stateful_dataloader(loader: Any) -> bool:
    return has_class_named(loader, "StatefulDataLoader", "torchdata.")


# -- the streams a loader's sampling draws from --------------------------------------------------

def _is_private_stream(obj: Any) -> bool:
    # torch's default generator is no private stream: it is recorded with the global ones
    return private_stream_of(obj) is not None and obj is not torch.default_generator


def sampling_streams(loader: Any) -> dict[str, Any]:
    """Every private stream the loader's sampling can draw from, by attribute path: the loader's
    generator, and those held by its sampler, batch sampler and the samplers inside them."""
    found: dict[str, Any] = {}
    seen: set[int] = set()

    def visit(obj: Any, path: str, depth: int) -> None:
        if id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if _is_private_stream(obj):
            found[path] = obj
            return
        if not isinstance(obj, torch.utils.data.Sampler) and depth > 0 and not _holds_a_sampler(obj):
            return
        for name, value in _held(obj):
            if _is_private_stream(value) or isinstance(value, torch.utils.data.Sampler) \
                    or _holds_a_sampler(value):
                visit(value, f"{path}.{name}", depth + 1)

    generator = getattr(loader, "generator", None)
    if generator is not None:
        visit(generator, LOADER_GENERATOR, 1)
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


def states(streams: dict[str, Any]) -> dict[str, Any]:
    """The global streams and each of `streams` (sampling_streams) now: an epoch start's record."""
    return {"global": {stream.epoch_start_name: stream.capture() for stream in EPOCH_START},
            "streams": {path: _private(obj).get(obj) for path, obj in streams.items()}}


def set_states(streams: dict[str, Any], record: dict[str, Any]) -> None:
    """Put the global streams and each of `streams` where `record` (from `states`) holds them."""
    saved = record["global"]
    for stream in EPOCH_START:
        stream.restore(saved[stream.epoch_start_name])
    for path, state in record["streams"].items():
        _private(streams[path]).set(streams[path], state)


def trial_states(streams: dict[str, Any], record: dict[str, Any]) -> None:
    """Restore `record` into scratch copies of every stream: raises where `set_states` would."""
    for path, state in record["streams"].items():
        _private(streams[path]).trial(streams[path], state)
    for stream in EPOCH_START:
        stream.trial(record["global"][stream.epoch_start_name])


def _private(obj: Any) -> PrivateStream:
    stream = private_stream_of(obj)
    assert stream is not None  # found by sampling_streams as one
    return stream


# -- recording each epoch's start ------------------------------------------------------------------

def record(iterator: Any, start: dict[str, Any] | None, epochs: dict[str, int] | None = None) -> None:
    """Keep `start` (from `states`) on the iterator its epoch started with, and `epochs` (from
    `sampler_epochs`, taken before the iterator was made); a later epoch that persistent workers
    start on the same iterator (`_reset`) records its own."""
    try:
        setattr(iterator, EPOCH_START_ATTR, start)
        setattr(iterator, EPOCHS_AT_START_ATTR, epochs)
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
        setattr(iterator, EPOCH_START_ATTR, {**states(sampling_streams(loader)), "reset": True})
        setattr(iterator, EPOCHS_AT_START_ATTR, sampler_epochs(loader))
        return type(iterator)._reset(iterator, loader, *args, **kwargs)


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
    at_start = getattr(iterator, EPOCHS_AT_START_ATTR, None)
    if mid_pass and isinstance(at_start, dict):
        # A mid-pass position lies in the order the pass began with. A sampler that counts its own
        # epochs at the end of its iterator (Accelerate's SeedableRandomSampler, the HF Trainer's
        # default) has counted the next one already when loader workers fetched the pass's last
        # indices ahead of the loop: a save then recorded the next epoch, and every resume of that
        # committed step was refused at its iter().
        epochs = {path: at_start.get(path, epoch) for path, epoch in epochs.items()}
    return {"epochs": epochs, "mid_pass": mid_pass, "seeds": _sampler_seeds(loader, samplers)}


def check_epochs(loader: Any, saved: Any, where: str) -> None:
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
             "StatefulDataLoader itself (docs: guides/frameworks.md, Lightning Fabric)")
    if saved.get("mid_pass"):
        raise IncompatibleCheckpointError(
            f"{where}: the loader resumes in the middle of an epoch, at a position in the order of epoch {was} of its "
            f"{path}, but that sampler's epoch is {is_} at this iter(): the batches after the resume would not be "
            f"the uninterrupted run's. {cause[0].upper()}{cause[1:]}")
    message = (f"{where}: the loader was saved at the end of a pass in epoch {was} of its {path}, and its next pass "
               f"starts in epoch {is_}, an earlier one: unless the uninterrupted run went back too, the run does "
               f"not continue as it did; {cause}")
    warn(message, CheckpointWarning)


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
    warn(what, CheckpointWarning)

