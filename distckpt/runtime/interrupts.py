"""Ctrl-C held back while a load changes the live state, and while an async save is handed over.

A KeyboardInterrupt raised between two restored entries left the state half-restored (an
independent check: 354 of 1,590 loads interrupted at random instants, optimizer restored and
model not, or one module half A and half B), and one raised between handing an async save to the
writer and noting it pending left the manager unable to save again. While such a block runs on
the main thread, a SIGINT or SIGTERM is noted and its Python handler (the default SIGINT handler,
which raises KeyboardInterrupt, or the program's own, which may raise anything) runs when the
block ends; exceptions raised by other means (another thread's `PyThreadState_SetAsyncExc`)
still land wherever they land.

And a wait a KeyboardInterrupt cannot wedge (`Gate`): threading.Event and Condition take their
internal lock in Python code, so an interrupt landing between that lock's acquire and the `with`
that releases it leaves it held, and the next set() from another thread blocks forever (Ctrl-C in
an async save's wait() hung the process: 4 of 6 runs of 8 s of random interrupts). And helper
threads fed the same way (`Helpers`), in place of concurrent.futures' pool, which has the hazard too.

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold back SIGINT and SIGTERM while the block runs on the main thread: each one's Python
    handler (Python's default SIGINT handler, which raises KeyboardInterrupt, or one the program
    installed, which may raise anything) runs when the block ends, in the order they arrived.
    A signal whose handler is the OS default (SIGTERM's: the process ends, so nothing is left
    half-done) or ignored is left alone. If the block fails meanwhile, the handlers run then, and
    what they raise has the failure as its cause."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers: dict[int, Any] = {int(sig): h for sig in DEFERRED_SIGNALS if callable(h := signal.getsignal(sig))}
    received: list[tuple[int, Any]] = []

    def note(signum: int, frame: Any) -> None:
        received.append((signum, frame))

    for sig in handlers:
        signal.signal(sig, note)
    try:
        yield
    except BaseException as e:
        _restore(handlers)
        try:
            _run_handlers(handlers, received)
        except BaseException as raised:
            raise raised from e
        raise
    _restore(handlers)
    _run_handlers(handlers, received)  # the block ended as it would have without the signals


def _restore(handlers: dict[int, Any]) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def _run_handlers(handlers: dict[int, Any], received: list[tuple[int, Any]]) -> None:
    for signum, frame in received:
        handlers[signum](signum, frame)


def start_thread(thread: threading.Thread) -> threading.Thread:
    """thread.start(), with a Ctrl-C held back until it returns: start() waits on a
    threading.Event for the new thread, and an interrupt there can leave the Event's lock held,
    the new thread then blocked before it runs anything."""
    with sigint_deferred():
        thread.start()
    return thread


class Gate:
    """An Event whose waits a KeyboardInterrupt can interrupt without wedging anyone.

    While closed, a plain Lock is held; open() sets the flag first, then releases it. Waiters
    only ever acquire and release that Lock (a C call, cleanly interrupted); one interrupted
    between the two holds a Lock whose gate is already open, so nobody waits on it again:
    close() arms a fresh one. open() and close() are meant for the owner's threads in turn
    (a save's training thread closes, its writer opens); open() twice is harmless.
    """

    def __init__(self, is_open: bool = True) -> None:
        self._open = is_open
        self._lock = threading.Lock()
        if not is_open:
            self._lock.acquire()

    def is_open(self) -> bool:
        return self._open

    def close(self) -> None:
        if self._open:
            lock = threading.Lock()
            lock.acquire()
            self._lock = lock  # before the flag: a waiter that sees it closed waits on this one
            self._open = False

    def open(self) -> None:
        if not self._open:
            self._open = True
            try:
                self._lock.release()
            except RuntimeError:  # opened by two threads at once: the other released it
                pass

    def wait(self, timeout: float | None = None) -> bool:
        """Until open (True) or `timeout` seconds passed (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._open:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            lock = self._lock
            if lock.acquire(timeout=-1 if left is None else left):
                try:
                    lock.release()
                except RuntimeError:  # a second open() released it for us
                    pass
        return True


class Task:
    """One call handed to `Helpers`; result() waits for it on a Gate and re-raises its error."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self._fn, self._args = fn, args
        self._error: BaseException | None = None
        self._done = Gate(is_open=False)

    def run(self) -> None:
        try:
            self._fn(*self._args)
        except BaseException as e:  # noqa: BLE001  (handed to whoever waits for it)
            self._error = e
        finally:
            self._done.open()

    def wait(self, timeout: float | None = None) -> bool:
        """Until it ended (True) or `timeout` seconds passed (False)."""
        return self._done.wait(timeout)

    def result(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


class Helpers:
    """A few daemon threads running calls other threads hand over; concurrent.futures' thread
    pool, without its Ctrl-C hazards. Its submit() takes a Semaphore and Future.result() a
    Condition, both in Python code: an interrupt between one's acquire and its `with` left the
    lock held, the helper thread blocked releasing it, and the next save or the process's exit
    hung (a sync-save storm of random SIGINTs: 1 run in 4 of 3 s). Here submitting is a
    SimpleQueue.put and waiting a Gate, both cleanly interrupted. Threads start on first use,
    and again in a forked child, which has none of its parent's."""

    def __init__(self, threads: int, name: str) -> None:
        self._threads, self._name = threads, name
        self._queue: "queue.SimpleQueue[Task]" = queue.SimpleQueue()
        self._pid: int | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Task:
        if self._pid != os.getpid():
            self._start()
        task = Task(fn, args)
        self._queue.put(task)
        return task

    def _start(self) -> None:
        # No lock (a forked child could inherit it held): two threads starting at once each start
        # threads for a queue of their own, and every task is still served by the queue's threads.
        tasks: "queue.SimpleQueue[Task]" = queue.SimpleQueue()  # a forked child's may hold its parent's tasks
        for i in range(self._threads):
            start_thread(threading.Thread(target=_serve_tasks, args=(tasks,), name=f"{self._name}-{i}", daemon=True))
        self._queue, self._pid = tasks, os.getpid()


def _serve_tasks(tasks: "queue.SimpleQueue[Task]") -> None:
    while True:
        tasks.get().run()
