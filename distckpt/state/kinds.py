"""Entry kinds: what `state` may hold, one class each.

A kind says which objects it is (`matches`, in the order of KINDS: the first match wins, and a
kind may refuse an object it cannot store), its natural scope, and how one entry of it is
captured, checked against a checkpoint before anything changes (`validate`), restored in place
and put back after a failed load (`undo`). A new kind is one class here and a line in KINDS;
the save and load phases (saving.py, loading.py) only call the five functions at the bottom.

The helpers each kind composes live where their job is: capture.py (state to trees and back),
validation.py (the checks), undo.py (snapshots), sharded.py (DTensor state).

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

import copy
import logging
import random
import warnings
import weakref
from typing import Any, ClassVar, Iterator

import numpy as np
import torch
from torch import nn

from distckpt.errors import (
    CorruptCheckpointError,
    DistCkptError,
    IncompatibleCheckpointError,
    StateArgumentError,
    UnstorableValueError,
)
from distckpt.io import copying
from distckpt.io.staging import region_key
from distckpt.state import epoch_record, loader_hazards, loader_plan, replay, sharded, undo, validation
from distckpt.state.capture import (
    CONFIG_KEY,
    FABRIC_MODULES,
    PER_RANK,
    REPLICATED,
    SHARDED,
    TIES_BY_REGION,
    CheckpointWarning,
    Entry,
    PerRank,
    Release,
    _capture_module,
    _capture_plain,
    _capture_sampler,
    _has_state_dict,
    _owned,
    _restore_module,
    _restore_sampler,
    config_differences,
    copy_released,
    has_class_named,
    has_own_load_logic,
    note_user_error,
    parameter_flags,
    restore_parameter_flags,
    unwrap_module,
)
from distckpt.state.streams import numpy_to_plain as _numpy_to_plain
from distckpt.state.streams import plain_to_numpy as _plain_to_numpy
from distckpt.state.undo import Undo
from distckpt.state.validation import LoadRules
from distckpt.state.workers import WorkerRngDataset, WorkerRngIterableDataset

log = logging.getLogger("distckpt")

World = tuple[int, int]  # (rank, world size)


class Kind:
    """One kind of entry. Subclasses set `name` and override what differs."""

    name: ClassVar[str]
    scope: ClassVar[str] = REPLICATED  # where its state is written unless per_rank() says otherwise
    late: ClassVar[bool] = False  # restored after every rank restored the rest: checked completely first
    # Restored values are copied out of the file's buffer first: an owner that keeps the tensors it
    # is given (an optimizer keeps its state tensors) would otherwise keep the whole buffer alive.
    copies_loaded_tensors: ClassVar[bool] = True

    def matches(self, key: str, obj: Any) -> bool:
        return False

    def capture(self, entry: Entry) -> Any:
        raise NotImplementedError

    def validate(self, entry: Entry, saved: Any, where: str, world: World, rules: LoadRules) -> None:
        """Raise IncompatibleCheckpointError if `saved` cannot be restored into the entry whole."""

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        """Restore in place; returns notes for the caller (config differences)."""
        raise NotImplementedError

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        """A function that puts the entry back as it is now."""
        return lambda: None

    def is_late(self, entry: Entry) -> bool:
        return self.late

    def observe(self, target: Any) -> None:
        """Called each time a save or load classifies `state`: start watching what a later
        capture needs (a loader's epoch starts)."""


class _ModuleLike(Kind):
    """A module is restored late (after every rank restored the rest) only when its restore cannot
    fail: torch's own loading of a state checked completely before. One with load logic of its own
    (hooks, its own _load_from_state_dict) may refuse; it is restored with the early entries, its
    tensors copied first, so that its failure leaves every late entry untouched on every rank."""

    late, copies_loaded_tensors = True, False

    def is_late(self, entry: Entry) -> bool:
        return not has_own_load_logic(unwrap_module(entry.target))


def _trial(where: str, restore: Any) -> None:
    """Restore a saved RNG state into a scratch generator first: a state that verifies but that
    the generator refuses (forged) is found before anything changed, not half-way through."""
    try:
        restore()
    except (TypeError, ValueError, OverflowError, RuntimeError, KeyError) as e:
        raise CorruptCheckpointError(f"{where}: the saved random state would not restore "
                                     f"({type(e).__name__}: {str(e)[:120]})") from e


class Config(Kind):
    """`state["config"]`: compared with the resuming run's, never overwritten."""

    name = "config"

    def matches(self, key: str, obj: Any) -> bool:
        return key == CONFIG_KEY and not hasattr(obj, "state_dict")

    def capture(self, entry: Entry) -> Any:
        return _capture_plain(entry.target)

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        return config_differences(value, entry.target)


class Generator(Kind):
    name, scope, copies_loaded_tensors = "generator", PER_RANK, False

    def matches(self, key: str, obj: Any) -> bool:
        return isinstance(obj, torch.Generator)

    def capture(self, entry: Entry) -> Any:
        return {"state": entry.target.get_state(), "device": str(entry.target.device)}

    def validate(self, entry: Entry, saved: Any, where: str, world: World, rules: LoadRules) -> None:
        validation._generator(entry.target, saved, where, world, rules)
        _trial(where, lambda: torch.Generator(device=entry.target.device).set_state(saved["state"]))

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        entry.target.set_state(value["state"])
        return []

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        saved = entry.target.get_state()
        return lambda: entry.target.set_state(saved)


class NumpyGenerator(Kind):
    name, scope = "np_generator", PER_RANK

    def matches(self, key: str, obj: Any) -> bool:
        return isinstance(obj, np.random.Generator)

    def capture(self, entry: Entry) -> Any:
        return _numpy_to_plain(entry.target.bit_generator.state)

    def validate(self, entry: Entry, saved: Any, where: str, world: World, rules: LoadRules) -> None:
        validation._np_generator(entry.target, saved, where, world, rules)
        _trial(where, lambda: setattr(type(entry.target.bit_generator)(), "state", _plain_to_numpy(saved)))

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        entry.target.bit_generator.state = _plain_to_numpy(value)
        return []

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        saved = copy.deepcopy(entry.target.bit_generator.state)
        return lambda: setattr(entry.target.bit_generator, "state", saved)


class NumpyRandomState(Kind):
    name, scope = "np_random_state", PER_RANK

    def matches(self, key: str, obj: Any) -> bool:
        return isinstance(obj, np.random.RandomState)

    def capture(self, entry: Entry) -> Any:
        return _numpy_to_plain(entry.target.get_state(legacy=False))

    def validate(self, entry: Entry, saved: Any, where: str, world: World, rules: LoadRules) -> None:
        validation._np_random_state(entry.target, saved, where, world, rules)
        _trial(where, lambda: np.random.RandomState().set_state(_plain_to_numpy(saved)))

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        entry.target.set_state(_plain_to_numpy(value))
        return []

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        saved = entry.target.get_state(legacy=False)
        return lambda: entry.target.set_state(saved)


class PythonRandom(Kind):
    name, scope = "py_random", PER_RANK

    def matches(self, key: str, obj: Any) -> bool:
        if isinstance(obj, random.SystemRandom):
            raise UnstorableValueError(
                f"state[{key!r}] is a random.SystemRandom: it reads the operating system's entropy and has no "
                "state to save; use random.Random(seed) for a stream that can resume")
        return isinstance(obj, random.Random)

    def capture(self, entry: Entry) -> Any:
        return entry.target.getstate()

    def validate(self, entry: Entry, saved: Any, where: str, world: World, rules: LoadRules) -> None:
        validation._py_random(entry.target, saved, where, world, rules)
        _trial(where, lambda: random.Random().setstate(saved))

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        entry.target.setstate(value)
        return []

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        saved = entry.target.getstate()
        return lambda: entry.target.setstate(saved)


class Loader(Kind):
    """A data loader with state_dict (torchdata's StatefulDataLoader): its position."""

    name, scope = "loader", PER_RANK

    def matches(self, key: str, obj: Any) -> bool:
        if isinstance(obj, torch.utils.data.DataLoader) and not issubclass(type(obj), torch.utils.data.DataLoader):
            # Hugging Face Accelerate's prepared loader (DataLoaderShard, DataLoaderDispatcher)
            # answers __class__ with its base loader's class: taken for one, every resume drew
            # another shuffle order and moved the global stream (it fetches a batch ahead and
            # reseeds each epoch, none of which its base loader's position holds)
            raise UnstorableValueError(
                f"state[{key!r}] is {type(obj).__module__}.{type(obj).__name__}, a wrapper that passes for a "
                f"{obj.__class__.__name__} (Hugging Face Accelerate's prepared loader): it iterates its loader a "
                "batch ahead and reseeds it each epoch, so a resume would not continue exactly. Keep the loader out "
                "of accelerator.prepare(): build a torchdata StatefulDataLoader with a DistributedSampler and put "
                "that in `state` (README: Hugging Face Accelerate)")
        if has_class_named(obj, "_FabricDataLoader", *FABRIC_MODULES):
            # Its __iter__ calls set_epoch on the sampler with its own count of iter() calls, which
            # restarts at 0 in a resumed process: a resume took another epoch's order, silently
            raise UnstorableValueError(
                f"state[{key!r}] is Lightning Fabric's loader wrapper (fabric.setup_dataloaders): each iter() sets the "
                "sampler's epoch to its own count of iter() calls, which restarts at 0 in a resumed process, so a "
                "resume would take another epoch's order. Iterate the torchdata StatefulDataLoader itself (with "
                "a DistributedSampler you build, sampler.set_epoch(epoch) at each epoch start) and put that in "
                "`state`; move batches with fabric.to_device (README: Lightning Fabric)")
        if isinstance(obj, torch.utils.data.DataLoader) and not _has_state_dict(obj):
            raise UnstorableValueError(
                f"state[{key!r}] is a DataLoader without state_dict(): its position cannot be "
                "saved; use torchdata.stateful_dataloader.StatefulDataLoader (a drop-in "
                "replacement), or leave the loader out and store its sampler and generator")
        return isinstance(obj, torch.utils.data.DataLoader)

    def capture(self, entry: Entry) -> Any:
        was_dropped = loader_plan.dropped(entry.target)  # first: nothing here may hold its iterator yet
        if getattr(entry.target, "in_order", True) is False and getattr(entry.target, "num_workers", 0) > 0:
            # torchdata keeps no position it can resume then: batches come as workers finish them
            # (a resume lost one batch and repeated another, silently)
            raise UnstorableValueError(
                f"state[{entry.key!r}] is a loader with in_order=False and workers: its batches arrive in the order "
                "the workers finish them, and torchdata cannot resume such a position. Build it with in_order=True "
                "(the default) to checkpoint it, or leave it out of `state`")
        _warn_unwrapped_workers(entry)
        loader_hazards.warn_lossy_dataset_state(entry.target, entry.key)
        loader_hazards.refuse_a_fabric_wrapper(entry.target, entry.key)
        untouched = loader_plan.restored_untouched(entry.target)
        if untouched is not None:  # restored and not iterated since: saved as it was loaded (state_dict()
            # would start the next pass here, after a dropped iterator, and save that pass's start: the
            # same future in other bytes, which made `distckpt doctor` report a resume that was exact)
            saved, was_dropped = dict(untouched.state), untouched.dropped
        else:
            saved = entry.target.state_dict()
        generator = _own_generator(entry.target)
        if generator is not None and isinstance(saved, dict):
            # The loader's generator= shuffles and seeds every later epoch; the loader's state
            # does not hold it, so a generator not also put in `state` came back untouched and the
            # next epoch's order differed from the uninterrupted run's. It travels with the loader.
            saved = {**saved, _LOADER_GENERATOR: generator.get_state()}
        if isinstance(saved, dict):
            saved = {**saved, _LOADER_MAKEUP: _loader_makeup(entry.target)}
        sampling = replay.capture(entry.target, entry.key) if untouched is None else untouched.replay
        if sampling is not None and isinstance(saved, dict):
            saved = {**saved, replay.REPLAY_KEY: sampling}
        if was_dropped and isinstance(saved, dict):
            saved = {**saved, loader_plan.DROPPED_KEY: True}
        epochs = epoch_record.capture_epochs(entry.target, was_dropped,
                                       mid_pass=None if untouched is None else untouched.mid_pass)
        if epochs is not None and isinstance(saved, dict):
            saved = {**saved, epoch_record.EPOCHS_KEY: epochs}
        return saved

    def validate(self, entry: Entry, saved: Any, where: str, world: World, rules: LoadRules) -> None:
        if not isinstance(saved, dict):
            return
        workers = _saved_worker_count(saved)
        live = getattr(entry.target, "num_workers", 0)
        if workers is not None and workers != live:
            raise IncompatibleCheckpointError(
                f"{where}: the loader was saved with num_workers={workers} and this one has num_workers={live}: "
                "torchdata resumes a position only with the same number of workers (a different number "
                f"failed at the next iter()); build the loader with num_workers={workers}")
        _check_loader_makeup(entry.target, saved.get(_LOADER_MAKEUP), where)
        replay.check(entry.target, saved.get(replay.REPLAY_KEY), where)
        if _LOADER_GENERATOR in saved:
            generator = _own_generator(entry.target)
            if generator is None:
                raise IncompatibleCheckpointError(
                    f"{where}: the loader was saved with a generator= of its own and this one has none, so its "
                    "later epochs would shuffle differently: build it with generator=torch.Generator()")
            try:
                torch.Generator(device=generator.device).set_state(saved[_LOADER_GENERATOR])
            except (TypeError, RuntimeError) as e:
                raise IncompatibleCheckpointError(f"{where}: the loader's generator state does not fit its "
                                                  f"generator: {e}") from e

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        sampling, was_dropped, epochs = None, False, None
        if isinstance(value, dict) and ({_LOADER_GENERATOR, _LOADER_MAKEUP, replay.REPLAY_KEY, loader_plan.DROPPED_KEY,
                                         epoch_record.EPOCHS_KEY} & set(value)):
            value = dict(value)
            value.pop(_LOADER_MAKEUP, None)
            epochs = value.pop(epoch_record.EPOCHS_KEY, None)
            sampling = value.pop(replay.REPLAY_KEY, None)
            was_dropped = value.pop(loader_plan.DROPPED_KEY, False) is True
            generator_state = value.pop(_LOADER_GENERATOR, None)
            generator = _own_generator(entry.target)
            if generator is not None and generator_state is not None:  # validated
                generator.set_state(generator_state)
        _warn_iterator_made_before(entry)
        entry.target.load_state_dict(value)
        loader_plan.plan_resume(entry.target, sampling, was_dropped, epochs, f"state[{entry.key!r}]", restored=value)
        return []

    def observe(self, target: Any) -> None:
        loader_plan.watch(target)  # each epoch's start, for a save in its middle

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        attributes = dict(vars(entry.target))  # StatefulDataLoader.load_state_dict only sets attributes
        generator = _own_generator(entry.target)
        before = generator.get_state() if generator is not None else None

        def put_back() -> None:
            undo.replace_dict(vars(entry.target), attributes.items())
            if generator is not None and before is not None:
                generator.set_state(before)

        return put_back


_LOADER_GENERATOR = "_distckpt_loader_generator"  # beside torchdata's keys in the loader's saved state
_LOADER_MAKEUP = "_distckpt_loader_makeup"  # what its position counts in: the samplers' kinds, the dataset's length


def _loader_makeup(loader: Any) -> dict[str, Any]:
    """What a saved position means only together with: a position taken over a shuffled sampler
    put into a loader built with shuffle=False failed at the next iter() with a bare
    AssertionError from torchdata; over a dataset of another length the rest of the epoch came
    from another permutation (items seen before the save came again), silently."""
    makeup: dict[str, Any] = {name: type(getattr(loader, name)).__qualname__
                              for name in ("sampler", "batch_sampler") if getattr(loader, name, None) is not None}
    try:
        makeup["dataset_len"] = len(loader.dataset)
    except (TypeError, NotImplementedError, AttributeError):  # an IterableDataset: no length to compare
        pass
    # A batch sampler of the user's (batch_sampler=): the position counts its batches, so another
    # batch size resumed at another item (5 batches of 2 saved, 5 batches of 3 skipped), silently
    size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    if getattr(loader, "batch_size", 0) is None and isinstance(size, int) and not isinstance(size, bool):
        makeup["batch_sampler_batch_size"] = size
    settings = epoch_record.sampler_settings(loader)
    if settings:
        makeup["sampler_settings"] = settings
    return makeup


def _check_loader_makeup(loader: Any, saved: Any, where: str) -> None:
    if not isinstance(saved, dict):
        return  # saved before the makeup was recorded
    live = _loader_makeup(loader)
    for name in ("sampler", "batch_sampler"):
        if name in saved and name in live and saved[name] != live[name]:
            raise IncompatibleCheckpointError(
                f"{where}: the loader was saved with {name} {saved[name]} and this one has {live[name]} (shuffle= or "
                f"{name}= changed?): its position counts in that {name}'s order; build the loader as it was saved")
    size = "batch_sampler_batch_size"
    if size in saved and size in live and saved[size] != live[size]:
        raise IncompatibleCheckpointError(
            f"{where}: the loader's batch sampler was saved with batch_size={saved[size]} and this one has "
            f"batch_size={live[size]}: a batch sampler's position counts its batches, so the resume would continue "
            f"at another item (some never seen in this epoch, or seen twice); build it with batch_size={saved[size]}, "
            "or change it at an epoch boundary with the loader left out of that load")
    _check_sampler_settings(saved.get("sampler_settings"), live.get("sampler_settings", {}), where)
    if "dataset_len" in saved and "dataset_len" in live and saved["dataset_len"] != live["dataset_len"]:
        raise IncompatibleCheckpointError(
            f"{where}: the loader's dataset has {live['dataset_len']} items and had {saved['dataset_len']} when saved: "
            "the saved position would continue another epoch's order (items seen before the save again, others never); "
            "resume over the same dataset, or start the new data at an epoch boundary without the loader's state")


def _check_sampler_settings(saved: Any, live: dict[str, dict[str, bool]], where: str) -> None:
    if not isinstance(saved, dict):
        return  # saved before the settings were recorded
    for path, settings in sorted(saved.items()):
        if not isinstance(settings, dict) or path not in live:
            continue
        for name, was in sorted(settings.items()):
            is_ = live[path].get(name)
            if is_ is not None and is_ != was:
                raise IncompatibleCheckpointError(
                    f"{where}: the loader's {path} was saved with {name}={was} and has {name}={is_} here: its position "
                    f"counts in the saved order, so the resume would continue another one (items seen before the save "
                    f"again, others never); build the sampler with {name}={was}, or change it at an epoch boundary with "
                    "the loader left out of that load")


def _warn_iterator_made_before(entry: Entry) -> None:
    """An iterator of the loader made before the load (`it = iter(loader)` above load_latest)
    goes on from where it was, not from the checkpoint's position: only the next iter() resumes.
    Said rather than refused: a loop that rolls back with load(state, step) and then iterates
    afresh is right."""
    loader = entry.target
    if getattr(loader, "_iterator", None) is None or getattr(loader, "_initial_iter_for_state_dict", False):
        return
    message = (f"state[{entry.key!r}]: an iterator of this loader was made before this load; it goes on from its "
               "own position, not the checkpoint's. Make the iterator after the load (iter(loader) or "
               "`for batch in loader` after load_latest); only a new one resumes")
    log.warning(message)
    warnings.warn(message, CheckpointWarning, stacklevel=6)


def _own_generator(loader: Any) -> torch.Generator | None:
    generator = getattr(loader, "generator", None)
    if isinstance(generator, torch.Generator) and generator is not torch.default_generator:
        return generator
    return None  # torch's default generator travels with the process's streams


def _saved_worker_count(saved: dict[str, Any]) -> int | None:
    """The num_workers a StatefulDataLoader state was saved with (None: not torchdata's layout)."""
    snapshot = saved.get("_snapshot")
    if isinstance(snapshot, dict):
        main = snapshot.get("_main_snapshot")
        count = main.get("_num_workers") if isinstance(main, dict) else None
        return count if isinstance(count, int) else None
    return 0 if "_num_yielded" in saved else None


_WARNED_LOADERS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _warn_unwrapped_workers(entry: Entry) -> None:
    """Once per loader with workers: they seed their own random streams when an epoch starts, and only a
    dataset wrapped with with_worker_rng carries them in the loader's state. A dataset that draws
    nothing needs no wrapper, which is why this warns rather than refuses."""
    loader = entry.target
    dataset = getattr(loader, "dataset", None)
    if loader in _WARNED_LOADERS or isinstance(dataset, (WorkerRngDataset, WorkerRngIterableDataset)):
        return
    if getattr(loader, "num_workers", 0) <= 0:
        return  # replayed in this process from the streams its epoch started with (replay.py)
    _WARNED_LOADERS.add(loader)
    message = (f"state[{entry.key!r}] loads with {loader.num_workers} workers and its dataset is not wrapped "
               "with distckpt.with_worker_rng(dataset): random draws inside the workers (augmentation, "
               "random crops) will not resume exactly. Wrap the dataset, or ignore this if it draws nothing")
    log.warning(message)
    warnings.warn(message, CheckpointWarning, stacklevel=6)


class Sampler(Kind):
    name, scope = "sampler", PER_RANK

    def matches(self, key: str, obj: Any) -> bool:
        return isinstance(obj, torch.utils.data.Sampler)

    def capture(self, entry: Entry) -> Any:
        return _capture_sampler(entry.target)

    def validate(self, entry: Entry, saved: Any, where: str, world: World, rules: LoadRules) -> None:
        validation._sampler(entry.target, saved, where, world, rules)

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        _restore_sampler(entry.target, value)
        return []

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        target = entry.target
        if callable(getattr(target, "state_dict", None)):
            sd = copy.deepcopy(target.state_dict())
            return lambda: target.load_state_dict(sd)
        plain = _capture_sampler(target)
        return lambda: _restore_sampler(target, plain)


class ShardedModule(_ModuleLike):
    """A module over DTensor parameters (FSDP2, tensor parallel): each rank writes its pieces."""

    name, scope = "sharded_module", SHARDED

    def matches(self, key: str, obj: Any) -> bool:
        return isinstance(obj, nn.Module) and sharded.has_dtensor_params(unwrap_module(obj).parameters())

    def capture(self, entry: Entry) -> Any:
        module = unwrap_module(entry.target)
        return {**sharded.capture_module(module), "requires_grad": parameter_flags(module)}

    def validate(self, entry: Entry, saved: Any, where: str, world: World, rules: LoadRules) -> None:
        # shapes and keys were checked while its pieces were assembled (resolve_sharded_entry)
        if entry.scope == SHARDED and not rules.allow_dtype_cast:
            validation._check_dtypes(unwrap_module(entry.target).state_dict(), saved["state_dict"], where)

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        sharded.restore_module(unwrap_module(entry.target), value)
        restore_parameter_flags(unwrap_module(entry.target), value)
        return []

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        return undo.module_undo(unwrap_module(entry.target))


class Module(_ModuleLike):
    """An nn.Module (bare, DDP, DataParallel or compiled): its state_dict and every submodule's
    `training` flag."""

    name = "module"

    def matches(self, key: str, obj: Any) -> bool:
        return isinstance(obj, nn.Module)

    def capture(self, entry: Entry) -> Any:
        return _capture_module(entry.target)

    def validate(self, entry: Entry, saved: Any, where: str, world: World, rules: LoadRules) -> None:
        validation._module(entry.target, saved, where, world, rules)

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        _restore_module(unwrap_module(entry.target), value, release, f"state[{entry.key!r}]")
        return []

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        return undo.module_undo(unwrap_module(entry.target))


class Stateful(Kind):
    """Anything with state_dict / load_state_dict: optimizers, schedulers, scalers, users' objects."""

    name = "stateful"

    def matches(self, key: str, obj: Any) -> bool:
        return _has_state_dict(obj)

    def capture(self, entry: Entry) -> Any:
        return entry.target.state_dict()

    def validate(self, entry: Entry, saved: Any, where: str, world: World, rules: LoadRules) -> None:
        validation._optimizer(entry.target, saved, where, world, rules)

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        if isinstance(entry.target, torch.optim.Optimizer):
            value = _with_param_id_sets(value)
        entry.target.load_state_dict(value)
        return []

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        if isinstance(entry.target, torch.optim.Optimizer):
            return undo.optimizer_undo(entry.target)
        saved = copy.deepcopy(entry.target.state_dict())
        return lambda: entry.target.load_state_dict(saved)


class _ParamIds(list):  # type: ignore[type-arg]
    """A param group's saved parameter ids whose `in` is a set lookup. Optimizer.load_state_dict
    asks `param_id in group["params"]` of every saved group for every state tensor: a list scan,
    quadratic in the parameters (4.0 of a 6.1 s load of 20,000 parameters with AdamW; 0.1 s
    after). It deep-copies the groups and then replaces "params" by the optimizer's own list, so
    nothing of this class outlives the load."""

    def __contains__(self, item: object) -> bool:
        cached = self.__dict__.get("_ids")
        if cached is None or cached[0] != len(self):  # (re)built once the list holds its items
            hashable = all(isinstance(i, (int, str)) for i in self)
            cached = self.__dict__["_ids"] = (len(self), frozenset(self) if hashable else None)
        ids = cached[1]
        try:
            return list.__contains__(self, item) if ids is None else item in ids
        except TypeError:  # an unhashable item asked about: no id equals it
            return list.__contains__(self, item)


def _with_param_id_sets(saved: Any) -> Any:
    """`saved` (an optimizer's state dict) with each param group's "params" a _ParamIds."""
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        return saved
    groups = [{**g, "params": _ParamIds(g["params"])}
              if isinstance(g, dict) and type(g.get("params")) is list else g
              for g in saved["param_groups"]]
    return {**saved, "param_groups": groups}


class ShardedOptimizer(Kind):
    """An optimizer over DTensor parameters, named by its module's parameters (given to an
    optimizer entry by `classify`, never matched alone)."""

    name, scope = "sharded_optimizer", SHARDED

    def capture(self, entry: Entry) -> Any:
        return sharded.capture_optimizer(entry.owner, entry.target)

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        sharded.restore_optimizer(entry.owner, entry.target, value)
        return []

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        if isinstance(entry.target, torch.optim.Optimizer):
            return undo.optimizer_undo(entry.target)
        return Stateful().undo(entry, state)


class Tensor(Kind):
    """A tensor entry, copied into in place (checked completely first: not snapshotted)."""

    name, late, copies_loaded_tensors = "tensor", True, False

    def matches(self, key: str, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

    def capture(self, entry: Entry) -> Any:
        return entry.target

    def validate(self, entry: Entry, saved: Any, where: str, world: World, rules: LoadRules) -> None:
        validation._tensor(entry.target, saved, where, world, rules)

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        copy_released(entry.target, value, release, f"state[{entry.key!r}]")
        return []


class Value(Kind):
    """Anything else: plain values and containers (a dict or list is refilled in place)."""

    name = "value"

    def matches(self, key: str, obj: Any) -> bool:
        return True

    def capture(self, entry: Entry) -> Any:
        return _capture_plain(entry.target)

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        target = entry.target
        # Refilled in place (whoever holds the live container sees the values) only when the live
        # one is of the saved type: a plain dict refilled from a saved OrderedDict (or the reverse)
        # would not come back as what was saved.
        if type(target) is type(value) and isinstance(value, dict):
            target.clear()
            target.update(value)
        elif type(target) is type(value) and isinstance(value, list):
            target[:] = value
        else:
            state[entry.key] = PerRank(value) if entry.scope == PER_RANK and isinstance(state[entry.key], PerRank) else value
        return []

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        return undo.value_undo(entry, state)


# Classification order: the first kind that matches an object is its kind.
KINDS: list[Kind] = [Config(), Generator(), NumpyGenerator(), NumpyRandomState(), PythonRandom(), Loader(),
                     Sampler(), ShardedModule(), Module(), Stateful(), Tensor(), Value()]
BY_NAME: dict[str, Kind] = {k.name: k for k in [*KINDS, ShardedOptimizer()]}
# What KINDS gives a plain tensor or Parameter under any key but "config", without asking
# each kind in turn (20 us of each of a 2,000-tensor state's entries).
_TENSOR = BY_NAME["tensor"]
_PLAIN_TENSOR_TYPES = (torch.Tensor, nn.Parameter)


# -- what the save and load phases call -------------------------------------------------------

def classify(state: dict[str, Any]) -> list[Entry]:
    """Classify every top-level entry of `state` (a dict with str keys)."""
    if not isinstance(state, dict):
        raise StateArgumentError(f"state={repr(state)[:60]}: must be a dict of entries (str keys: a model, an "
                                 f"optimizer, a loader ...), got {type(state).__name__}")
    sharded.reshard_fully_sharded(obj.obj if isinstance(obj, PerRank) else obj for obj in state.values())
    entries = []
    for key, obj in state.items():
        if type(key) is not str:  # a subclass (np.str_, a str enum) would come back as a plain str
            raise StateArgumentError(f"state=: its key {key!r} is a {type(key).__name__}; the entries of `state` "
                                     "are named by plain str keys ('model', 'optimizer', ...): use str(key)")
        forced = isinstance(obj, PerRank)
        target = obj.obj if forced else obj
        kind = _TENSOR if type(target) in _PLAIN_TENSOR_TYPES and key != CONFIG_KEY else \
            next(k for k in KINDS if k.matches(key, target))
        kind.observe(target)
        entries.append(Entry(key, PER_RANK if forced else kind.scope, kind.name, target))
    return _link_optimizers(entries)


def _link_optimizers(entries: list[Entry]) -> list[Entry]:
    """Give each optimizer the module that holds its parameters; over DTensor parameters it is
    sharded, and its state can only be named (and resharded) through that module."""
    modules = [(e, {id(p) for p in unwrap_module(e.target).parameters()}) for e in entries
               if e.kind in (Module.name, ShardedModule.name)]
    out = []
    for e in entries:
        if e.scope != PER_RANK and isinstance(e.target, torch.optim.Optimizer):
            params = sharded.optimizer_params(e.target)
            owner = next((unwrap_module(m.target) for m, ids in modules
                          if all(id(p) in ids for p in params)), None)
            if sharded.has_dtensor_params(params):
                if owner is None:
                    raise UnstorableValueError(
                        f"state[{e.key!r}] is an optimizer over sharded (DTensor) parameters, but no "
                        "module in `state` holds all of them; put the FSDP2 / DTensor model in `state` too")
                e = Entry(e.key, SHARDED, ShardedOptimizer.name, e.target, owner)
            else:
                e = Entry(e.key, e.scope, e.kind, e.target, owner)
        out.append(e)
    return out


def capture_entry(entry: Entry) -> dict[str, Any]:
    """The entry's state as a tree of tensors and plain values (tagged with its kind; an
    optimizer also with its class, which its state_dict does not say)."""
    try:
        state = BY_NAME[entry.kind].capture(entry)
    except DistCkptError:
        raise
    except Exception as e:  # the user's own state_dict(): keep its type (callers catch it), say where
        note_user_error(e, entry.key, entry.kind)
        raise
    out = {"kind": entry.kind, "state": state}
    if isinstance(entry.target, torch.optim.Optimizer):
        out["type"] = type(entry.target).__name__
    return out


def validate_entry(entry: Entry, saved: dict[str, Any], world: World, rules: LoadRules = LoadRules()) -> None:
    """Raise IncompatibleCheckpointError if `saved` cannot be restored into `entry` whole."""
    where = f"state[{entry.key!r}]"
    if saved.get("kind") != entry.kind:
        raise IncompatibleCheckpointError(
            f"{where} is a {entry.kind} entry here but a {saved.get('kind')} entry in the checkpoint")
    saved_type, live_type = saved.get("type"), type(entry.target).__name__
    if isinstance(entry.target, torch.optim.Optimizer) and isinstance(saved_type, str) and saved_type != live_type:
        raise IncompatibleCheckpointError(
            f"{where} is a {live_type} here but a {saved_type} in the checkpoint: its state (moments, "
            f"hyperparameters) means something else to another optimizer; build a {saved_type} as the run "
            "that saved did, or leave the optimizer out of `state` to start it afresh")
    try:
        BY_NAME[entry.kind].validate(entry, saved["state"], where, world, rules)
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:  # a forged file that verifies
        raise CorruptCheckpointError(f"{where}: the saved state does not have the structure of a {entry.kind} "
                                     f"entry ({type(e).__name__}: {str(e)[:120]})") from e


def snapshot(entry: Entry, state: dict[str, Any]) -> Undo:
    """A function that puts `entry` back as it is now."""
    return BY_NAME[entry.kind].undo(entry, state)


def restore_entry(entry: Entry, saved: dict[str, Any], state: dict[str, Any],
                  memo: dict[Any, Any] | None = None, release: Release | None = None) -> list[str]:
    """Restore one validated entry in place; returns notes for the caller (config diffs).
    Entries restored with one `memo` keep the tensors they share shared. `release` is called
    with each source tensor once it is copied (the protocol's PageRelease)."""
    kind, value = BY_NAME[entry.kind], saved["state"]
    if kind.copies_loaded_tensors:
        value = _owned(value, memo, release)
    return kind.restore(entry, value, state, release)


def live_ties(entries: list[Entry], saved: dict[str, Any], by_region: bool = True) -> dict[Any, Any]:
    """The restore's memo to start from: each saved tensor that a tensor or module entry restores
    in place, mapped to the live tensor it goes into. Another entry holding the same tensor (a
    parameter list or an EMA kept beside the model, `{"a": t, "b": [t]}`) then gets that live
    object back, not a copy: the tie of the saved state holds after the load. `by_region`: also a
    reference that decoded as another view of the same stored bytes (a Parameter beside the
    state_dict's plain tensor) — not for an incremental step, whose shared files hold equal bytes
    of different tensors once."""
    memo: dict[Any, Any] = {TIES_BY_REGION: by_region}
    for _, stored, live in _in_place_copies(entries, saved):
        memo[id(stored)] = live
        region = region_key(stored)  # another reference to the same stored bytes decodes as its own view
        if by_region and region is not None:
            memo[("region",) + region] = live
    return memo


def _in_place_copies(entries: list[Entry], saved: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(where, stored tensor, live tensor) for every copy a load makes in place: tensor entries
    and the parameters and buffers of module entries."""
    for entry in entries:
        record = saved.get(entry.key)
        if not isinstance(record, dict) or record.get("kind") != entry.kind:
            continue
        if entry.kind == Tensor.name and isinstance(record["state"], torch.Tensor):
            yield f"state[{entry.key!r}]", record["state"], entry.target
        elif entry.kind == Module.name and isinstance(record["state"], dict):
            stored = record["state"].get("state_dict") or {}
            for name, live in unwrap_module(entry.target).state_dict(keep_vars=True).items():
                if isinstance(stored.get(name), torch.Tensor) and isinstance(live, torch.Tensor):
                    yield f"state[{entry.key!r}].{name}", stored[name], live


def check_destinations_apart(entries: list[Entry], saved: dict[str, Any]) -> None:
    """Refuse, before anything changes, two different saved tensors whose live destinations share
    memory (`{"a": t, "b": t}` loaded from a checkpoint where a and b differed; a checkpoint of an
    untied model loaded into a tied one): the second copy would overwrite the first, and one of
    them would silently hold the other's values. Equal bytes into the same live tensor are fine."""
    by_storage: dict[tuple[Any, int], list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for where, stored, live in _in_place_copies(entries, saved):
        if live.numel() == 0 or live.device.type == "meta":
            continue
        by_storage.setdefault((live.device, live.untyped_storage().data_ptr()), []).append((where, stored, live))
    for alone_or_not in by_storage.values():
        if len(alone_or_not) < 2:
            continue  # most tensors own their storage: their extents are never needed (a 20,000-tensor load paid ~4 us each)
        copies = sorted(((*copying.byte_extent(live), where, stored, live) for where, stored, live in alone_or_not),
                        key=lambda c: c[0])
        for i, (_, end, where, stored, live) in enumerate(copies):
            for other_start, _, other_where, other_stored, other_live in copies[i + 1:]:
                if other_start >= end:
                    break
                if _same_stored(stored, other_stored) or not copying.elements_overlap(live, other_live):
                    continue
                if region_key(live) == region_key(other_live) and copying.same_bits(stored, other_stored):
                    continue
                if _copies_agree([(stored, live), (other_stored, other_live)]):
                    continue  # views of one buffer saved as such (x and x.view(-1)): either order writes the same
                raise IncompatibleCheckpointError(
                    f"{where} and {other_where} share memory here but are different tensors in the checkpoint: "
                    "copying both into it would leave one holding the other's values. Untie them here (or tie "
                    "them as the run that saved did, e.g. the same parameter for embedding and output) before loading")


def _copies_agree(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether copying each stored tensor into its live view of one memory leaves every view
    holding its stored values (they agree wherever the views overlap): tried on a scratch copy
    of the bytes the views span."""
    extents = [copying.byte_extent(live) for _, live in copies]
    start, end = min(e[0] for e in extents), max(e[1] for e in extents)
    if any((live.data_ptr() - start) % live.element_size() for _, live in copies) or end - start > 1 << 30:
        return False  # views that do not fit one scratch buffer evenly (or beyond 1 GiB): kept apart
    scratch = torch.empty(end - start, dtype=torch.uint8, device=copies[0][1].device).untyped_storage()
    views = [torch.empty(0, dtype=live.dtype, device=live.device).set_(
        scratch, (live.data_ptr() - start) // live.element_size(), live.shape, live.stride()) for _, live in copies]
    for (stored, _), view in zip(copies, views):
        view.copy_(stored)
    return all(copying.same_bits(view, stored) for (stored, _), view in zip(copies, views))


def _same_stored(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (region_key(a) is not None and region_key(a) == region_key(b))


def copy_destinations(entries: list[Entry]) -> list[torch.Tensor]:
    """The live tensors a load copies into in place: tensor entries, and the parameters and
    buffers of module entries (copying.Prefault faults their pages in while the files are read)."""
    out: list[torch.Tensor] = []
    for entry in entries:
        if entry.kind == Tensor.name and isinstance(entry.target, torch.Tensor):
            out.append(entry.target)
        elif entry.kind == Module.name:
            out.extend(t for t in unwrap_module(entry.target).state_dict(keep_vars=True).values()
                       if isinstance(t, torch.Tensor))
    return out


def staged_tensors(entries: list[Entry]) -> list[torch.Tensor]:
    """The tensors an async save of these entries copies into staging buffers, as far as they
    can be told without encoding: what a load copies into (copy_destinations), sharded modules'
    pieces and optimizers' state (a DTensor's local piece, as sharded saves stage it); a tied
    weight once, as it is staged once."""
    found: list[Any] = copy_destinations(entries)
    for entry in entries:
        if entry.kind == ShardedModule.name:
            found.extend(unwrap_module(entry.target).state_dict(keep_vars=True).values())
        elif isinstance(entry.target, torch.optim.Optimizer):
            for per_parameter in entry.target.state.values():
                found.extend(per_parameter.values())
    unique: dict[Any, torch.Tensor] = {}
    for t in found:
        if isinstance(t, torch.Tensor):
            local = (t.to_local() if hasattr(t, "to_local") else t).detach()
            unique.setdefault(region_key(local) or id(local), local)
    return list(unique.values())


def is_late(entry: Entry) -> bool:
    """Restored in the second phase, after every rank restored the early entries."""
    return BY_NAME[entry.kind].is_late(entry)
