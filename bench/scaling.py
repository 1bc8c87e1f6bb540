"""A scaling model for save, load and the loop's stall, from throughputs measured here.

    python bench/scaling.py [--no-check] [--mib 256]

Measures on this machine: one process's write + fsync to local disk and two processes' at once
(is the disk shared?), a memory copy, the xxh3 checksum, and the protocol's cost per save and per
load at 2, 4 and 8 ranks (a tiny state: exchanges and small files only). The model (below, in
`predict`) builds save and load times from them for each write path — rank 0 alone (replicated,
the default), split writes, sharded (FSDP2) — and checks itself against this machine's measured
rows at 2 and 4 ranks (unless --no-check). Then it prints predictions for 8 / 64 / 512 ranks and
1B / 7B / 70B-parameter states on a cluster whose per-node figures are ASSUMPTIONS, named in the
output (CLUSTER), not measurements: this machine has one node and one disk.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MIB = 2**20
GIB = 2**30
BYTES_PER_PARAM = 12  # fp32 weights + AdamW's two fp32 moments (mixed precision adds little more)
TENSORS_PER_BILLION = 400  # a transformer of 1B parameters has a few hundred weight tensors


@dataclass(frozen=True)
class Machine:
    write_one: float        # bytes/s, one process, write + fsync
    write_shared: float     # bytes/s, all processes of the node together (the disk's or the link's bound)
    copy: float             # bytes/s, memory copy into reused buffers (staging)
    checksum: float         # bytes/s, xxh3 on one core
    save_protocol: tuple[float, float]  # seconds per save = a + b * ranks (tiny state)
    load_protocol: tuple[float, float]
    per_tensor_s: float = 40e-6  # capture + encode per tensor (bench/profile_save.py: ~4.8 ms / ~115)


# Per-node figures of a cluster, ASSUMED (not measured here): 8 ranks per node, a 100 Gb/s link
# to the object store (~11 GiB/s; 10 usable), one process reaching 1.5 GiB/s to S3 with
# concurrent parts, the object store itself not the bound. The protocol constants are this
# machine's, extrapolated linearly in the number of ranks (pessimistic: here every rank shares 2 cores).
# A cooperative load's ranges travel over distckpt's gloo group (TCP): a ring in rank order, each
# rank receiving the state's other ranges over one connection at "gloo_edge" bytes/s (ASSUMED like
# one process to the store; on this machine's loopback, 2 ranks on 2 shared cores: 152 MiB/s).
CLUSTER = {"ranks_per_node": 8, "node_link": 10 * GIB, "process_to_store": 1.5 * GIB, "copy": 10 * GIB,
           "checksum": 8 * GIB, "gloo_edge": 1.5 * GIB}


def _write_fsync(path: str, nbytes: int, start: "Any | None" = None,
                 out: "multiprocessing.Queue[tuple[float, float]] | None" = None) -> float:
    """Seconds to write `nbytes` and fsync them; with `start` (a Barrier) every writer begins
    together and reports its (start, end) on the monotonic clock, which processes share."""
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8).tobytes()
    if start is not None:
        start.wait()
    t0 = time.monotonic()
    with open(path, "wb", buffering=0) as f:
        view = memoryview(data)
        while view:
            view = view[f.write(view):]
        os.fsync(f.fileno())
    t1 = time.monotonic()
    os.unlink(path)
    if out is not None:
        out.put((t0, t1))
    return t1 - t0


def _shared_write(root: str, nbytes: int, writers: int) -> float:
    """Seconds for `writers` processes writing nbytes/writers each at once (first start to last end)."""
    barrier = multiprocessing.Barrier(writers)
    q: multiprocessing.Queue[tuple[float, float]] = multiprocessing.Queue()
    procs = [multiprocessing.Process(target=_write_fsync,
                                     args=(os.path.join(root, f"w{writers}-{i}"), nbytes // writers, barrier, q))
             for i in range(writers)]
    for p in procs:
        p.start()
    spans = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join()
    return max(end for _, end in spans) - min(start for start, _ in spans)


def measure_machine(root: str, mib: int, repeats: int = 5) -> Machine:
    import torch
    import xxhash

    nbytes = mib * MIB
    _write_fsync(os.path.join(root, "warm"), nbytes)  # the first write into new pages is slower here
    ones, shared = [], []
    for _ in range(repeats):  # interleaved: this VM's disk swings from one minute to the next
        ones.append(_write_fsync(os.path.join(root, "w1"), nbytes))
        shared.append(_shared_write(root, nbytes, 2))
    one = statistics.median(ones)
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    copies = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t0)
    raw = src.numpy().tobytes()
    hashes = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        xxhash.xxh3_64(raw).hexdigest()
        hashes.append(time.perf_counter() - t0)
    save_fit, load_fit = _protocol_fits(root)
    return Machine(nbytes / one, nbytes / statistics.median(shared), nbytes / statistics.median(copies[1:]),
                   nbytes / statistics.median(hashes), save_fit, load_fit)


def _protocol_fits(root: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """Least squares a + b * ranks over the tiny-state save and load at 2, 4 and 8 ranks."""
    from distckpt.testing import run_world

    worlds, saves, loads = [2, 4, 8], [], []
    for world in worlds:
        results = run_world("rank_jobs:coordination_rows", world, timeout=900, root=root, repeats=5)
        bad = [r for r in results if r.error or r.died]
        if bad:
            raise RuntimeError(f"ranks failed: {[(r.rank, r.error) for r in bad]}")
        saves.append(results[0].value["save (tiny state)"])
        loads.append(results[0].value["load (tiny state)"])
    return _fit(worlds, saves), _fit(worlds, loads)


def _fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    b, a = np.polyfit(np.array(xs, dtype=float), np.array(ys), 1)
    return float(max(a, 0.0)), float(max(b, 0.0))


def predict(m: Machine, ranks: int, state_bytes: float, path: str, ranks_per_node: int,
            tensors: int, gloo_edge: float | None = None) -> dict[str, float]:
    """Save, load and the loop's stall per save (seconds) for one write path.

    save: the bytes one writer sends, at that writer's speed (its own, the checksum's, or its
    share of the node's link, whichever is lowest), plus the protocol's cost at this many ranks.
    rank0 (replicated, default): rank 0 writes the whole state alone.
    split / sharded: every rank writes 1/ranks of it; a node's ranks share the node's link.
    load: a replicated file from an object store is read cooperatively (rank0, the default): each
    rank reads 1/ranks of it from the store (a node's ranks share its link), then receives the
    other ranges over gloo's ring (`gloo_edge`); the store sends the state once per job. Split
    writes' replicated tensors live in the ranks' shard files, which every rank reads whole (a
    node reads ranks_per_node copies through its link); sharded reads 1/ranks each.
    from_store: the bytes the store sends per load, all ranks together.
    stall (async save): the capture (per tensor) and the copy into staging of what the slowest
    rank stages (rank 0: the whole replicated state; sharded: 1/ranks), plus one exchange;
    with overlap_snapshot the copy leaves the stall (it runs beside forward and backward).
    """
    per_node = min(ranks, ranks_per_node)
    save_a, save_b = m.save_protocol
    load_a, load_b = m.load_protocol
    protocol_save = save_a + save_b * ranks
    protocol_load = load_a + load_b * ranks
    exchange = protocol_save / 3  # a sync save is three exchanges; an async save's stall holds one
    if path == "rank0":
        written = state_bytes
        speed = min(m.write_one, m.checksum, m.write_shared)
    else:
        written = state_bytes / ranks
        speed = min(m.write_one, m.checksum, m.write_shared / per_node)
    save = written / speed + protocol_save
    share = min(m.write_shared / per_node, m.copy, m.write_one)  # one rank's share of its node's link
    if path == "rank0" and gloo_edge is not None and ranks > 1:  # cooperative: once per job
        load = state_bytes / ranks / share + state_bytes * (ranks - 1) / ranks / gloo_edge + protocol_load
        from_store = state_bytes
    else:
        read_each = state_bytes / ranks if path == "sharded" else state_bytes
        load = read_each / min(m.write_shared / per_node, m.copy) + protocol_load
        from_store = read_each * ranks
    staged = state_bytes / ranks if path == "sharded" else state_bytes
    capture = tensors * m.per_tensor_s / (ranks if path == "sharded" else 1)
    return {"save": save, "load": load, "stall": capture + staged / m.copy + exchange,
            "stall_overlap": capture + exchange, "from_store": from_store}


def check_against_rows(m: Machine, root: str, mib: int) -> list[str]:
    """The model at 2 and 4 ranks on this machine (one node: every rank shares the disk) against
    the same rows measured here."""
    from distckpt.testing import run_world

    lines = ["| ranks | path | save predicted s | save measured s | measured / predicted |",
             "|---:|---|---:|---:|---:|"]
    for world in (2, 4):
        rows = run_world("rank_jobs:save_load_rows", world, timeout=900, root=root, mib=mib, repeats=3)[0].value
        sharded = run_world("rank_jobs:sharded_rows", world, timeout=900, root=root, mib=mib, repeats=3)[0].value
        measured = {"rank0": rows["distckpt save"], "split": rows["distckpt save (split_writes)"],
                    "sharded": sharded["distckpt save"]}
        for path, seconds in measured.items():
            guess = predict(m, world, mib * MIB, path, world, 16)["save"]
            lines.append(f"| {world} | {path} | {guess:.3f} | {seconds:.3f} | {seconds / guess:.2f}x |")
    return lines


def cluster_table(m: Machine) -> list[str]:
    c = Machine(CLUSTER["process_to_store"], CLUSTER["node_link"], CLUSTER["copy"], CLUSTER["checksum"],
                m.save_protocol, m.load_protocol)
    lines = ["| ranks | parameters (state) | path | save s | load s | load: from the store, GiB | async stall s "
             "| overlapped stall s |", "|---:|---|---|---:|---:|---:|---:|---:|"]
    for ranks in (8, 64, 512):
        for billions in (1, 7, 70):
            state = billions * 1e9 * BYTES_PER_PARAM
            for path in ("rank0", "split", "sharded"):
                p = predict(c, ranks, state, path, CLUSTER["ranks_per_node"], billions * TENSORS_PER_BILLION,
                            CLUSTER["gloo_edge"])
                lines.append(f"| {ranks} | {billions}B ({state / GIB:,.0f} GiB) | {path} | {p['save']:,.1f} | "
                             f"{p['load']:,.1f} | {p['from_store'] / GIB:,.0f} | {p['stall']:,.2f} | "
                             f"{p['stall_overlap']:,.3f} |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--no-check", action="store_true")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="distckpt-scaling-")
    m = measure_machine(root, args.mib)
    print(f"{os.cpu_count()} CPUs; command: python bench/scaling.py --mib {args.mib}"
          f"{' --no-check' if args.no_check else ''}\n")
    print("| measured here | value |\n|---|---:|")
    print(f"| write + fsync, one process | {m.write_one / MIB:,.0f} MiB/s |")
    print(f"| write + fsync, two processes together | {m.write_shared / MIB:,.0f} MiB/s |")
    print(f"| memory copy | {m.copy / MIB:,.0f} MiB/s |")
    print(f"| xxh3 checksum, one core | {m.checksum / MIB:,.0f} MiB/s |")
    print(f"| protocol per save (tiny state), a + b x ranks | {m.save_protocol[0] * 1e3:.1f} + "
          f"{m.save_protocol[1] * 1e3:.2f} x ranks ms |")
    print(f"| protocol per load (tiny state), a + b x ranks | {m.load_protocol[0] * 1e3:.1f} + "
          f"{m.load_protocol[1] * 1e3:.2f} x ranks ms |", flush=True)
    if not args.no_check:
        print("\nThe model against this machine's rows (one node, one disk shared by every rank):\n")
        print("\n".join(check_against_rows(m, root, args.mib)), flush=True)
    print(f"\nPredicted on a cluster (ASSUMED per node: {CLUSTER}):\n")
    print("\n".join(cluster_table(m)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
