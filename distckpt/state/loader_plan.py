"""A loader's iterators across a save and a restore.

Every iterator of a loader the manager has seen is made through a recorder (`watch`), which
records the random streams as its epoch starts (epoch_record.py). A restore plans the next
iterator (`plan_resume`): made from the saved epoch start (replay.py), checked against the
samplers' epochs, and, when the loop had dropped the save's iterator, followed by a new pass as
the uninterrupted run's was. A save of a loader restored and not iterated since holds what was
restored (`restored_untouched`).

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, NamedTuple

from distckpt.errors import warn
from distckpt.state.capture import CheckpointWarning
from distckpt.state.epoch_record import (
    check_epochs,
    is_stateful_dataloader,
    record,
    sampler_epochs,
    sampling_streams,
    states,
)
from distckpt.state.loader_hazards import is_hf_iterable, note_a_fabric_wrapper
from distckpt.state.replay import resumed_iterator

DROPPED_KEY = "_distckpt_iterator_dropped"  # the loop had dropped the save's iterator mid-pass
_PLAN = "_distckpt_resume_plan"            # on a loader: what its next iterator is created with
_RESUMED = "_distckpt_resumed_iterator"     # on a loader: its iterator that took the restored position



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
        note_a_fabric_wrapper(loader)
        pending = vars(loader).get(_PLAN)
        if pending is not None:  # checked before the plan is taken: a caught refusal leaves it for the next try
            check_epochs(loader, pending.get("epochs"), pending.get("where", "the loader"))
        plan = vars(loader).pop(_PLAN, None)
        if plan is None:
            _forget_a_restored_position(loader)
            start, epochs = states(sampling_streams(loader)), sampler_epochs(loader)
            iterator = create()
        else:
            epochs = sampler_epochs(loader)  # as restored: the order the resumed pass goes on in
            start, iterator = resumed_iterator(loader, plan, create)
            if plan.get("dropped"):
                return _anew_after_a_dropped_iterator(loader, iterator, start, create)
            vars(loader)[_RESUMED] = (weakref.ref(iterator), getattr(iterator, "_num_yielded", None))
        record(iterator, start, epochs)
        return iterator


def _forget_a_restored_position(loader: Any) -> None:
    """A pass after the resumed one starts at its beginning, as the uninterrupted run's did. A
    Hugging Face IterableDataset keeps the position it was loaded with and applies it to every
    pass while its epoch is the saved one: a loop that never calls its set_epoch (no shuffle)
    started every later pass at the saved position, silently (items 0..11 of 22 never came
    again). The loaded position has served the resumed pass; it is dropped here."""
    dataset = getattr(loader, "dataset", None)
    for candidate in (dataset, *list(getattr(dataset, "__dict__", {}).values())):  # with_worker_rng wraps it
        if is_hf_iterable(candidate) and getattr(candidate, "_starting_state_dict", None) is not None:
            candidate._starting_state_dict = None


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
    warn(message, CheckpointWarning)


def _anew_after_a_dropped_iterator(loader: Any, restored: Any, start: Any, create: Callable[[], Any]) -> Any:
    """The loop had dropped the save's iterator (`next(iter(val_loader))`): the iter() after it
    started a new pass, not the dropped one's rest. So the restored iterator (its sampler's and
    dataset's states applied, every stream where the save left it) stands for the dropped one,
    and this iter() does what the uninterrupted run's did: persistent workers start the next pass
    on it by _reset; otherwise a new iterator is made."""
    record(restored, start)
    if getattr(loader, "persistent_workers", False) and getattr(loader, "num_workers", 0) > 0:
        restored._reset(loader)  # the recorder: this pass's start is recorded
        return restored
    del restored  # its workers end with it, as the dropped iterator's did
    _forget_a_restored_position(loader)  # the new pass starts at its beginning
    start = states(sampling_streams(loader))  # before create(), which draws the base seed (as above)
    epochs = sampler_epochs(loader)
    iterator = create()
    record(iterator, start, epochs)
    return iterator


def dropped(loader: Any) -> bool:
    """Whether the loader's current iterator is held by nothing but the loader, mid-pass: the loop
    dropped it (`next(iter(val_loader))`), so its next iter() starts a new pass, which a resume
    must do too. Call first in a capture (before state_dict(), before any local holds it)."""
    if getattr(loader, "_iterator", None) is None or getattr(loader, "_initial_iter_for_state_dict", False) \
            or getattr(loader._iterator, "_finished", True):
        return False
    return sys.getrefcount(loader._iterator) <= 2  # the loader's attribute and the call's argument


def watch(loader: Any) -> None:
    """Record the streams at each of `loader`'s epoch starts from now on (once per loader)."""
    current = vars(loader).get("_get_iterator")
    if isinstance(current, _IteratorRecorder):
        return
    loader._get_iterator = _IteratorRecorder(loader, current)


# -- save and restore -------------------------------------------------------------------------

def make_first_iterator(loader: Any) -> None:
    """Have a torchdata loader that was never iterated make its first iterator now, before a save
    records the random streams. Its state_dict() makes it anyway, and making it draws a base seed
    (from the loader's generator or torch's global stream): drawn after the streams were recorded,
    the uninterrupted run was a draw ahead of every resume (a validation loader saved before its
    first pass; every later torch.rand differed, silently). Drawn before, the checkpoint holds the
    streams after the draw and the iterator that drew, as for a loader saved mid-pass; the loop's
    first iter() takes that iterator (torchdata's own rule)."""
    if not is_stateful_dataloader(loader) or "_iterator" not in vars(loader) or loader._iterator is not None \
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


def forget_plan(loader: Any) -> None:
    """Drop a resume plan an earlier restore left for the next iterator (an elastic restore
    starts a fresh pass of its own instead)."""
    vars(loader).pop(_PLAN, None)


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
