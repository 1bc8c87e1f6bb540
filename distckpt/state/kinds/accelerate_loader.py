"""Hugging Face Accelerate's prepared loader (`DataLoaderShard`, what `accelerator.prepare(loader)`
returns) over torchdata's StatefulDataLoader (`use_stateful_dataloader=True`): its position, per rank.

The wrapper iterates the loader under it one batch ahead of the loop (to know a pass's last
batch), and counts its passes itself (`iteration`, handed to the samplers' set_epoch at each
pass). So a save holds, besides the inner loader's state (the Loader kind's, with its streams):

* the batch fetched and not yet given to the loop. Its augmentation was drawn before the save (in
  this process without workers), so it cannot be drawn again: it is saved as it is and given
  first after a restore. The inner loader's iterators are watched through a tap on its
  `__iter__`, the one call the wrapper makes to start a pass (`observe`);
* whether the wrapper gave its pass's last batch and has not ended the pass yet: the first pass
  after a restore then ends at once, as the uninterrupted run's did at its next batch (a loop's
  `for batch in loader` ends, and its epoch count moves on); the pass count is saved as the
  wrapper has it once that pass is over.

A prepared loader over a plain DataLoader (no position to save), a dispatching one (rank 0 reads
every batch), and one made by `skip_first_batches` are refused, naming what to do.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from distckpt.errors import ElasticResumeError, IncompatibleCheckpointError, UnstorableValueError
from distckpt.state.capture import Entry, Release, has_class_named
from distckpt.state.epoch_record import is_stateful_dataloader
from distckpt.state.kinds.loader import Loader
from distckpt.state.loader_plan import _PLAN as _RESUME_PLAN
from distckpt.state.undo import Undo

ACCELERATE_MODULES = ("accelerate.",)
_TAP = "_distckpt_prepared_tap"        # on the inner loader: the tap of its newest iterator
_SHARD = "_distckpt_prepared_by"       # on the inner loader: the prepared loader over it
_PENDING = "_distckpt_held_batch"      # on the inner loader: a restored batch, given first by the next tap
_NOTHING: Any = object()


def is_prepared_loader(obj: Any) -> bool:
    return has_class_named(obj, "DataLoaderShard", *ACCELERATE_MODULES)


class AcceleratePreparedLoader(Loader):
    """Accelerate's prepared loader over a StatefulDataLoader: the inner loader's position, the
    batch held ahead, the pass count."""

    name = "accelerate_loader"
    description = ("Hugging Face Accelerate's prepared loader over a StatefulDataLoader: its position, the batch "
                   "it holds ahead of the loop and its pass count, per rank")

    def matches(self, key: str, obj: Any) -> bool:
        if has_class_named(obj, "DataLoaderDispatcher", *ACCELERATE_MODULES):
            raise UnstorableValueError(
                f"state[{key!r}] is Accelerate's dispatching loader (dispatch_batches=True: rank 0 reads every batch "
                "and sends each rank its slice): no rank holds a position of its own to save. Prepare it with "
                "DataLoaderConfiguration(dispatch_batches=False, use_stateful_dataloader=True)")
        if not is_prepared_loader(obj):
            return False
        if getattr(obj, "skip_batches", 0):
            raise UnstorableValueError(
                f"state[{key!r}] was made by accelerator.skip_first_batches(): distckpt restores the position "
                "itself, and the skip would come on top of it. Put the prepared loader itself in `state` and "
                "iterate it after load_latest")
        if not is_stateful_dataloader(vars(obj).get("base_dataloader")):
            raise UnstorableValueError(
                f"state[{key!r}] is Accelerate's prepared loader over a plain DataLoader, which cannot say where it "
                "is. Build the Accelerator with dataloader_config=DataLoaderConfiguration("
                "use_stateful_dataloader=True) (distckpt.integrations.accelerate.make_accelerator() does), so that "
                "it is backed by a torchdata StatefulDataLoader")
        return True

    def observe(self, target: Any) -> None:
        inner = target.base_dataloader
        if _SHARD not in vars(inner) and getattr(inner, "_initial_iter_for_state_dict", False):
            # Accelerate asked the new loader for its state_dict(), which made its first iterator
            # before anything watched it, and the first pass would take that one: its epoch start
            # (the streams its order is drawn from) went unrecorded. The next iter() makes another.
            inner._iterator, inner._initial_iter_for_state_dict = None, False
        _make_seedable_generators(inner)
        super().observe(inner)
        vars(inner)[_SHARD] = weakref.ref(target)
        vars(inner)["__iter__"] = _tapped_iter(inner)  # the wrapper calls inner.__iter__() by name

    def prepare_capture(self, entry: Entry) -> None:
        super().prepare_capture(_inner(entry))

    def capture(self, entry: Entry) -> Any:
        inner = entry.target.base_dataloader
        saved = super().capture(_inner(entry))  # first: it tells a dropped iterator by who holds it
        tap = _tap_of(inner)
        held, ended, iteration = _NOTHING, False, entry.target.iteration
        pending = vars(inner).get(_PENDING)
        if tap is not None:
            held = tap.held
            # the wrapper gave its last batch (the loop holds it now) and ends the pass at the next
            ended = tap.ended_at is not None and tap.ended_at == iteration
            iteration += ended  # as the wrapper counts it then (it does not count a pass that ends at once)
        elif isinstance(pending, _Pending):  # restored and not iterated since: saved as restored
            held, ended = (_NOTHING if pending.batch is None else pending.batch[0]), pending.ended
        elif _mid_pass(inner):
            raise UnstorableValueError(
                f"state[{entry.key!r}]: this prepared loader's pass began before the checkpoint manager saw it, so "
                "the batch it holds ahead of the loop is not known. Call mgr.load_latest(state) before the first "
                "pass (on a fresh start too)")
        del tap
        return {"loader": saved, "iteration": iteration, "ended": ended,
                "held": None if held is _NOTHING else [plain_batch(held)]}

    def validate(self, entry: Entry, saved: Any, where: str, world: Any, rules: Any) -> None:
        if not isinstance(saved, dict) or not {"loader", "iteration", "ended", "held"} <= set(saved) \
                or type(saved["iteration"]) is not int or type(saved["ended"]) is not bool \
                or not (saved["held"] is None or isinstance(saved["held"], list)):
            raise IncompatibleCheckpointError(f"{where}: not the record of an Accelerate prepared loader")
        super().validate(_inner(entry), saved["loader"], where, world, rules)

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        inner = entry.target.base_dataloader
        notes = super().restore(_inner(entry), value["loader"], state, release)
        entry.target.iteration = value["iteration"]
        vars(inner)[_PENDING] = _Pending(value["held"], value["ended"])
        return notes

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        inner_undo = super().undo(_inner(entry), state)
        inner, iteration = entry.target.base_dataloader, entry.target.iteration
        pending = vars(inner).get(_PENDING, _NOTHING)

        def put_back() -> None:
            inner_undo()
            entry.target.iteration = iteration
            vars(inner).pop(_PENDING, None)
            if pending is not _NOTHING:
                vars(inner)[_PENDING] = pending

        return put_back

    def elastic(self, entry: Entry, saved: list[Any], context: Any, held: list[int] | None = None) -> Any:
        raise ElasticResumeError(
            f"state[{entry.key!r}] is Accelerate's prepared loader: it shards batches by its own rules (its batch "
            "sampler shard, a batch held ahead), which world_size_policy='elastic' does not continue at another world "
            "size. Load with world_size_policy='reshard' to restart the epoch, or keep the loader out of "
            "accelerator.prepare(): a torchdata StatefulDataLoader over a DistributedSampler (docs: guides/elastic.md)")

    def summary(self, state: Any) -> dict[str, Any]:
        if not isinstance(state, dict):
            return {}
        return {**super().summary(state.get("loader")), "iteration": state.get("iteration"),
                "holds_a_batch": state.get("held") is not None}


class _Pending:
    """What the first tap after a restore gives before the inner loader's iterator: the held
    batch, or the end of the pass."""

    def __init__(self, batch: list[Any] | None, ended: bool) -> None:
        self.batch, self.ended = batch, ended


class _Tap:
    """Between the prepared loader and its inner loader's iterator: remembers the batch the
    wrapper fetched last (the one it holds while the loop works on the one before), and when the
    pass ended; gives a restored held batch first."""

    def __init__(self, inner: Any, iterator: Any) -> None:
        self.iterator = iterator
        self.held: Any = _NOTHING
        self.ended_at: int | None = None  # the prepared loader's pass count when this pass ended
        self._shard = vars(inner).get(_SHARD)
        pending = vars(inner).pop(_PENDING, None)
        self._pending: list[Any] | None = pending.batch if isinstance(pending, _Pending) and pending.batch else None

    def __iter__(self) -> _Tap:
        return self

    def __next__(self) -> Any:
        if self._pending is not None:
            batch, self._pending = self._pending[0], None
        else:
            try:
                batch = next(self.iterator)
            except StopIteration:
                shard = self._shard() if self._shard is not None else None
                self.held, self.ended_at = _NOTHING, getattr(shard, "iteration", None)
                raise
        self.held = batch
        return batch

    def __len__(self) -> int:
        return len(self.iterator)


def _tapped_iter(inner: Any) -> Any:
    owner = weakref.ref(inner)

    def tapped() -> Any:
        loader = owner()
        assert loader is not None  # called through it
        pending = vars(loader).get(_PENDING)
        if isinstance(pending, _Pending) and pending.ended:
            del vars(loader)[_PENDING]  # the saved pass ends here; the next iter() starts the next one
            return iter(())
        resuming = _RESUME_PLAN in vars(loader)
        shard = vars(loader).get(_SHARD)
        prepared = shard() if shard is not None else None
        if resuming and prepared is not None and _finished_pass_replayed_by_workers(loader):
            # The restore replays the saved pass, which had ended, and the workers' fetch-ahead runs
            # a sampler that counts its own epochs past its end: it counts the epoch the
            # uninterrupted run counted already, and the next pass, whose order the workers draw as
            # its iterator is made (before the epoch is put back below), took the epoch after it.
            # Counted back first, the replay brings it to the wrapper's epoch.
            _set_self_counting_epochs(loader, prepared.iteration - 1)
        tap = _Tap(loader, type(loader).__iter__(loader))
        vars(loader)[_TAP] = weakref.ref(tap)
        if resuming and prepared is not None:
            # The restore replayed the saved pass's order up to its position; a sampler that counts
            # its own epochs at a pass's end (Accelerate's SeedableRandomSampler) counted that
            # replay as a pass when it was the last batch's: the wrapper's epoch is put back before
            # the new pass draws its order (at its first batch), as the uninterrupted run had it.
            prepared.set_epoch(prepared.iteration)
        return tap

    return tapped


def _finished_pass_replayed_by_workers(loader: Any) -> bool:
    """The loader's restored state is of a pass that had ended, and workers fetch ahead."""
    plan = vars(loader).get(_RESUME_PLAN)
    restored = plan.get("restored") if isinstance(plan, dict) else None
    return (getattr(loader, "num_workers", 0) > 0 and isinstance(restored, Mapping)
            and restored.get("_iterator_finished") is True)


