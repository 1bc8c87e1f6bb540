"""One object-store client per set of options in a process, shared by the managers that use it.

Each s3fs client builds a botocore client, and botocore keeps what each one resolves (endpoint
rules, parsed models) in module-level caches of up to 100 entries: a process that built a
manager per evaluation or per sweep trial on the same bucket grew by ~1-10 MiB per manager,
with nothing a manager could close (measured on loopback SeaweedFS: 266 -> 442 MiB resident over
81 managers, each created, loaded, saved once and closed; one manager doing the same stayed
flat). fsspec's own instance cache would share clients too, but its key holds the thread that
asked, and `retries` (set after construction) is not part of it.

A client is shared only within one process (a forked child builds its own: its parent's event
loop and connections are not its own) and only between identical options.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from typing import Any, Callable

from fsspec.utils import tokenize

from distckpt.storage.registry import credential_environment_prefixes

log = logging.getLogger("distckpt")

_MAX_CLIENTS = 32  # distinct option sets kept; the oldest is let go (a process moving between many stores)
_CLIENTS: dict[str, Any] = {}
_LOCK = threading.Lock()


def shared_client(kind: str, options: dict[str, Any], make: Callable[[], Any]) -> Any:
    """The client made by `make()` for these options, made once per process."""
    key = tokenize(kind, os.getpid(), sorted(options.items(), key=lambda kv: kv[0]), _credential_environment())
    with _LOCK:
        client = _CLIENTS.pop(key, None)
        if client is None:
            _stop_io_loop_at_exit()  # before the client: see _stop_io_loop_at_exit
            client = make()
        _CLIENTS[key] = client  # the newest last: what is let go first is the longest unused
        while len(_CLIENTS) > _MAX_CLIENTS:
            _CLIENTS.pop(next(iter(_CLIENTS)))
        return client


def _credential_environment() -> list[tuple[str, str]]:
    """Where clients read credentials and endpoints from besides their options (each backend's
    spec names its prefixes: registry.py): a process that rotates them in its environment (a new
    session token) gets a new client for its next manager."""
    prefixes = credential_environment_prefixes()
    return sorted((name, value) for name, value in os.environ.items() if name.startswith(prefixes))


class _ExitMark:
    """Lives as long as the process: its finalizer runs at exit (weakref.finalize's atexit pass)."""


_EXIT_MARKS: dict[int, _ExitMark] = {}  # by pid: a forked child registers its own


def _stop_io_loop_at_exit() -> None:
    """Stop the IO loop at exit, after the clients' own exit finalizers. weakref.finalize runs
    its atexit finalizers newest first, and the clients register theirs when they are made or
    first connect (s3fs and gcsfs close their sessions; adlfs calls fsspec's sync on the loop,
    which raised "Loop is not running" from every Azure client when the loop was stopped first).
    A finalizer registered before any client is made therefore runs after all of theirs."""
    if os.getpid() not in _EXIT_MARKS:
        mark = _EXIT_MARKS[os.getpid()] = _ExitMark()
        weakref.finalize(mark, stop_io_loop)


def stop_io_loop(timeout_s: float = 5.0) -> None:
    """Stop and close fsspec's IO loop (the daemon thread every async client runs on) while the
    interpreter can still run it to the end.

    Why: left running, the loop's thread is still freeing the objects of finished requests when
    the interpreter finalizes; a request's object can hold a view of a tensor whose bytes it
    sent, and a torch tensor freed there re-takes the GIL inside a C++ destructor, which at
    finalization ends the thread inside that destructor: "terminate called without an active
    exception", SIGABRT, exit 134 after a job that did everything right (a process that saved to
    SeaweedFS and exited: every run). Stopped here (at exit, before finalization), what the
    loop holds is freed by the main thread. Closed, not only stopped: a later call on it (another
    exit hook) raises fsspec's "Loop is not running" instead of waiting for ever; s3fs's own
    exit hook sees a loop that is not running and closes its connections without it."""
    from fsspec import asyn

    loop, thread = asyn.loop[0], asyn.iothread[0]
    if loop is None or loop.is_closed() or thread is None or not thread.is_alive():
        return
    if thread is threading.current_thread():
        return
    try:  # let what the clients' finalizers started finish first (gcsfs closes its session in a task)
        asyncio.run_coroutine_threadsafe(_finish_pending(timeout_s / 2), loop).result(timeout_s)
    except Exception as e:  # noqa: BLE001  # at exit: stopping matters more than what was left
        log.debug("finishing the IO loop's tasks at exit: %s", e)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout_s)
    if not thread.is_alive():
        loop.close()


async def _finish_pending(timeout_s: float) -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)
