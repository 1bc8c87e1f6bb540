"""Coordination between ranks: bounded object collectives, and one outcome for all ranks.

Object collectives (a gather to rank 0, a broadcast back, each sized to its content) run on a dedicated gloo
group (so jobs whose default group is NCCL work too), created with the manager's timeout, so a
dead or stopped peer turns into an error, never a hang. Every phase ends in :func:`agree`: each
rank contributes an :class:`Outcome`, all ranks see all outcomes, and if any rank failed every
rank raises the same error.

This module never imports storage.
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import socket
import time
import traceback
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional, Protocol, TypeVar

from distckpt import errors
from distckpt.errors import CoordinationError, DistCkptError, RankDisagreementError
from distckpt.protocol.reports import LocalReports, Reports, StoreReports

log = logging.getLogger("distckpt")


class Coordinator(Protocol):
    rank: int
    world_size: int
    reports: "Reports"

    def all_gather(self, obj: Any, phase: str) -> list[Any]: ...

    def gather(self, obj: Any, phase: str) -> list[Any] | None: ...

    def broadcast(self, obj: Any, phase: str) -> Any: ...

    def decided(self, obj: Any, phase: str, decide: Callable[[list[Any]], Any]) -> Any: ...

    def exchange_bytes(self, sends: dict[int, list[Any]], receives: dict[int, list[Any]], phase: str) -> None: ...

    def check_usable(self) -> None: ...

    def distrust(self, reason: str) -> None: ...

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

    def decided(self, obj: Any, phase: str, decide: Callable[[list[Any]], Any]) -> Any:
        return decide([obj])

    def exchange_bytes(self, sends: dict[int, list[Any]], receives: dict[int, list[Any]], phase: str) -> None:
        if sends or receives:
            raise CoordinationError(f"{phase}: a world of one has no other rank to exchange bytes with")

    def check_usable(self) -> None:
        pass

    def distrust(self, reason: str) -> None:
        pass

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
        try:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        except Exception as e:  # the store's wait timeout, or gloo's connect refused by a peer that gave up
            reason = str(e).splitlines()[0] if str(e) else ""
            raise CoordinationError(
                f"rank {self.rank}: creating distckpt's gloo group failed ({type(e).__name__}: {reason[:300]}). "
                f"Every rank must create its CheckpointManager, in the same order, within the timeout "
                f"({timeout_s:g}s); another rank has probably not reached it yet, died, or gave up first. "
                "Raise timeout= if ranks reach it far apart") from e
        self.reports = StoreReports(dist.distributed_c10d._get_default_store(), timeout_s, self.rank)
        self.broken: str | None = None  # the first failed collective: gloo closes its pairs after one
        self.running = 0  # collectives in progress (an exit hook does not destroy the group under one)
        # how many exchanges each phase made (its name up to " step"): what a save or a load costs
        # in rounds is asserted by tests and shown by bench/protocol_scaling.py --exchanges
        self.exchanges: collections.Counter[str] = collections.Counter()
        self._pid = os.getpid()
        _OPEN_GROUPS.add(self)

    def check_usable(self) -> None:
        """Raise if a collective of this group failed before: after a timeout gloo closes the
        group's connections, and an exchange that half-works could let one rank commit what
        another was told had failed; every later call fails here instead, at once, saying why."""
        if self.broken is not None:
            raise CoordinationError(
                f"rank {self.rank}: this CheckpointManager's process group failed earlier ({self.broken}) "
                "and cannot be trusted for another exchange; the job should restart (torchrun does) or "
                "create a new CheckpointManager; committed checkpoints are unaffected")

    def distrust(self, reason: str) -> None:
        """No exchange goes through this group again (`reason` is said by every later call):
        the peers gave up on an exchange this rank has not finished."""
        if self.broken is None:
            self.broken = reason

    def _run(self, phase: str, fn: Any) -> Any:
        self.check_usable()
        self.exchanges[phase.split(" step ")[0]] += 1
        started = time.monotonic()
        self.running += 1
        try:
            return fn()
        except Exception as e:  # gloo reports peers' deaths and timeouts as RuntimeError
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.broken = f"collective {phase!r}: {reason}"
            elapsed = time.monotonic() - started
            when = (f"after {elapsed:.1f}s (the timeout is {self.timeout_s:g}s)" if elapsed < 0.9 * self.timeout_s
                    else f"at the {self.timeout_s:g}s timeout")
            raise CoordinationError(
                f"rank {self.rank}: collective {phase!r} failed {when}: {reason}. Another rank has probably "
                "died, stopped, is slower than the timeout, or is not calling the same distckpt method; "
                "see its log") from e
        except BaseException as e:
            # Ctrl-C (or SystemExit) inside the exchange: this rank left it part-way, and its next
            # exchange would pair with the other ranks' rest of this one (an independent check saw
            # raw KeyErrors on both ranks); nothing more goes through this group.
            self.broken = f"collective {phase!r}: interrupted ({type(e).__name__})"
            raise
        finally:
            self.running -= 1

    def all_gather(self, obj: Any, phase: str) -> list[Any]:
        # A gather to rank 0 and a broadcast back: 3-4 ms at 8 ranks on 2 CPUs, against 28 ms
        # for all_gather_object (two all-gathers: the sizes, then the padded bytes)
        # (bench/profile_coordination.py).
        # Each object travels with its phase: ranks in different calls (one saving while another
        # loads) got raw TypeErrors from each other's objects; now a RankDisagreementError on each.
        # The answer goes back in a message of world_size inline parts (the gathered ones), the
        # rest (a rank's traceback) in one more broadcast of its exact size.
        tagged = self._run(phase, lambda: self._broadcast_object(self._gather_objects([phase, obj])))
        return _untagged(tagged, phase)

    def gather(self, obj: Any, phase: str) -> list[Any] | None:
        tagged = self._run(phase, lambda: self._gather_objects([phase, obj]))
        return None if tagged is None else _untagged(tagged, phase)

    def broadcast(self, obj: Any, phase: str) -> Any:
        tagged = self._run(phase, lambda: self._broadcast_object([phase, obj] if self.rank == 0 else None, SLOT_BYTES))
        return _untagged([tagged], phase, root_only=True)[0]

    def decided(self, obj: Any, phase: str, decide: Callable[[list[Any]], Any]) -> Any:
        """Every rank's `obj` to rank 0, which runs `decide` on them (it must not raise) and sends
        its answer back: every rank returns it. One exchange, where an all_gather followed by rank
        0's broadcast of what it made of them took two; and each rank decodes one answer, not
        every rank's message. Shaped as an all_gather on the wire (the same gather, a broadcast of
        the same size), so a rank in another call (all_gather) pairs with it and both raise a
        RankDisagreementError: rank 0 then sends every rank's tagged message back, as all_gather does."""
        def run() -> Any:
            tagged = self._gather_objects([phase, obj])
            if tagged is not None:  # rank 0
                if any(not isinstance(t, list) or len(t) != 2 or t[0] != phase for t in tagged):
                    answer = tagged  # the ranks are in different calls: each raises it below
                else:
                    answer = [[phase, decide([t[1] for t in tagged])]]
                return self._broadcast_object(answer)
            return self._broadcast_object(None)
        return _untagged(self._run(phase, run), phase)[0]

    def all_gather_into(self, outputs: list[Any], tensor: Any, phase: str) -> None:
        """Bytes, not objects: every rank's `tensor` (the same size on every rank) into
        `outputs[rank]` (cooperative loads' ranges of a file)."""
        self._run(phase, lambda: self._dist.all_gather(outputs, tensor, group=self._group))

    def exchange_bytes(self, sends: dict[int, list[Any]], receives: dict[int, list[Any]], phase: str) -> None:
        """Point to point: the buffers of `sends[dst]` to rank dst, and from rank src into the
        writable buffers of `receives[src]` (the same sizes, in the same order, as src sends them).
        Only the ranks named take part (the memory tier's copies: each rank's files to its node's
        and its partner node's leaders, never to every rank). See p2p_rounds for the pairing."""
        self._run(phase, lambda: p2p_rounds(self._dist, self._group, sends, receives))

    def _gather_objects(self, obj: Any) -> list[Any] | None:
        """One gather of SLOT_BYTES per rank (an outcome, a request: ~100-500 bytes); the rest of
        a larger object follows as one message of its exact size to rank 0."""
        import torch

        data = encode_message(obj)
        if self.rank != 0:
            P2P_COUNTS.objects += len(data)
        slot = _packed_slot(data)
        slots = [torch.empty_like(slot) for _ in range(self.world_size)] if self.rank == 0 else None
        self._dist.gather(slot, slots, dst=0, group=self._group)
        if self.rank != 0:
            if len(data) > SLOT_BYTES:
                self._dist.send(_byte_tensor(data), dst=0, group=self._group)
            return None
        assert slots is not None
        out = []
        for rank, got in enumerate(slots):
            size = _slot_length(got)
            if size <= SLOT_BYTES:
                payload = got[_HEADER:_HEADER + size].numpy().tobytes()
            elif rank == 0:
                payload = data
            else:
                big = torch.empty(size, dtype=torch.uint8)
                self._dist.recv(big, src=rank, group=self._group)
                payload = big.numpy().tobytes()
            out.append(decode_message(payload))
        return out

    def _broadcast_object(self, obj: Any, inline: int = 0) -> Any:
        """One broadcast of `inline` bytes (0: world_size x SLOT_BYTES, an all_gather's answer);
        a larger object follows in a second one of its exact size."""
        import torch

        inline = inline or self.world_size * SLOT_BYTES
        data = encode_message(obj) if self.rank == 0 else b""
        P2P_COUNTS.objects += len(data) * (self.world_size - 1)
        slot = _packed_slot(data, inline) if self.rank == 0 else torch.empty(_HEADER + inline, dtype=torch.uint8)
        self._dist.broadcast(slot, src=0, group=self._group)
        size = _slot_length(slot)
        if size > inline:
            big = _byte_tensor(data) if self.rank == 0 else torch.empty(size, dtype=torch.uint8)
            self._dist.broadcast(big, src=0, group=self._group)
            payload = big.numpy().tobytes()
        else:
            payload = slot[_HEADER:_HEADER + size].numpy().tobytes()
        return obj if self.rank == 0 else decode_message(payload)

    def close(self) -> None:
        """Destroy the group and drop the last reference to it, which joins its gloo threads.

        Why the join matters: each collective's work object is released by a gloo thread a moment
        after the caller's wait returns, and its tensors were made in Python, so that release
        takes the GIL. Reached after the interpreter started finalizing, taking the GIL ends the
        thread inside a C++ destructor: "terminate called without an active exception", SIGABRT
        at the exit of about one 2-rank job in 20-40 on 2 CPUs (core dumps showed the thread in
        ``~AsyncBroadcastWork``). ``destroy_process_group`` only shuts the group down; its
        threads are joined when the object dies, which torch does with the GIL released."""
        if os.getpid() != self._pid:
            # a forked child (a DataLoader worker) holds a copy of the group without its threads:
            # destroying it there would join threads that exist only in the parent
            return
        group, self._group = self._group, None
        if group is None:
            return
        if self.broken is None:
            self.broken = "this CheckpointManager was closed"
        _OPEN_GROUPS.discard(self)
        try:
            if group in self._dist.distributed_c10d._world.pg_map:
                self._dist.destroy_process_group(group)
        except Exception as e:  # the default group may already be gone at interpreter exit
            log.debug("destroying the distckpt gloo group failed: %s", e)
        del group  # the last reference: the gloo threads are joined here, not during finalization


