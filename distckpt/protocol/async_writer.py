"""A single background writer: at most one save in flight.

The thread writes to storage; with several ranks it also runs the save's gather and shares its
outcome, but only on a process group of its own (the manager's background coordinator), never
on the training loop's or the manager's main one, so it cannot interleave with them. One thread
lives for the writer's lifetime: starting a thread per save cost 1.7 ms of the training thread's
time per save (bench/profile_training.py, demo transformer, every step).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from typing import Any, Callable

from distckpt.runtime.interrupts import Gate, start_thread

log = logging.getLogger("distckpt")


class _Job:
    """One save's background part. Its end is told by a Gate, not a threading.Event: a
    KeyboardInterrupt landing inside Event.wait() can leave the Event's internal lock held, and
    the writer's set() then blocks on it forever (Ctrl-C during wait() hung the process, and so
    did the next wait()); interrupts.py."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.submitted = time.monotonic()
        self._ended = Gate(is_open=False)

    @property
    def finished(self) -> bool:
        return self._ended.is_open()

    def end(self) -> None:
        self._ended.open()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the job ended (True), or `timeout` seconds passed (False)."""
        return self._ended.wait(timeout)


class AsyncWriter:
    def __init__(self) -> None:
        self._jobs: "queue.SimpleQueue[_Job | None]" = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._job: _Job | None = None  # the job in flight, until wait() collects it
        self.description = ""
        # Run on the main thread at exit before waiting for the job (a job may wait for it).
        self.before_exit: Callable[[], None] | None = None

    @property
    def busy(self) -> bool:
        return self._job is not None

    @property
    def finished(self) -> bool:
        """A submitted job has ended and waits to be collected by wait()."""
        return self._job is not None and self._job.finished

    def submit(self, fn: Callable[[], Any], description: str) -> None:
        if self._job is not None:
            raise RuntimeError("a background save is already in flight; call wait() first")
        self.description = description
        self._job = _Job(fn)
        if self._thread is None or not self._thread.is_alive():  # a forked child has no thread
            self._thread = threading.Thread(target=_serve, args=(self._jobs,), name="distckpt-writer",
                                            daemon=True)
            start_thread(self._thread)
            # The thread holds only the queue: when the writer goes, so does the thread.
            weakref.finalize(self, self._jobs.put, None)
        self._jobs.put(self._job)
        _register_exit_wait(self)

    def wait(self, within_s_of_submit: float | None = None) -> tuple[Any, BaseException | None]:
        """Join the save in flight (if any); returns (result, error). With `within_s_of_submit`,
        a job still running that many seconds after it was submitted raises WriterStuckError
        and stays in flight."""
        job = self._job
        if job is None:
            return None, None
        if within_s_of_submit is None:
            job.join()
        elif not job.join(max(0.0, job.submitted + within_s_of_submit - time.monotonic())):
            raise WriterStuckError(time.monotonic() - job.submitted)
        self._job = None
        return job.result, job.error

    def abandon(self) -> None:
        """Give up on the job in flight: nothing waits for it again, at exit neither (its thread
        is a daemon; the commit protocol makes whatever it leaves half-written invisible)."""
        self._job = None
        _IN_FLIGHT.discard(self)
        self.close()

    def close(self) -> None:
        """End the thread once the job in flight (if any) is done; a later submit starts another."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None


class WriterStuckError(Exception):
    """The job in flight did not end within the wait's bound."""

    def __init__(self, elapsed_s: float) -> None:
        super().__init__(f"still running {elapsed_s:.1f}s after it was submitted")
        self.elapsed_s = elapsed_s


def _serve(jobs: "queue.SimpleQueue[_Job | None]") -> None:
    """The writer thread: one job at a time, each outcome handed to the main thread by wait();
    None (the writer was closed or collected) ends it."""
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            job.result = job.fn()
        except BaseException as e:  # handed to the main thread by wait()
            job.error = e
        finally:
            job.fn = _done  # drop the closure: it holds the staged state
            job.end()


def _done() -> None:
    return None


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
        job, thread = writer._job, writer._thread
        if job is None or thread is None or not thread.is_alive():
            continue  # nothing in flight, or a forked child (a DataLoader worker): no thread to finish it
        log.warning("distckpt: the process is exiting with the background save of %s in flight and "
                    "without CheckpointManager.close(); finishing it now (call close() at the end of "
                    "training: it also reports the outcome to every rank)", writer.description)
        try:
            if writer.before_exit is not None:
                writer.before_exit()
            finished = job.join(EXIT_WAIT_S)
        except KeyboardInterrupt:  # a second Ctrl-C: stop waiting, but say what it costs
            log.error("distckpt: interrupted at exit: the background save of %s was abandoned and is NOT "
                      "committed (its files are a leftover, removed by a later save)", writer.description)
            return
        if not finished:
            log.error("distckpt: the background save of %s did not finish within %.0f s of exit; it is "
                      "NOT committed", writer.description, EXIT_WAIT_S)
        elif job.error is not None:
            log.error("distckpt: the background save of %s FAILED at exit and %s: %s: %s", writer.description,
                      _commit_state_of(job.error), type(job.error).__name__, job.error)
        else:
            log.warning("distckpt: the background save of %s finished at exit", writer.description)
        writer._job = None


def _commit_state_of(error: BaseException) -> str:
    """What the exit line says of the commit: a failure after rank 0's commit (telling the other
    ranks failed: the groups destroyed under the save) carries `committed` (saving.share_outcome):
    True on rank 0, None where a rank cannot tell."""
    committed = getattr(error, "committed", False)
    if committed is True:
        return "its step IS committed (only telling the other ranks failed)"
    if committed is None:
        return "this rank cannot tell whether it is committed (rank 0's line says)"
    return "is not committed"
