"""Coordination between ranks: bounded object collectives, and one outcome for all ranks.

Object collectives run on a dedicated gloo group (so jobs whose default group is NCCL work
too), created with the manager's timeout, so a dead or stopped peer turns into an error, never
a hang. Every phase ends in :func:`agree`: each rank contributes an :class:`Outcome`, all
ranks see all outcomes, and if any rank failed every rank raises the same error.

This module never imports storage.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from . import errors
from .errors import CoordinationError, DistCkptError

log = logging.getLogger("distckpt")


class Coordinator(Protocol):
    rank: int
    world_size: int
    reports: "Reports"

    def all_gather(self, obj: Any, phase: str) -> list[Any]: ...

    def gather(self, obj: Any, phase: str) -> list[Any] | None: ...

    def broadcast(self, obj: Any, phase: str) -> Any: ...

    def close(self) -> None: ...


class SingleProcess:
    """World of one: no process group (notebooks, scripts)."""

    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self.reports: Reports = LocalReports()

    def all_gather(self, obj: Any, phase: str) -> list[Any]:
        return [obj]

    def gather(self, obj: Any, phase: str) -> list[Any] | None:
        return [obj]

    def broadcast(self, obj: Any, phase: str) -> Any:
        return obj

    def close(self) -> None:
        pass


class GlooCoordinator:
    """Object collectives on a private gloo group bounded by `timeout_s` (call on every rank)."""

    def __init__(self, timeout_s: float) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.timeout_s = timeout_s
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.reports = StoreReports(dist.distributed_c10d._get_default_store(), timeout_s)

    def _run(self, phase: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as e:  # gloo reports peers' deaths and timeouts as RuntimeError
            raise CoordinationError(
                f"rank {self.rank}: collective {phase!r} failed within the {self.timeout_s:g}s "
                f"timeout: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. Another "
                "rank has probably died, stopped, or is not calling the same distckpt method; "
                "see its log") from e

    def all_gather(self, obj: Any, phase: str) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._run(phase, lambda: self._dist.all_gather_object(out, obj, group=self._group))
        return out

    def gather(self, obj: Any, phase: str) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        self._run(phase, lambda: self._dist.gather_object(obj, out, dst=0, group=self._group))
        return out

    def broadcast(self, obj: Any, phase: str) -> Any:
        box = [obj if self.rank == 0 else None]
        self._run(phase, lambda: self._dist.broadcast_object_list(box, src=0, group=self._group))
        return box[0]

    def close(self) -> None:
        try:
            self._dist.destroy_process_group(self._group)
        except Exception as e:  # the default group may already be gone at interpreter exit
            log.debug("destroying the distckpt gloo group failed: %s", e)


class Reports(Protocol):
    """Small JSON reports from any thread, without collectives (background writers use them)."""

    def post(self, key: str, value: dict[str, Any]) -> None: ...

    def collect(self, keys: list[str], phase: str) -> list[dict[str, Any]]: ...


class LocalReports:
    """A world of one: the reports of this process."""

    def __init__(self) -> None:
        self._values: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def post(self, key: str, value: dict[str, Any]) -> None:
        with self._lock:
            self._values[key] = value

    def collect(self, keys: list[str], phase: str) -> list[dict[str, Any]]:
        with self._lock:
            missing = [k for k in keys if k not in self._values]
            if missing:
                raise CoordinationError(f"{phase}: no report under {missing}")
            return [self._values.pop(k) for k in keys]


class StoreReports:
    """Reports through the process group's key-value store (TCPStore under torchrun).

    A background writer must not call a collective (async_writer.py); a store key needs none:
    each rank posts its report, rank 0 waits for every key (bounded by the manager's timeout),
    reads them and deletes them.
    """

    def __init__(self, store: Any, timeout_s: float) -> None:
        self._store = store
        self.timeout_s = timeout_s

    def post(self, key: str, value: dict[str, Any]) -> None:
        self._store.set(key, json.dumps(value))

    def collect(self, keys: list[str], phase: str) -> list[dict[str, Any]]:
        try:
            self._store.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception as e:  # a timeout, or the store's host is gone
            try:
                missing = [k for k in keys if not self._store.check([k])]
            except Exception:
                missing = keys
            raise CoordinationError(
                f"{phase}: no report under {missing[:4]} within the {self.timeout_s:g}s timeout "
                f"({type(e).__name__}); a rank has probably died or stopped before its files were "
                "durable; see its log") from e
        out = [json.loads(self._store.get(k)) for k in keys]
        for k in keys:
            try:
                self._store.delete_key(k)
            except Exception as e:  # a few stale bytes in the store; nothing depends on them
                log.debug("deleting report %s failed: %s", k, e)
        return out


def make_coordinator(timeout_s: float) -> Coordinator:
    """A gloo coordinator when a process group is initialised with >1 rank, else a world of one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return GlooCoordinator(timeout_s)
    return SingleProcess()


@dataclass
class Outcome:
    """What one rank reports at the end of a phase."""

    rank: int
    error_type: str | None = None
    message: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error_type is None

    @classmethod
    def failure(cls, rank: int, exc: BaseException, info: dict[str, Any] | None = None) -> "Outcome":
        return cls(rank, type(exc).__name__, str(exc), dict(info or {}))


def agree(coord: Coordinator, outcome: Outcome, phase: str, what: str,
          local_exc: BaseException | None = None) -> list[Outcome]:
    """Exchange outcomes; if any rank failed, raise the same error on every rank."""
    outcomes = coord.all_gather(outcome, phase)
    raise_if_failed(coord, outcomes, what, local_exc)
    return outcomes


def raise_if_failed(coord: Coordinator, outcomes: list[Outcome], what: str,
                    local_exc: BaseException | None = None) -> None:
    """Raise one error, built the same way on every rank, if any outcome is a failure."""
    failed = [o for o in outcomes if not o.ok]
    if not failed:
        return
    if coord.world_size == 1 and local_exc is not None:
        raise local_exc  # a world of one: the original error, untouched
    lines = "; ".join(f"rank {o.rank}: {o.error_type}: {o.message}" for o in failed)
    cls = _error_class(failed[0].error_type)
    raise cls(f"{what} failed on rank(s) {[o.rank for o in failed]} — {lines}") from local_exc


def _error_class(name: str | None) -> type[DistCkptError]:
    """The distckpt class a peer raised, so every rank raises the same type; else CoordinationError."""
    cls = getattr(errors, name or "", None)
    if isinstance(cls, type) and issubclass(cls, DistCkptError):
        return cls
    return CoordinationError


def hostname() -> str:
    return socket.gethostname()