_OPEN_GROUPS: weakref.WeakSet[GlooCoordinator] = weakref.WeakSet()


@atexit.register
def _close_open_groups() -> None:
    """At interpreter exit (atexit runs before finalization), close the groups of managers never
    closed, so their gloo threads are joined while they can still take the GIL (see
    GlooCoordinator.close). A group with a collective still running (a daemon thread's save) is
    left alone: destroying it would wait for that collective's timeout."""
    for coord in list(_OPEN_GROUPS):
        if coord.running == 0:
            coord.close()


P2P_CHUNK_BYTES = 64 << 20  # one message of a point-to-point exchange: its extra memory per peer


@dataclass
class ByteCounts:
    """This process's bytes sent and received through its groups (the tests check who moved how
    much): point to point by peer rank, and the object collectives' messages it sent."""

    sent: dict[int, int] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)
    objects: int = 0

    def reset(self) -> None:
        self.sent, self.received, self.objects = {}, {}, 0


P2P_COUNTS = ByteCounts()


def p2p_rounds(dist: Any, group: Any, sends: dict[int, list[Any]], receives: dict[int, list[Any]]) -> None:
    """Rounds of isend/irecv: in round k every rank posts the k-th message of each of its streams
    (one stream per peer and direction, its buffers cut into messages of at most P2P_CHUNK_BYTES),
    then waits for all of them. Both sides of a stream cut it alike, so each message posted has
    its match posted in the same round: no order of peers can deadlock (a rank that both sends and
    receives posts both before it waits), and no rank holds more than a message per peer extra."""
    import warnings

    import torch

    outgoing = {dst: _messages(bufs) for dst, bufs in sends.items()}
    incoming = {src: _messages(bufs) for src, bufs in receives.items()}
    rounds = max([len(m) for m in (*outgoing.values(), *incoming.values())], default=0)
    with warnings.catch_warnings():  # a send reads from bytes: torch warns that they are read-only
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for k in range(rounds):
            works = []
            for dst, messages in outgoing.items():
                if k < len(messages):
                    works.append(dist.isend(torch.frombuffer(messages[k], dtype=torch.uint8), dst, group=group))
                    P2P_COUNTS.sent[dst] = P2P_COUNTS.sent.get(dst, 0) + len(messages[k])
            for src, messages in incoming.items():
                if k < len(messages):
                    works.append(dist.irecv(torch.frombuffer(messages[k], dtype=torch.uint8), src, group=group))
                    P2P_COUNTS.received[src] = P2P_COUNTS.received.get(src, 0) + len(messages[k])
            for work in works:
                work.wait()