def _set_self_counting_epochs(inner: Any, epoch: int) -> None:
    """The epoch of every sampler in the loader that counts its own (Accelerate's SeedableRandomSampler)."""
    if epoch < 0:
        return
    for sampler in _samplers_within(inner):
        if has_class_named(sampler, "SeedableRandomSampler", *ACCELERATE_MODULES):
            sampler.epoch = epoch


def _samplers_within(inner: Any) -> list[Any]:
    found: list[Any] = []
    pending: list[Any] = [getattr(inner, "batch_sampler", None), getattr(inner, "sampler", None)]
    seen: set[int] = set()
    while pending:
        sampler = pending.pop()
        if sampler is None or id(sampler) in seen or len(seen) > 8:
            continue
        seen.add(id(sampler))
        found.append(sampler)
        pending += [getattr(sampler, "batch_sampler", None), getattr(sampler, "sampler", None)]
    return found


def next_pass_starts_afresh(prepared: Any) -> None:
    """For a loop that never lets a pass end by asking for a batch past its last (the Hugging Face
    Trainer takes a counted number of batches each epoch, then calls set_epoch and iter() again):
    a restore from a save at a pass's last batch starts the next pass at once, instead of ending
    the saved one first (which such a loop takes for an empty epoch)."""
    if not is_prepared_loader(prepared):
        return
    inner = prepared.base_dataloader
    pending = vars(inner).get(_PENDING)
    if isinstance(pending, _Pending) and pending.ended:
        # The saved pass is over: the next one starts as the uninterrupted run's did, from a new
        # iterator (its base seed drawn from the streams as restored), not from the ended pass's
        # position (with workers, resuming that position first seeded the new pass otherwise)
        del vars(inner)[_PENDING]
        vars(inner).pop(_RESUME_PLAN, None)
        inner.next_iter_state, inner._iterator = None, None


