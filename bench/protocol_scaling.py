"""What a tiny-state save and load cost as the ranks grow: the protocol's own cost.

    python bench/protocol_scaling.py [--worlds 2 4 8 16] [--rounds 15] [--compare PYTHONPATH]
    python bench/protocol_scaling.py --bare [--store] [--worlds 2 16] [--rounds 60]

Each row is a fresh `torchrun --standalone --nproc-per-node N` on this machine (gloo, CPU),
saving and loading a state of a few bytes (one tensor, one per-rank generator) to local disk:
whatever the time is, it is coordination and per-rank bookkeeping, not bytes. A round is timed
from a barrier to the slowest rank's return (an all_reduce of the times, MAX); the row is the
median of --rounds rounds after two warm-up rounds. The ratio is each row against the first
world (2 ranks), save and load separately. With --compare, the same rows are measured with
that PYTHONPATH too (another checkout of distckpt), interleaved row by row. Below the table: the
exchanges one save and one load made on the manager's group (where the version counts them), and
the CPU time of one save and one load, every rank's process time summed (medians): on a machine
of C cores, that sum over C is a floor under the round's time. With --bare, no distckpt: one
exchange's gloo gather and broadcast alone, per world (its wall time and a rank's CPU time); with
--bare --store, beside it the same exchange through the job's key-value store (TCPStore: each rank
sets its message, rank 0 waits for them, reads them in one multi_get and sets the answer, which the
others wait for and get; the keys are deleted as a production version would have to).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(root: str, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    import distckpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = {"x": torch.zeros(4), "g": torch.Generator().manual_seed(rank)}
    times: dict[str, list[float]] = {"save": [], "load": []}
    cpu: dict[str, list[float]] = {"save_cpu": [], "load_cpu": []}  # every rank's CPU seconds, summed
    exchanges: dict[str, int] = {}
    with distckpt.CheckpointManager(root, keep_last=2, timeout=300) as mgr:
        counted = getattr(mgr._coord, "exchanges", None)  # None: a version that did not count them
        for step in range(rounds + 2):
            for what in ("save", "load"):
                dist.barrier()
                before = sum(counted.values()) if counted is not None else 0
                started, used = time.perf_counter(), time.process_time()
                if what == "save":
                    mgr.save(step, state)
                else:
                    mgr.load(state, step)
                took = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
                spent = torch.tensor([time.process_time() - used], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                dist.all_reduce(spent, op=dist.ReduceOp.SUM)
                if step >= 2:  # warm-up rounds left out
                    times[what].append(float(took.item()))
                    cpu[f"{what}_cpu"].append(float(spent.item()))
                if counted is not None:  # the training thread's exchanges on the manager's group
                    exchanges[f"{what}_exchanges"] = sum(counted.values()) - before
    if rank == 0:
        medians = {k: statistics.median(v) for k, v in {**times, **cpu}.items()}
        print("RESULT " + json.dumps({**medians, **exchanges}), flush=True)
    dist.destroy_process_group()


def store_exchange(store, key: str, prev: str | None, rank: int, world: int) -> None:
    """One gather to rank 0 and broadcast back through the store, with the deletes that keep it bounded."""
    from datetime import timedelta

    store.set(f"{key}/{rank}", b"x" * 300)
    if rank == 0:
        keys = [f"{key}/{r}" for r in range(world)]
        store.wait(keys, timedelta(seconds=300))
        got = store.multi_get(keys)
        store.set(f"{key}/a", b"".join(got))
        for r in range(world):
            store.delete_key(f"{key}/{r}")
        if prev is not None:
            store.delete_key(f"{prev}/a")
    else:
        store.wait([f"{key}/a"], timedelta(seconds=300))
        store.get(f"{key}/a")


def bare_worker(rounds: int, through_store: bool = False) -> None:
    """A bare gloo gather of 1 KiB per rank to rank 0 and a broadcast of world_size KiB back (what
    one distckpt exchange moves): its wall time (slowest rank) and one rank's CPU time (mean)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.PrefixStore("bare", dist.distributed_c10d._get_default_store().clone()) if through_store else None
    walls, cpus = [], []
    prev = None
    for i in range(rounds + 2):
        dist.barrier()
        started, used = time.perf_counter(), time.process_time()
        for j in range(5):
            if store is not None:
                store_exchange(store, f"{i}/{j}", prev, rank, world)
                prev = f"{i}/{j}"
                continue
            slot = torch.zeros(1032, dtype=torch.uint8)
            dist.gather(slot, [torch.empty_like(slot) for _ in range(world)] if rank == 0 else None, dst=0, group=group)
            dist.broadcast(torch.zeros(8 + world * 1024, dtype=torch.uint8), src=0, group=group)
        took = torch.tensor([(time.perf_counter() - started) / 5], dtype=torch.float64)
        spent = torch.tensor([(time.process_time() - used) / 5], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        dist.all_reduce(spent, op=dist.ReduceOp.SUM)
        if i >= 2:
            walls.append(float(took.item()))
            cpus.append(float(spent.item()) / world)
    if rank == 0:
        print("RESULT " + json.dumps({"bare": statistics.median(walls), "bare_cpu": statistics.median(cpus)}), flush=True)
    dist.destroy_process_group()


def row(world: int, rounds: int, pythonpath: str | None, bare: bool = False, store: bool = False) -> dict[str, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    with tempfile.TemporaryDirectory() as root:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               os.path.abspath(__file__), "--worker", "--root", os.path.join(root, "run"), "--rounds", str(rounds)]
        cmd += ["--bare"] if bare else []
        cmd += ["--store"] if store else []
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{world} ranks: no result (exit {out.returncode}):\n{out.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--compare", default=None, help="PYTHONPATH of another checkout, measured alike")
    parser.add_argument("--bare", action="store_true",
                        help="instead: a bare gloo gather and broadcast of one exchange's size, per world")
    parser.add_argument("--store", action="store_true",
                        help="with --bare: also the same exchange through the key-value store")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        bare_worker(args.rounds, args.store) if args.bare else worker(args.root, args.rounds)
        return
    if args.bare:
        for world in args.worlds:
            for through_store in (False, True) if args.store else (False,):
                got = row(world, args.rounds, None, bare=True, store=through_store)
                print(f"{world} ranks: a bare gather and broadcast {'(key-value store) ' if through_store else ''}"
                      f"{got['bare'] * 1e3:.2f} ms, {got['bare_cpu'] * 1e3:.3f} ms of CPU per rank")
        return
    print(table(measure(args.worlds, args.rounds, args.compare), args.compare is not None))


def measure(worlds: list[int], rounds: int, compare: str | None) -> dict[str, dict[int, dict[str, float]]]:
    here = os.path.dirname(HERE)
    results: dict[str, dict[int, dict[str, float]]] = {"this": {}, "compared": {}}
    for world in worlds:
        results["this"][world] = row(world, rounds, here + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if compare is not None:
            results["compared"][world] = row(world, rounds, compare)
    return results


def table(results: dict[str, dict[int, dict[str, float]]], compared: bool) -> str:
    lines = ["| ranks | save ms | save vs 2 ranks | load ms | load vs 2 ranks |"
             + (" compared: save ms | vs 2 | load ms | vs 2 |" if compared else ""),
             "|---|---|---|---|---|" + ("---|---|---|---|" if compared else "")]
    for world, this in results["this"].items():
        cells = _cells(this, results["this"])
        if compared:
            cells += _cells(results["compared"][world], results["compared"])
        lines.append(f"| {world} | " + " | ".join(cells) + " |")
    for name, rows in (("this version", results["this"]), ("compared", results["compared"])):
        counts = {w: (r["save_exchanges"], r["load_exchanges"]) for w, r in rows.items() if "load_exchanges" in r}
        if counts:
            lines.append(f"\nexchanges per save / load ({name}): "
                         + ", ".join(f"{w} ranks {sv} / {ld}" for w, (sv, ld) in counts.items()))
        if rows:
            lines.append(f"\nCPU ms of every rank together per save / load ({name}): "
                         + ", ".join(f"{w} ranks {r['save_cpu'] * 1e3:.1f} / {r['load_cpu'] * 1e3:.1f}"
                                     for w, r in rows.items()))
    return "\n".join(lines)


def _cells(got: dict[str, float], rows: dict[int, dict[str, float]]) -> list[str]:
    first = rows[min(rows)]
    return [f"{got['save'] * 1e3:.1f}", f"{got['save'] / first['save']:.2f}x",
            f"{got['load'] * 1e3:.1f}", f"{got['load'] / first['load']:.2f}x"]


if __name__ == "__main__":
    main()