def _messages(buffers: list[Any]) -> list[memoryview]:
    out: list[memoryview] = []
    for buf in buffers:
        view = memoryview(buf).cast("B")
        out.extend(view[i:i + P2P_CHUNK_BYTES] for i in range(0, len(view), P2P_CHUNK_BYTES))
    return out


def _untagged(tagged: list[Any], phase: str, root_only: bool = False) -> list[Any]:
    """The objects of [phase, object] pairs, once every rank's phase is this rank's."""
    phases = [t[0] if isinstance(t, list) and len(t) == 2 else None for t in tagged]
    if any(p != phase for p in phases):
        who = f"rank 0 is in {phases[0]!r}" if root_only else ", ".join(f"rank {r}: {p!r}" for r, p in enumerate(phases))
        raise RankDisagreementError(
            f"the ranks are in different distckpt calls ({who}; this rank: {phase!r}): every manager method is "
            "collective; call save, load_latest, load, wait and close on every rank in the same order")
    return [t[1] for t in tagged]


# The part of each rank's message that travels in the collective itself: an outcome or a request
# is 100-500 bytes, so nearly every exchange is one gather and one broadcast; a larger message (a
# failure's traceback, rank 0's listing) follows in one more message of its exact size. It was
# 64 KiB: 1 MiB gathered to rank 0 per exchange at 16 ranks, 32 MiB at 512 (docs/design/scaling.md).
SLOT_BYTES = 1 << 10
_HEADER = 8  # the message length, int64


