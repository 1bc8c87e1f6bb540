"""Per-rank state: each rank holds its own tensors (``distckpt.per_rank``), which only that rank can
write. Every rank writes its own rank file and reports it to rank 0 through the store.

    python bench/per_rank.py [--mib 64] [--worlds 2 4] [--repeats 5]

Rows per world size, measured in the same run: distckpt's save of `--mib` MiB per rank (plus a
tiny replicated model), against the floor of that layout — every rank torch.save + fsync + rename
of its own part, in parallel — and a tiny-state save (the protocol alone).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))


def per_rank_job(rank: int, world: int, root: str, mib: float, repeats: int) -> dict[str, float]:
    from baselines import torch_save_durably
    from rank_jobs import _timed

    import distckpt

    tensors = {f"t{i}": torch.randn(max(1, int(mib * 2**20) // 4 // 8)) + rank for i in range(8)}
    state = {"mine": distckpt.per_rank(tensors), "model": torch.nn.Linear(4, 4)}
    tiny = {"mine": distckpt.per_rank({"t": torch.zeros(4) + rank}), "model": torch.nn.Linear(4, 4)}
    own = os.path.join(root, f"torch-save-w{world}")
    os.makedirs(own, exist_ok=True)

    def torch_save_own_part() -> None:
        torch_save_durably(tensors, os.path.join(own, f"rank-{rank}.pt"))

    out = {"every rank torch.save + fsync of its own part": _timed(torch_save_own_part, repeats)}
    for name, what, rounds in (("distckpt save", state, repeats), ("distckpt save (tiny state)", tiny, 4 * repeats)):
        mgr = distckpt.CheckpointManager(os.path.join(root, f"{name}-w{world}"), keep_last=1, timeout=300)
        steps = iter(range(10**6))
        out[name] = _timed(lambda: mgr.save(next(steps), what), rounds)  # noqa: B023  # called here
        mgr.close()
    return out


def per_rank_table(mib: float, worlds: list[int], repeats: int) -> str:
    from distckpt.testing import run_world

    lines = [f"per-rank state: {mib:g} MiB per rank in 8 tensors; median of {repeats} (tiny: {4 * repeats}) "
             f"after 2 warm-up saves; slowest rank; {os.cpu_count()} CPUs; torch {torch.__version__}",
             f"command: python bench/per_rank.py --mib {mib:g} --worlds {' '.join(map(str, worlds))} "
             f"--repeats {repeats}",
             "| ranks | what | median s | vs every rank's torch.save |", "|---:|---|---:|---:|"]
    root = tempfile.mkdtemp(prefix="distckpt-per-rank-")
    try:
        for world in worlds:
            results = run_world("per_rank:per_rank_job", world, timeout=1200, root=root, mib=mib, repeats=repeats)
            for r in results:
                if r.error is not None:
                    raise SystemExit(f"rank {r.rank}: {r.error}")
            rows = results[0].value
            floor = rows["every rank torch.save + fsync of its own part"]
            for what, seconds in rows.items():
                ratio = "" if "tiny" in what else f"{seconds / floor:.2f}x the time"
                lines.append(f"| {world} | {what} | {seconds:.3f} | {ratio} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=64)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(per_rank_table(args.mib, args.worlds, args.repeats))


if __name__ == "__main__":
    main()
