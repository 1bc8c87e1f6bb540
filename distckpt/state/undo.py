"""Undoing a restore that failed part-way, so that a failed load leaves `state` as it was.

Validation (validation.py) catches what can be seen before anything changes. What only an
owner's own `load_state_dict` detects (a scheduler, a scaler, a user's Stateful object) fails
while restoring; then every entry restored before it, on every rank, is put back from the
snapshot taken just before it was restored. Snapshots are cheap by design: references where the
owner replaces its state rather than mutating it (torch optimizers, loaders), small copies where
it mutates (schedulers, generators, samplers, containers). Modules and tensor entries are not
snapshotted (a second copy of a model is what a demanding user cannot afford): they are checked
completely beforehand (keys, shapes, dtypes, submodules) and restored in a second phase, after
every rank restored everything else. A module with load logic of its own (which may refuse) is
restored with the others instead, its tensors copied first (kinds/module.py, `ModuleLike`).

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

import copy
import logging
from collections import defaultdict
from typing import Any, Callable

import torch
from torch import nn

from distckpt.state.capture import Entry, has_own_load_logic

log = logging.getLogger("distckpt")

Undo = Callable[[], None]

def module_undo(module: nn.Module) -> Undo:
    """Modules restored by torch's own code are checked completely before (keys, shapes, dtypes,
    submodules) and cannot fail half-way: nothing to copy. A module with load logic of its own
    (load_state_dict hooks, its own _load_from_state_dict) can; its tensors are copied to host
    memory first and copied back if the load fails."""
    if not has_own_load_logic(module):
        return lambda: None
    return module_copy_aside(module)


def module_copy_aside(module: nn.Module) -> Undo:
    """Copy the module's tensors (to host memory), extra state and training flags aside; the
    undo puts them back."""
    live = module.state_dict(keep_vars=True)
    copies = {k: _local(v).detach().to("cpu", copy=True) for k, v in live.items() if isinstance(v, torch.Tensor)}
    flags = {m: m.training for m in module.modules()}
    trainable = {p: p.requires_grad for p in module.parameters()}
    # Extra state lives outside the tensors: set_extra_state put the checkpoint's back in and
    # nothing put the live one back (a counter kept the checkpoint's value after a failed load).
    extra = {m: copy.deepcopy(m.get_extra_state()) for m in module.modules()
             if type(m).get_extra_state is not nn.Module.get_extra_state}

    def undo() -> None:
        with torch.no_grad():
            for k, v in module.state_dict(keep_vars=True).items():
                if k in copies:
                    _local(v).copy_(copies[k])
        for m, value in extra.items():
            m.set_extra_state(copy.deepcopy(value))
        for m, flag in flags.items():
            m.training = flag
        for p, wanted in trainable.items():
            p.requires_grad_(wanted)
    return undo


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def optimizer_undo(opt: torch.optim.Optimizer) -> Undo:
    # load_state_dict builds new state and group dicts and swaps them in (__setstate__); DCP's
    # set_optimizer_state_dict may first fill an empty state in place, hence the per-param copies.
    attributes = dict(vars(opt))
    per_param = {p: dict(s) for p, s in opt.state.items()}

    def undo() -> None:
        vars(opt).clear()
        vars(opt).update(attributes)
        opt.state = defaultdict(dict, per_param)
    return undo


def value_undo(entry: Entry, state: dict[str, Any]) -> Undo:
    """The live container's contents and the object under its key: the restore refills the live
    container in place or, when the saved one is of another type, puts the saved one there."""
    target, key, before = entry.target, entry.key, state.get(entry.key)
    contents: Undo = lambda: None  # noqa: E731
    if isinstance(target, dict):
        items = list(target.items())
        contents = lambda: replace_dict(target, items)  # noqa: E731
    elif isinstance(target, list):
        elements = list(target)
        contents = lambda: target.__setitem__(slice(None), elements)  # noqa: E731

    def put_back() -> None:
        contents()
        state[key] = before
    return put_back


def replace_dict(target: dict[Any, Any], items: Any) -> None:
    target.clear()
    target.update(items)


def run_undos(undos: list[tuple[str, Undo]], where: str) -> list[str]:
    """Undo in reverse order; returns the keys whose undo itself failed (logged)."""
    failed = []
    for key, undo in reversed(undos):
        try:
            undo()
        except BaseException as e:  # keep undoing the others (a KeyboardInterrupt from an owner's
            # load_state_dict too); the load's own error is raised after
            log.error("%s: putting state[%r] back after the failed load failed too: %s: %s",
                      where, key, type(e).__name__, e)
            failed.append(key)
    return failed

