"""Where an S3 save's time goes: wall time against the CPU seconds of this process and of the
SeaweedFS server, for plain s3fs uploads and distckpt saves with different part sizes,
concurrency and request checksums.

    python bench/profile_s3.py [--mib 256] [--repeats 3]

CPU seconds come from /proc (utime + stime, children included for the server); with the client
and the server on the same cores, client + server CPU close to cores x wall means the save is
bound by CPU, not by the protocol.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "launch"))

import distckpt  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process and of its waited-for children, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def server_cpu(pid: int) -> float:
    """The server's process and its threads (weed is one process; tasks are its threads)."""
    return cpu_seconds(pid)


def measure(fn: Callable[[], object], server_pid: int, repeats: int) -> tuple[float, float, float]:
    walls, clients, servers = [], [], []
    for i in range(repeats + 1):
        c0, s0, t0 = cpu_seconds(os.getpid()), server_cpu(server_pid), time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
        if i:  # the first round warms up
            walls.append(wall)
            clients.append(cpu_seconds(os.getpid()) - c0)
            servers.append(server_cpu(server_pid) - s0)
    return statistics.median(walls), statistics.median(clients), statistics.median(servers)


def main() -> int:
    import s3fs
    import torch.distributed.checkpoint as dcp
    from seaweed import SeaweedS3
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    n = 16
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(args.mib * 2**20 // 4 // n, generator=g) for i in range(n)}
    data = b"".join(t.numpy().tobytes() for t in state.values())
    root = tempfile.mkdtemp(prefix="distckpt-s3prof-")
    server = SeaweedS3(os.path.join(root, "seaweedfs")).start()
    rows = []
    try:
        server.make_bucket("bench")
        os.environ.update(server.env())
        pid = server.proc.pid
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())
        quiet = {**server.storage_options(),
                 "config_kwargs": {"request_checksum_calculation": "when_required"}}
        fs_quiet = s3fs.S3FileSystem(skip_instance_cache=True, **quiet)
        rows.append(("s3fs pipe (one object)", measure(lambda: fs.pipe_file("bench/raw.bin", data), pid, args.repeats)))
        rows.append(("s3fs pipe, no request checksum",
                     measure(lambda: fs_quiet.pipe_file("bench/raw.bin", data), pid, args.repeats)))
        rows.append(("dcp.save (FsspecWriter)",
                     measure(lambda: dcp.save(state, storage_writer=FsspecWriter("s3://bench/dcp")), pid, args.repeats)))
        mib = 2**20
        variants: list[tuple[str, dict]] = [
            ("distckpt save (defaults: 8 MiB parts, 8 in flight)", {}),
            ("distckpt save, no request checksum", {"config_kwargs": {"request_checksum_calculation": "when_required"}}),
            ("distckpt save, 16 MiB parts", {"part_bytes": 16 * mib}),
            ("distckpt save, 32 MiB parts", {"part_bytes": 32 * mib}),
            ("distckpt save, 64 MiB parts", {"part_bytes": 64 * mib}),
            ("distckpt save, 8 MiB parts, 2 in flight", {"concurrency": 2}),
            ("distckpt save, 8 MiB parts, 4 in flight", {"concurrency": 4}),
            ("distckpt save, 8 MiB parts, 16 in flight", {"concurrency": 16}),
        ]
        for k, (name, extra) in enumerate(variants):
            mgr = distckpt.CheckpointManager(f"s3://bench/run{k}", keep_last=1,
                                             storage_options={**server.storage_options(), **extra})
            steps = iter(range(10**6))
            rows.append((name, measure(lambda mgr=mgr, steps=steps: mgr.save(next(steps), state), pid, args.repeats)))
            mgr.close()
    finally:
        server.stop()
    cores = os.cpu_count()
    print(f"{args.mib} MiB, median of {args.repeats}, {cores} CPUs; command: python bench/profile_s3.py "
          f"--mib {args.mib} --repeats {args.repeats}")
    print("| what | wall s | MiB/s | client CPU s | server CPU s | (client+server) / (cores x wall) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (wall, client, srv) in rows:
        print(f"| {name} | {wall:.3f} | {args.mib / wall:,.0f} | {client:.2f} | {srv:.2f} | "
              f"{(client + srv) / (cores * wall):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
