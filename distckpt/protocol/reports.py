"""Reports: a rank's small result posted where the others (rank 0) collect it, outside the
process group's collectives: the save's per-rank file reports travel through the default
group's key-value store (StoreReports), which also publishes each rank's process identity so a
peer that died is named instead of waited for until the timeout (liveness.py)."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from typing import Any, Protocol

from distckpt.errors import CoordinationError
from distckpt.protocol.liveness import ProcessIdentity

log = logging.getLogger("distckpt")


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
    reads them and deletes them. The wait polls instead of blocking in the store: a signal
    (SIGTERM, Ctrl-C) is handled meanwhile, and a peer whose process is gone (liveness.py) fails
    the wait at once, named, instead of after the whole timeout.
    """

    POLL_MAX_S = 0.05      # the longest pause between two looks at the keys
    LIVENESS_EVERY_S = 0.5  # how often the peers that have not reported are looked at

    def __init__(self, store: Any, timeout_s: float, rank: int | None = None) -> None:
        self._store = store
        self.timeout_s = timeout_s
        self._peers: dict[int, ProcessIdentity] = {}
        self._here = ProcessIdentity.current()
        if rank is not None and self._here is not None:
            try:
                self._store.set(_identity_key(rank), json.dumps(self._here.to_json()))
            except Exception as e:  # noqa: BLE001  (without it, a dead peer is found at the timeout)
                log.debug("publishing this rank's process identity failed: %s", e)

    def post(self, key: str, value: dict[str, Any]) -> None:
        self._store.set(key, json.dumps(value))

    def collect(self, keys: list[str], phase: str) -> list[dict[str, Any]]:
        self._wait(keys, phase)
        out = [json.loads(self._store.get(k)) for k in keys]
        for k in keys:
            try:
                self._store.delete_key(k)
            except Exception as e:  # a few stale bytes in the store; nothing depends on them
                log.debug("deleting report %s failed: %s", k, e)
        return out

    def _wait(self, keys: list[str], phase: str) -> None:
        started = time.monotonic()
        pause, looked = 0.001, started
        while True:
            try:
                if self._store.check(keys):
                    return
            except Exception as e:  # the store's host is gone
                raise CoordinationError(f"{phase}: the key-value store stopped answering ({type(e).__name__}: {e}); "
                                        "the job's launcher or rank 0 has probably died") from e
            now = time.monotonic()
            if now - started >= self.timeout_s:
                raise CoordinationError(
                    f"{phase}: no report under {self._missing(keys)[:4]} within the {self.timeout_s:g}s timeout; "
                    "a rank has probably died or stopped before its files were durable; see its log")
            if now - looked >= self.LIVENESS_EVERY_S:
                looked = now
                self._raise_if_a_peer_died(keys, phase, now - started)
            time.sleep(min(pause, max(0.0, self.timeout_s - (now - started))))
            pause = min(pause * 2, self.POLL_MAX_S)

    def _missing(self, keys: list[str]) -> list[str]:
        try:
            return [k for k in keys if not self._store.check([k])]
        except Exception:  # noqa: BLE001
            return keys

    def _raise_if_a_peer_died(self, keys: list[str], phase: str, waited_s: float) -> None:
        for key in self._missing(keys):
            match = _RANK_OF_KEY.search(key)
            rank = int(match.group(1)) if match else None
            peer = self._peer(rank) if rank is not None else None
            if peer is not None and peer.is_gone(self._here):
                raise CoordinationError(
                    f"{phase}: rank {rank} (pid {peer.pid} on this machine) ended before it reported "
                    f"its files (after {waited_s:.1f}s of waiting for it): it was killed or crashed; see its log. "
                    "This save is not committed; the previous checkpoint is intact")

    def _peer(self, rank: int) -> ProcessIdentity | None:
        if rank not in self._peers:
            try:
                if not self._store.check([_identity_key(rank)]):
                    return None
                peer = ProcessIdentity.from_json(json.loads(self._store.get(_identity_key(rank))))
            except Exception:  # noqa: BLE001  (an unreadable identity: that peer is not judged)
                return None
            if peer is None:
                return None
            self._peers[rank] = peer
        return self._peers[rank]


_RANK_OF_KEY = re.compile(r"rank-(\d+)$")


def _identity_key(rank: int) -> str:
    return f"distckpt/process/rank-{rank}"
