"""Where a tiny-state save and load spend their time at 2, 4 and 8 ranks.

    python bench/profile_coordination.py [--worlds 2 4 8] [--rounds 10]

Each rank times every distckpt collective (by phase) and, on rank 0, every fsync and the
retention step, next to a bare gloo all_gather_object of the same size: the floor a protocol
with that many collectives cannot go under on this machine.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(__file__))


class Clock:
    """Seconds spent per label, summed over the calls made while it is installed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)

    def wrap(self, label: Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                name = label(*args, **kwargs)
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1
        return timed

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        out = dict(self.seconds), dict(self.calls)
        self.seconds.clear()
        self.calls.clear()
        return out


def _instrument(clock: Clock) -> None:
    from distckpt.protocol import coord, pruning, session
    from distckpt.storage.local import LocalStorage

    for method in ("all_gather", "gather", "broadcast"):
        original = getattr(coord.GlooCoordinator, method)
        setattr(coord.GlooCoordinator, method,
                clock.wrap(lambda self, obj, phase, _m=method: f"collective {_m} {phase.split(' step')[0]}", original))
    for method in ("write_file", "create_exclusive", "read_bytes", "read_buffer", "list_dir", "exists",
                   "newest_mtime", "remove_file", "remove_tree"):
        if hasattr(LocalStorage, method):
            setattr(LocalStorage, method, clock.wrap(lambda *a, _m=method, **k: f"storage {_m}",
                                                     getattr(LocalStorage, method)))
    os.fsync = clock.wrap(lambda *a: "  of which fsync", os.fsync)  # type: ignore[assignment]
    pruning.Pruner.after_commit = clock.wrap(lambda *a: "rank 0 retention + leftovers (whole)",
                                             pruning.Pruner.after_commit)
    session.write_and_commit = clock.wrap(lambda *a: "rank 0 write_and_commit (whole)", session.write_and_commit)
    session.stage_save = clock.wrap(lambda *a: "stage_save: capture+agree+gather (whole)", session.stage_save)


def phases(rank: int, world: int, root: str, rounds: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import distckpt

    torch.set_num_threads(1)
    clock = Clock()
    _instrument(clock)
    mgr = distckpt.CheckpointManager(os.path.join(root, f"tiny-w{world}"), keep_last=1, timeout=300)
    state = {"x": torch.zeros(1), "g": torch.Generator().manual_seed(rank)}
    out: dict[str, Any] = {}
    for what, fn in (("save", lambda i: mgr.save(i, state)), ("load", lambda i: mgr.load_latest(state)),
                     ("bare all_gather_object", lambda i: dist.all_gather_object([None] * world, {"rank": rank, "x": "y" * 200}))):
        totals, parts = [], collections.defaultdict(list)
        for i in range(rounds + 1):
            dist.barrier()
            clock.take()
            t0 = time.perf_counter()
            fn(i if what == "save" else 0)
            elapsed = time.perf_counter() - t0
            seconds, calls = clock.take()
            if i:
                totals.append(elapsed)
                for k, v in seconds.items():
                    parts[k].append((v, calls[k]))
        out[what] = {"total": statistics.median(totals),
                     "parts": {k: (statistics.median(s for s, _ in v), v[0][1]) for k, v in parts.items()}}
    mgr.close()
    return out


def main() -> int:
    from distckpt.testing import run_world

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="distckpt-coordprof-")
    print(f"{os.cpu_count()} CPUs; median of {args.rounds}; command: python bench/profile_coordination.py "
          f"--worlds {' '.join(map(str, args.worlds))} --rounds {args.rounds}")
    for world in args.worlds:
        results = run_world("profile_coordination:phases", world, timeout=600, root=root, rounds=args.rounds)
        bad = [r for r in results if r.error or r.died]
        if bad:
            raise RuntimeError(f"ranks failed: {[(r.rank, r.error) for r in bad]}")
        for what in ("save", "load", "bare all_gather_object"):
            r0, last = results[0].value[what], results[-1].value[what]
            print(f"\n{world} ranks, {what}: rank 0 {r0['total'] * 1e3:.1f} ms, rank {world - 1} {last['total'] * 1e3:.1f} ms")
            for k, (s, n) in sorted(r0["parts"].items(), key=lambda kv: -kv[1][0]):
                other = last["parts"].get(k, (float("nan"), 0))[0]
                print(f"  {k:<40} x{n:<3} rank 0 {s * 1e3:7.1f} ms   rank {world - 1} {other * 1e3:7.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
