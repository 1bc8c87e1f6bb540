"""Where a sharded save's time goes on each rank (cProfile), for the performance notes.

    python bench/profile_sharded.py --mib 256 --world 2
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))


def profiled_saves(rank: int, world: int, root: str, mib: float, what: str, keep_last: int | None) -> str:
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import distckpt

    torch.set_num_threads(1)
    width, layers = 1024, 8
    rows = max(world, int(mib * 2**20) // 4 // width // layers)
    model = nn.Sequential(*(nn.Linear(width, rows, bias=False) for _ in range(layers)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    mgr = distckpt.CheckpointManager(os.path.join(root, "p"), timeout=300, keep_last=keep_last)
    times = []
    for step in range(4):  # warm-up rounds
        t = time.perf_counter()
        mgr.save(step, {"model": model})
        times.append(round(time.perf_counter() - t, 3))
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    if what == "save":
        mgr.save(9, {"model": model})
    else:
        mgr.load_latest({"model": model})
    prof.disable()
    elapsed = time.perf_counter() - t0
    mgr.close()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
    return f"rank {rank}: warm-up saves {times}; {what} {elapsed:.3f}s\n" + out.getvalue()


def main() -> int:
    from distckpt.testing import run_world

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=256)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--what", choices=("save", "load"), default="save")
    p.add_argument("--keep-last", type=int, default=None)
    args = p.parse_args()
    for r in run_world("profile_sharded:profiled_saves", args.world, timeout=600, root=tempfile.mkdtemp(),
                       mib=args.mib, what=args.what, keep_last=args.keep_last):
        print(r.value if r.error is None else r.error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