def _make_seedable_generators(inner: Any) -> None:
    """Accelerate's SeedableRandomSampler (the Trainer's default) makes its generator at its first
    pass, seeded from its initial seed (and reseeded at every pass): made now, as that pass would,
    so that a load finds the stream its saved epoch start names (it found none, and refused)."""
    import torch

    for sampler in _samplers_within(inner):
        if has_class_named(sampler, "SeedableRandomSampler", *ACCELERATE_MODULES) and sampler.generator is None:
            sampler.generator = torch.Generator(device=torch.get_default_device())
            sampler.generator.manual_seed(sampler.initial_seed)


def _tap_of(inner: Any) -> _Tap | None:
    """The tap over the inner loader's current iterator, if the wrapper still holds it."""
    ref = vars(inner).get(_TAP)
    tap = ref() if ref is not None else None
    return tap if tap is not None and tap.iterator is getattr(inner, "_iterator", None) else None


def _mid_pass(inner: Any) -> bool:
    iterator = getattr(inner, "_iterator", None)
    yielded = getattr(iterator, "_num_yielded", 0)
    return iterator is not None and not getattr(iterator, "_finished", True) and isinstance(yielded, int) \
        and yielded > 0 and not getattr(inner, "_initial_iter_for_state_dict", False)


def _inner(entry: Entry) -> Entry:
    return replace(entry, target=entry.target.base_dataloader)


def plain_batch(batch: Any) -> Any:
    """A held batch as a checkpoint stores it: mappings (Hugging Face's BatchEncoding) as dicts."""
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        return {k: plain_batch(v) for k, v in batch.items()}
    if isinstance(batch, dict):
        return {k: plain_batch(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and type(batch) in (list, tuple):
        return type(batch)(plain_batch(v) for v in batch)
    return batch

