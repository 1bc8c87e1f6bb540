"""A single background writer: at most one save in flight.

The thread only writes to storage; it never calls a collective (a background thread calling a
collective on the training process group can deadlock or interleave with the training loop's
own collectives). Its outcome is shared with the other ranks by the main thread, at the next
save/wait/close.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Any, Callable

log = logging.getLogger("distckpt")


class AsyncWriter:
    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._result: Any = None
        self.description = ""

    @property
    def busy(self) -> bool:
        return self._thread is not None

    @property
    def finished(self) -> bool:
        """A submitted job has ended and waits to be collected by wait()."""
        return self._thread is not None and not self._thread.is_alive()

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
        _register_exit_wait(self)

    def wait(self) -> tuple[Any, BaseException | None]:
        """Join the save in flight (if any); returns (result, error)."""
        if self._thread is None:
            return None, None
        self._thread.join()
        self._thread = None
        return self._result, self._error


# Writers with a save in flight, finished at interpreter exit: a script that ends without
# close() must not lose its last save silently (the thread is a daemon, so that a hung storage
# call cannot keep a finished job alive forever; it is joined here instead, bounded).
_IN_FLIGHT: "weakref.WeakSet[AsyncWriter]" = weakref.WeakSet()
EXIT_WAIT_S = 600.0


_registered = False


def _register_exit_wait(writer: AsyncWriter) -> None:
    """Finish in-flight saves at exit, before the thread pools the write uses shut down.

    `atexit` handlers run too late: concurrent.futures refuses new work from the threading
    module's own exit hook on ("cannot schedule new futures after interpreter shutdown", which
    is how the write failed at exit when this used `atexit`). Hooks registered there run newest
    first, so registering after concurrent.futures is imported runs this one before it.
    """
    global _registered
    _IN_FLIGHT.add(writer)
    if _registered:
        return
    import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours)

    register = getattr(threading, "_register_atexit", atexit.register)
    register(_finish_at_exit)
    _registered = True


def _finish_at_exit() -> None:
    for writer in list(_IN_FLIGHT):
        thread = writer._thread
        if thread is None:
            continue
        log.warning("distckpt: the process is exiting with the background save of %s in flight and "
                    "without CheckpointManager.close(); finishing it now (call close() at the end of "
                    "training: it also reports the outcome to every rank)", writer.description)
        thread.join(EXIT_WAIT_S)
        if thread.is_alive():
            log.error("distckpt: the background save of %s did not finish within %.0f s of exit; it is "
                      "NOT committed", writer.description, EXIT_WAIT_S)
        elif writer._error is not None:
            log.error("distckpt: the background save of %s FAILED at exit and is not committed: %s: %s",
                      writer.description, type(writer._error).__name__, writer._error)
        else:
            log.warning("distckpt: the background save of %s finished at exit", writer.description)
        writer._thread = None