def encode_message(obj: Any) -> bytes:
    """JSON (no pickle between ranks either), with bytes carried after it and Outcomes tagged.

    Layout: the JSON's length (8 bytes, little-endian), the JSON, then the byte strings it
    refers to as {"__bytes__": [start, length]}. Dict keys must be str; tuples arrive as lists.
    """
    blobs: list[bytes] = []
    used = [0]

    def tag(o: Any) -> Any:
        if isinstance(o, (bytes, bytearray, memoryview)):
            blob = bytes(o)
            blobs.append(blob)
            used[0] += len(blob)
            return {"__bytes__": [used[0] - len(blob), len(blob)]}
        if isinstance(o, Outcome):
            return {"__outcome__": [o.rank, o.error_type, o.message, o.info, o.traceback]}
        raise TypeError(f"a coordination message cannot carry {type(o).__name__}")

    text = json.dumps(obj, default=tag).encode()
    return len(text).to_bytes(8, "little") + text + b"".join(blobs)


def decode_message(data: bytes) -> Any:
    size = int.from_bytes(data[:8], "little")
    blobs = memoryview(data)[8 + size:]

    def untag(d: dict[str, Any]) -> Any:
        if "__bytes__" in d:
            start, length = d["__bytes__"]
            return bytes(blobs[start:start + length])
        if "__outcome__" in d:
            rank, error_type, message, info, *trace = d["__outcome__"]
            return Outcome(rank, error_type, message, info, trace[0] if trace else None)
        return d

    return json.loads(data[8:8 + size], object_hook=untag)


