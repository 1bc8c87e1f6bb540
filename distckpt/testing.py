"""Testing helpers shipped for users' own tests: run a function on N real ranks.

Run a function on N real processes joined by a real gloo process group.

`run_world("module:function", world_size, **kwargs)` starts one process per rank (forked from a
server that imported torch once; with the caller's environment and directory), initialises
`torch.distributed` (gloo, TCP store on a free loopback port), calls the function with
`(rank, world_size, **kwargs)` and returns one RankResult per rank: its return value, the
error it raised (type name and message) and how long it took, or that it died (exit code).
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    elapsed: float = 0.0
    exitcode: int | None = None

    @property
    def died(self) -> bool:
        return self.exitcode is not None and self.exitcode < 0 and self.error_type is None and self.value is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(target: str, rank: int, world: int, port: int, results: Any, kwargs: dict[str, Any],
           environ: dict[str, str], cwd: str) -> None:
    # A forkserver child has the server's environment and directory, not the caller's now.
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    start = time.monotonic()
    try:
        try:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world, timeout=datetime.timedelta(seconds=60))
        except Exception as e:
            if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
                raise _PortTaken(str(e)) from e  # another process took the free port in between: retried
            raise
        module, name = target.split(":")
        value = getattr(importlib.import_module(module), name)(rank, world, **kwargs)
        results.put((rank, "ok", value, None, time.monotonic() - start))
    except BaseException as e:  # reported to the test, which asserts on it
        results.put((rank, type(e).__name__, None, f"{e}\n{traceback.format_exc()}", time.monotonic() - start))
    finally:
        results.close()
        results.join_thread()  # flush the result before leaving
        os._exit(0)  # skip gloo teardown: a peer may be dead on purpose


def _context() -> Any:
    """A forkserver that imported torch once: each rank is forked from it ready to run (a spawned
    rank spends ~2.8 s importing torch; the suite starts ~200 worlds). The server imports nothing
    else and runs no torch operation, so no thread pool is inherited. DISTCKPT_START_METHOD=spawn
    starts every rank from scratch instead (and where forkserver does not exist)."""
    method = os.environ.get("DISTCKPT_START_METHOD", "forkserver")
    if method not in mp.get_all_start_methods():
        method = "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


class _PortTaken(Exception):
    pass


PORT_ATTEMPTS = 3


def run_world(target: str, world_size: int, timeout: float = 120.0, **kwargs: Any) -> list[RankResult]:
    """Run `target(rank, world_size, **kwargs)` on every rank of a fresh gloo world; each rank's
    RankResult (value, or error with traceback, or the exit code of a rank that died)."""
    for _attempt in range(PORT_ATTEMPTS):
        out = _run_world_once(target, world_size, timeout, kwargs)
        if out is not None:
            return out
    raise RuntimeError(f"no free loopback port stayed free for {PORT_ATTEMPTS} attempts to start a world")


def _run_world_once(target: str, world_size: int, timeout: float, kwargs: dict[str, Any]) -> list[RankResult] | None:
    """One world on a free port; None if another process took the port before the store bound it."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(target, r, world_size, port, results, kwargs, dict(os.environ),
                                              os.getcwd()))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out = {r: RankResult(r) for r in range(world_size)}
    deadline = time.monotonic() + timeout
    pending = set(range(world_size))
    while pending and time.monotonic() < deadline:
        try:
            rank, status, value, err, elapsed = results.get(timeout=0.2)
        except queue.Empty:
            for r in list(pending):
                if not procs[r].is_alive() and procs[r].exitcode not in (None, 0):
                    out[r].exitcode = procs[r].exitcode
                    pending.discard(r)
            continue
        if status == _PortTaken.__name__:
            for p in procs:
                p.kill()
                p.join()
            return None
        res = out[rank]
        res.elapsed = elapsed
        if status == "ok":
            res.value = value
        else:
            res.error_type, res.error = status, err
        pending.discard(rank)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    if pending:
        raise TimeoutError(f"ranks {sorted(pending)} neither returned nor died within {timeout}s (a hang)")
    return [out[r] for r in range(world_size)]
