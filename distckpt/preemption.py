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
from typing import Any

from .workers import note_preempted, note_preemption_signals

log = logging.getLogger("distckpt")

EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM: 143


class PreemptionFlag:
    """Records pre-emption signals; installs itself only where the handler is still the default."""

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.armed = False  # set once the loop asks; until then a signal keeps its default effect
        self.received_at: float | None = None
        self.signal: int | None = None
        self._installed: dict[int, Any] = {}
        self._pid = os.getpid()  # a forked child (a DataLoader worker) inherits the handler
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be set from the main thread
        for sig in signals:
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                self._installed[sig] = signal.signal(sig, self._record)
        note_preemption_signals(tuple(self._installed))  # loader workers forked from here outlive them

    def _record(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:  # a forked child: the signal's default effect, not the rank's flag
            self.uninstall()
            os.kill(os.getpid(), signum)
            return
        if not self.armed:
            # Nobody will ask at a step boundary: behave as if no handler had been installed.
            self.uninstall()
            os.kill(os.getpid(), signum)
            return
        if self.received_at is None:
            note_preempted()  # before anything else: the loader workers got it too, and wait for this
            self.received_at, self.signal = time.monotonic(), signum
            log.warning("received %s: a checkpoint will be saved at the next step boundary", signal_name(signum))

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    def uninstall(self) -> None:
        for sig, previous in self._installed.items():
            if signal.getsignal(sig) == self._record:
                signal.signal(sig, previous)
        self._installed.clear()


def signal_name(signum: int) -> str:
    """SIGTERM, or SIGRTMIN+2 for a real-time signal (which has no `signal.Signals` member)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIGRTMIN+{signum - signal.SIGRTMIN}" if signal.SIGRTMIN <= signum <= signal.SIGRTMAX else str(signum)
