"""Pre-emption notices (SIGTERM): the handler only records the request.

Cloud spot notices give about 30 s (GCE) to 2 min (AWS); Kubernetes' default grace is 30 s;
torchrun forwards SIGTERM to its workers and kills them 30 s later. Saving inside a signal
handler would run in the middle of a training step, with collectives of its own, so the handler
sets a flag and the training loop asks `CheckpointManager.preemption_requested()` at a step
boundary, where all ranks agree with one collective and save together.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import weakref
from typing import Any

from distckpt.runtime.worker_signals import note_preempted, note_preemption_signals

log = logging.getLogger("distckpt")

EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM: 143


class PreemptionFlag:
    """Records pre-emption signals for one manager. One handler per signal serves every live
    manager's flag (`_dispatch`), installed only where the handler was still the default: the
    signal module held each flag's bound method, so a manager dropped without close() (a
    notebook cell run again, a sweep in one process) kept the handler, and the next manager,
    finding a handler not the default, installed none and never learned of a notice."""

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.armed = False  # set once the loop asks; until then a signal keeps its default effect
        self.received_at: float | None = None
        self.signal: int | None = None
        # Handlers can only be set from the main thread; a manager built in another listens where
        # the main thread's manager installed the handler already.
        in_main = threading.current_thread() is threading.main_thread()
        self._signals: tuple[int, ...] = tuple(sig for sig in signals if _listen(sig, self, install=in_main))
        note_preemption_signals(self._signals)  # loader workers forked from here outlive them

    def record(self, signum: int) -> None:
        if self.received_at is None:
            note_preempted()  # before anything else: the loader workers got it too, and wait for this
            self.received_at, self.signal = time.monotonic(), signum
            log.warning("received %s: a checkpoint will be saved at the next step boundary", signal_name(signum))

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    def uninstall(self) -> None:
        for sig in self._signals:
            _stop_listening(sig, self)
        self._signals = ()


# Per signal: the handler before ours (put back when no flag listens any more) and the flags
# listening, held weakly so that a manager dropped without close() stops listening with it.
_PREVIOUS: dict[int, Any] = {}
_LISTENERS: dict[int, "weakref.WeakSet[PreemptionFlag]"] = {}
_INSTALLED_IN: dict[int, int] = {}  # the pid that installed it: a forked child (a loader worker) inherits it


# Handlers that count as "not the program's own": SIGINT's default raises KeyboardInterrupt, and
# `preemption_signals=("SIGINT",)` is asked for by name.
_DEFAULTS = (signal.SIG_DFL, None, signal.default_int_handler)


def _listen(sig: int, flag: PreemptionFlag, install: bool = True) -> bool:
    current = signal.getsignal(sig)
    if current is _dispatch and _INSTALLED_IN.get(sig) != os.getpid():
        # a forked child: the parent's handler and listeners came with the fork; this process's own
        _LISTENERS[sig] = weakref.WeakSet()
        _INSTALLED_IN[sig] = os.getpid()
    elif current is not _dispatch:
        if current not in _DEFAULTS or not install:
            return False  # the user's own handler (or a framework's) stays in charge
        _PREVIOUS[sig] = current
        _LISTENERS[sig] = weakref.WeakSet()
        _INSTALLED_IN[sig] = os.getpid()
        signal.signal(sig, _dispatch)
    _LISTENERS[sig].add(flag)
    return True


def _stop_listening(sig: int, flag: PreemptionFlag) -> None:
    listeners = _LISTENERS.get(sig)
    if listeners is not None:
        listeners.discard(flag)
    if not listeners and signal.getsignal(sig) is _dispatch \
            and threading.current_thread() is threading.main_thread():
        # (closed from another thread: the handler stays, listening to nobody, which gives the
        # signal its default effect; signal.signal raised there and close() stopped half-way)
        _put_back(sig)


def _put_back(sig: int) -> None:
    signal.signal(sig, _PREVIOUS.pop(sig, signal.SIG_DFL))
    _LISTENERS.pop(sig, None)
    _INSTALLED_IN.pop(sig, None)


def _dispatch(signum: int, frame: Any) -> None:
    armed = [flag for flag in list(_LISTENERS.get(signum, ())) if flag.armed]
    if os.getpid() != _INSTALLED_IN.get(signum) or not armed:
        # A forked child, or nobody will ask at a step boundary: the signal's default effect, as
        # if no handler had been installed.
        _put_back(signum)
        os.kill(os.getpid(), signum)
        return
    for flag in armed:
        flag.record(signum)


def signal_name(signum: int) -> str:
    """SIGTERM, or SIGRTMIN+2 for a real-time signal (which has no `signal.Signals` member)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIGRTMIN+{signum - signal.SIGRTMIN}" if signal.SIGRTMIN <= signum <= signal.SIGRTMAX else str(signum)
