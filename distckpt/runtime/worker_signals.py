"""Loader workers and pre-emption notices: a worker forked from a rank that records pre-emption
signals (runtime/preemption.py) outlives a notice the rank got too, and ends with the rank."""

from __future__ import annotations

import os
import signal
from typing import Any

from torch.utils.data import get_worker_info

# Pre-emption signals a manager of this process records (preemption.py), with the recording
# process: a DataLoader worker forked from it inherits this table.
_PREEMPTION_SIGNALS: dict[int, int] = {}
_SHIELDED_IN: list[int] = []  # the worker process that already handles them
# One page shared with the workers forked after it exists (MAP_SHARED, anonymous): what the rank
# knows when a worker gets one of those signals. Byte _PREEMPTED: the rank recorded a pre-emption
# notice (it will save at the next step boundary and needs its workers until then). Byte _EXITING:
# the rank is exiting (multiprocessing's exit hook terminates daemonic workers, then joins them
# with no deadline: a worker that ignored that SIGTERM hung the rank's exit forever).
_RANK_NEWS: list[Any] = []
_PREEMPTED, _EXITING = 0, 1
# How long a worker signalled by neither waits for the rank's news: the rank's handler runs at the
# main thread's next bytecode, after the C call it may be in (a backward pass) returns.
WORKER_NOTICE_WAIT_S = 5.0


def note_preemption_signals(signals: tuple[int, ...]) -> None:
    for sig in signals:
        _PREEMPTION_SIGNALS[sig] = os.getpid()
    if signals and not _RANK_NEWS:
        import atexit
        import mmap

        _RANK_NEWS.append(mmap.mmap(-1, mmap.PAGESIZE))  # anonymous mappings are MAP_SHARED
        # atexit runs its hooks newest first: registered after multiprocessing's (torch imports
        # it), this one runs before that hook terminates and joins the workers.
        atexit.register(_tell_workers, _EXITING)


def note_preempted() -> None:
    """The rank recorded a pre-emption notice: its workers keep serving until it saves."""
    _tell_workers(_PREEMPTED)


def _tell_workers(which: int) -> None:
    if _RANK_NEWS and _recorder() == os.getpid():
        _RANK_NEWS[0][which] = 1


def _recorder() -> int | None:
    return next(iter(_PREEMPTION_SIGNALS.values()), None)


def shield_from_preemption() -> None:
    """In a loader worker of a rank that records pre-emption signals: outlive a notice the rank
    got too. torchrun and Kubernetes signal the rank's whole process group, and torch's worker
    handler ends a worker at SIGTERM: the rank's next batch raised "DataLoader worker is killed
    by signal: Terminated" before the step boundary where the pre-emption save runs (3 of 4
    two-worker runs). Any other such signal (the rank's exit terminating its workers, a kill of
    the worker alone) keeps its default effect. A worker that outlives the notice ends with the
    rank (the loader's watchdog sees its parent gone)."""
    pid = os.getpid()
    if _SHIELDED_IN == [pid] or not _PREEMPTION_SIGNALS or not _RANK_NEWS or get_worker_info() is None:
        return
    _SHIELDED_IN[:] = [pid]
    for sig, recorder in _PREEMPTION_SIGNALS.items():
        if recorder != pid:
            try:
                signal.signal(sig, _on_signal)
            except ValueError:  # not the worker's main thread: nothing to do from here
                pass


def preemption_safe_worker_init(worker_id: int) -> None:
    """A DataLoader `worker_init_fn` for datasets not wrapped with `with_worker_rng`: the worker
    outlives a pre-emption notice its rank got too, as wrapped datasets' workers do."""
    shield_from_preemption()


def _on_signal(signum: int, frame: Any) -> None:
    """A worker's pre-emption signal: go on if the rank recorded a notice (now, or within
    WORKER_NOTICE_WAIT_S: both got it from one kill of the process group); end quietly if the
    rank is exiting (its exit terminates its workers: torch's own handler ends a worker its
    parent signalled with status 0, or the rank's exit printed "DataLoader worker ... is killed
    by signal"); end as the signal's default would if the rank is gone or never got a notice."""
    import time

    news, deadline = _RANK_NEWS[0], time.monotonic() + WORKER_NOTICE_WAIT_S
    while not news[_EXITING] and os.getppid() == _recorder() and time.monotonic() < deadline:
        if news[_PREEMPTED]:
            return
        time.sleep(0.005)
    if news[_EXITING] and os.getppid() == _recorder():
        os._exit(0)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
