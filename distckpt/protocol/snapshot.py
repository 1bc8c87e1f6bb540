"""The overlapped snapshot (overlap_snapshot=True): an async save's copy of parameters and
optimizer state runs on the writer thread while the training thread goes on.

Which copies may wait: those of the tensors an optimizer in `state` owns (its parameters and
their state), which change only in its step, and every such step waits for the copy (a step
pre-hook). Everything else is copied before save() returns.

Whether anything else changed them meanwhile is told by each tensor's version counter, read on
the training thread — in the next optimizer step's pre-hook, or the next manager call, or at
exit — never on the writer thread: torch bumps the counter when an in-place operation ends, so a
check made while one is still running (on the training thread) would pass over torn values. The
writer commits only after that check; if no such point comes within the manager's timeout (no
optimizer step, no manager call), it checks itself.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch
from torch import nn

from distckpt.io.staging import StagingPool, region_key
from distckpt.runtime.interrupts import Gate
from distckpt.state.capture import SHARDED, Entry, unwrap_module
from distckpt.state.wrapped_optimizers import stepping_optimizer


class OverlappedSnapshot:
    """One manager's overlapped copies: which tensors may wait, the step hooks, the check."""

    def __init__(self, pool: StagingPool, timeout_s: float) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        # Gates, not threading.Events: a Ctrl-C inside an Event's wait() on the training thread
        # could leave its internal lock held and the writer's set() blocked for good (interrupts.py).
        self._copied = Gate()   # open while no copy is outstanding
        self._checked = Gate()  # open while no check is outstanding
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._hooks: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Any]" = weakref.WeakKeyDictionary()

    # -- the training thread, at save() ----------------------------------------------------

    def prepare(self, entries: list[Entry]) -> None:
        """Before the capture: mark the regions whose copy may wait, hook every optimizer."""
        regions: set[tuple[Any, ...] | None] = set()
        for entry in entries:
            optimizer = entry.target
            if entry.kind_spec.scope == SHARDED or not isinstance(optimizer, torch.optim.Optimizer):
                continue
            self._hook(optimizer)
            for group in optimizer.param_groups:
                for param in group["params"]:
                    regions.add(region_key(param))
                    for value in optimizer.state.get(param, {}).values():
                        if isinstance(value, torch.Tensor):
                            regions.add(region_key(value))
        regions -= _changed_by_forward(entries)
        self.pool.deferrable = {region for region in regions if region is not None}

    def started(self) -> None:
        """After the capture, before the writer runs: copies (and a check) are outstanding."""
        self._error = None
        if self.pool.has_deferred:
            self._copied.close()
            self._checked.close()

    def abandon(self) -> None:
        """The save did not reach the writer: nothing is outstanding."""
        self.pool.discard_deferred()
        self._copied.open()
        self._checked.open()

    # -- the writer thread -------------------------------------------------------------------

    def copy_and_wait_for_check(self) -> None:
        """The deferred copies, then the training thread's check (or this thread's own after the
        timeout); raises SnapshotChangedError if a source changed in place."""
        try:
            self.pool.copy_deferred()
        finally:
            self._copied.open()
        if not self._checked.wait(self.timeout_s / 2):  # the other ranks' writers wait up to timeout_s
            self.check()
        if self._error is not None:
            raise self._error

    # -- the training thread, after save() ---------------------------------------------------

    def check(self) -> None:
        """Wait for the copy, then compare every source's version counter with the capture's."""
        self._copied.wait()
        with self._lock:
            if self._checked.is_open():
                return
            try:
                self.pool.verify_deferred()
            except Exception as e:  # the writer raises it: the save fails on every rank
                self._error = e
            self._checked.open()

    def close(self) -> None:
        for handle in list(self._hooks.values()):
            handle.remove()
        self._hooks.clear()

    def _hook(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer in self._hooks:
            return
        # on the optimizer that steps: a wrapper without hooks of its own (Accelerate's) calls it
        self._hooks[optimizer] = stepping_optimizer(optimizer).register_step_pre_hook(
            _step_waits_for(weakref.ref(self)))


def _step_waits_for(snapshot: "weakref.ref[OverlappedSnapshot]") -> Callable[..., None]:
    def before_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        alive = snapshot()
        if alive is not None:
            alive.check()
    return before_step


def _changed_by_forward(entries: list[Entry]) -> set[tuple[Any, ...] | None]:
    """Parameters a forward changes in place: an Embedding's weight with max_norm (renormalised
    rows, and the version counter bumped even when no row changes). Copied before save() returns."""
    out: set[tuple[Any, ...] | None] = set()
    for entry in entries:
        if isinstance(entry.target, nn.Module):
            for module in unwrap_module(entry.target).modules():
                if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
                    out.add(region_key(module.weight))
    return out