def _packed_slot(data: bytes, inline: int = SLOT_BYTES) -> Any:
    """A uint8 tensor of 8 + `inline` bytes: the length of `data`, then `data` if it fits. Made
    in a bytearray (a few torch operations per exchange less, on every rank)."""
    import torch

    slot = bytearray(_HEADER + inline)
    slot[:_HEADER] = len(data).to_bytes(_HEADER, "little")
    if len(data) <= inline:
        slot[_HEADER:_HEADER + len(data)] = data
    return torch.frombuffer(slot, dtype=torch.uint8)


def _slot_length(slot: Any) -> int:
    return int.from_bytes(slot[:_HEADER].numpy().tobytes(), "little")


def _byte_tensor(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def make_coordinator(timeout_s: float) -> Coordinator:
    """A gloo coordinator when a process group is initialised with >1 rank, else a world of one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return GlooCoordinator(timeout_s)  # type: ignore[return-value]  # StoreReports is a Reports
    return SingleProcess()


T = TypeVar("T")


@dataclass
class Outcome:
    """What one rank reports at the end of a phase."""

    rank: int
    error_type: str | None = None
    message: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    traceback: str | None = None  # where it failed on that rank (the last frames)

    @property
    def ok(self) -> bool:
        return self.error_type is None

    @classmethod
    def failure(cls, rank: int, exc: BaseException, info: dict[str, Any] | None = None) -> "Outcome":
        frames = traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-6)
        info = dict(info or {})
        if getattr(exc, "rank_tracebacks", None) is not None or getattr(exc, "names_ranks", False):
            info["names_ranks"] = True  # already the error naming the ranks that failed: passed on as it is
        notes = getattr(exc, "__notes__", None)  # where a user's own error came from (capture_entry)
        message = str(exc) + ("".join(f" ({note})" for note in notes if isinstance(note, str)) if notes else "")
        return cls(rank, type(exc).__name__, message, info, "".join(frames)[-4000:])


# The phase runner. Every collective step of a save or a load is one of four shapes: run on
# every rank or on rank 0 alone, then either raise the same error everywhere (run_*) or hand
# the outcomes to a caller that decides from them (attempt_*: a damaged step falls back, an
# unreadable durable tier is a warning while local steps remain).


Attempt = tuple[Optional[T], Optional[BaseException], list[Outcome]]  # result, exception, every outcome


def attempt_phase(coord: Coordinator, phase: str, fn: Callable[[], T],
                  info: Callable[[Any], dict[str, Any]] | None = None) -> Attempt[T]:
    """Run `fn` on every rank as the phase `phase` and exchange the outcomes, raising nothing:
    (this rank's result or None, its exception or None, every rank's outcome)."""
    try:
        result = fn()
    except Exception as e:  # every rank hears it: none may be left waiting in the exchange
        return None, e, coord.all_gather(Outcome.failure(coord.rank, e), phase)
    except (KeyboardInterrupt, SystemExit) as e:
        # Raised out of user code on this rank (a state_dict(), a Ctrl-C handler): the peers hear
        # it too, then it goes on as it is. Left out of the exchange, they waited in it for the
        # timeout, or paired it with this rank's next call (two steps "disagreeing"; a retried save
        # waited the whole timeout for a report filed under another save's key).
        coord.all_gather(Outcome.failure(coord.rank, e), phase)
        raise
    return result, None, coord.all_gather(Outcome(coord.rank, info=info(result) if info else {}), phase)


def run_phase(coord: Coordinator, phase: str, what: str, fn: Callable[[], T],
              info: Callable[[T], dict[str, Any]] | None = None) -> tuple[T, list[Outcome]]:
    """Run `fn` on this rank as the phase `phase`, then agree: if it failed on any rank, every
    rank raises the same error, naming each failed rank with its traceback (`rank_tracebacks`
    of the raised error); otherwise returns (this rank's result, every rank's outcome)."""
    result, exc, outcomes = attempt_phase(coord, phase, fn, info)
    raise_if_failed(coord, outcomes, what, exc)
    return result, outcomes  # type: ignore[return-value]  # no rank failed: fn returned


def attempt_on_root(coord: Coordinator, phase: str,
                    fn: Callable[[], dict[str, Any]]) -> tuple[Outcome, BaseException | None]:
    """Run `fn` on rank 0 only and broadcast its outcome, raising nothing: (rank 0's outcome, its
    result in `info`, on every rank; rank 0's exception there, None elsewhere)."""
    exc = mine = None
    if coord.rank == 0:
        try:
            mine = Outcome(0, info=fn())
        except Exception as e:  # every rank hears it: none may be left waiting in the broadcast
            exc, mine = e, Outcome.failure(0, e)
    return coord.broadcast(mine, phase), exc


def run_on_root(coord: Coordinator, phase: str, what: str, fn: Callable[[], dict[str, Any]],
                local_exc: BaseException | None = None) -> dict[str, Any]:
    """Run `fn` on rank 0 only and broadcast its outcome: every rank returns rank 0's result (a
    JSON-able dict), or every rank raises the same error if it failed there (chained to
    `local_exc` on a rank that has its own)."""
    outcome, exc = attempt_on_root(coord, phase, fn)
    raise_if_failed(coord, [outcome], what, exc or local_exc)
    return outcome.info


def run_decided(coord: Coordinator, phase: str, what: str, mine: Any,
                fn: Callable[[list[Any]], dict[str, Any]]) -> dict[str, Any]:
    """Every rank's `mine` to rank 0, which runs `fn` on them (a JSON-able dict), and one answer
    back (coord.decided): every rank returns rank 0's result, or every rank raises the same error
    if `fn` raised there. An error that already names the ranks (a refusal, a disagreement: it
    carries `rank_tracebacks`, or `names_ranks`) is raised as rank 0 made it."""
    exc: BaseException | None = None

    def decide(objs: list[Any]) -> Outcome:
        nonlocal exc
        try:
            return Outcome(0, info=fn(objs))
        except Exception as e:  # every rank hears it: none may be left waiting in the broadcast
            exc = e
            return Outcome.failure(0, e)

    outcome = coord.decided(mine, phase, decide)
    raise_if_failed(coord, [outcome], what, exc)
    return outcome.info


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
    raise error_of(failed, what) from local_exc


def error_of(failed: list[Outcome], what: str) -> DistCkptError:
    """The one error for failed outcomes: the class of the first (a distckpt class, else
    CoordinationError), naming every failed rank, with their tracebacks in `rank_tracebacks`."""
    cls = _error_class(failed[0].error_type)
    if len(failed) == 1 and failed[0].info.get("names_ranks"):  # rank 0 sharing who failed: said once
        error = cls(failed[0].message or what)
        error.rank_tracebacks = {failed[0].rank: failed[0].traceback}  # type: ignore[attr-defined]
        return error
    lines = "; ".join(f"rank {o.rank}: {o.error_type}: {o.message}" for o in failed)
    error = cls(f"{what} failed on rank(s) {[o.rank for o in failed]} — {lines}")
    error.rank_tracebacks = {o.rank: o.traceback for o in failed}  # type: ignore[attr-defined]
    return error


def _error_class(name: str | None) -> type[DistCkptError]:
    """The distckpt class a peer raised, so every rank raises the same type; else CoordinationError."""
    cls = getattr(errors, name or "", None)
    if isinstance(cls, type) and issubclass(cls, DistCkptError):
        return cls
    return CoordinationError


def hostname() -> str:
    return socket.gethostname()
