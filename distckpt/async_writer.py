"""A single background writer: at most one save in flight.

The thread only writes to storage; it never calls a collective (a background thread calling a
collective on the training process group can deadlock or interleave with the training loop's
own collectives). Its outcome is shared with the other ranks by the main thread, at the next
save/wait/close.
"""

from __future__ import annotations

import threading
from typing import Any, Callable


class AsyncWriter:
    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._result: Any = None
        self.description = ""

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def submit(self, fn: Callable[[], Any], description: str) -> None:
        if self._thread is not None:
            raise RuntimeError("a background save is already in flight; call wait() first")
        self._error, self._result, self.description = None, None, description

        def run() -> None:
            try:
                self._result = fn()
            except BaseException as e:  # handed to the main thread by wait()
                self._error = e

        self._thread = threading.Thread(target=run, name="distckpt-writer", daemon=True)
        self._thread.start()

    def wait(self) -> tuple[Any, BaseException | None]:
        """Join the save in flight (if any); returns (result, error)."""
        if self._thread is None:
            return None, None
        self._thread.join()
        self._thread = None
        return self._result, self._error
