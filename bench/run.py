"""Checkpoint throughput against baselines measured in the same run.

    python bench/run.py [--mib 256] [--repeats 3] [--no-s3]

Rows (median of --repeats; MiB/s of the state's payload; ratio against the raw baseline of the
same medium):

    local  raw write + fsync of the same bytes       the disk: the limit
    local  torch.save to tmp + fsync + os.replace
    local  torch.distributed.checkpoint.save (1 rank)
    local  distckpt save (sync)      / async stall (time until save() returns)
    local  raw read of the same bytes / torch.load / dcp.load / distckpt load
    s3     s3fs pipe of the same bytes (one object)  / s3fs cat
    s3     distckpt save / load                      (SeaweedFS on loopback)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "launch"))

import distckpt  # noqa: E402


def make_state(mib: int) -> dict[str, torch.Tensor]:
    n_tensors = 16
    per = mib * 2**20 // 4 // n_tensors
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n_tensors)}


def payload(state: dict[str, torch.Tensor]) -> bytes:
    return b"".join(t.numpy().tobytes() for t in state.values())


def timed(fn: Callable[[], object], repeats: int, before: Callable[[], object] | None = None) -> float:
    times = []
    for _ in range(repeats):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fresh_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)


def local_rows(state: dict, data: bytes, root: str, repeats: int) -> list[tuple[str, str, float, str]]:
    import torch.distributed.checkpoint as dcp

    rows = []
    raw = os.path.join(root, "raw.bin")

    def raw_write() -> None:
        with open(raw + ".tmp", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(raw + ".tmp", raw)

    def torch_save() -> None:
        path = os.path.join(root, "ts.pt")
        with open(path + ".tmp", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)

    dcp_dir = os.path.join(root, "dcp")
    ckpt = os.path.join(root, "distckpt")
    async_ckpt = os.path.join(root, "distckpt-async")
    rows.append(("local", "raw write + fsync", timed(raw_write, repeats), "write"))
    rows.append(("local", "torch.save + fsync + rename", timed(torch_save, repeats), "write"))
    rows.append(("local", "dcp.save", timed(lambda: dcp.save(state, checkpoint_id=dcp_dir), repeats,
                                            lambda: fresh_dir(dcp_dir)), "write"))
    step = iter(range(10**6))

    def save_sync() -> None:
        with distckpt.CheckpointManager(ckpt, keep_last=1) as mgr:
            mgr.save(next(step), state)

    rows.append(("local", "distckpt save (sync)", timed(save_sync, repeats), "write"))
    mgr = distckpt.CheckpointManager(async_ckpt, keep_last=1, async_save=True)
    stalls = []
    for _ in range(repeats):
        mgr.wait()
        t0 = time.perf_counter()
        mgr.save(next(step), state)
        stalls.append(time.perf_counter() - t0)
    mgr.close()
    rows.append(("local", "distckpt async_save stall", statistics.median(stalls), "stall"))

    def raw_read() -> None:
        with open(raw, "rb") as f:
            f.read()

    target = {k: torch.empty_like(v) for k, v in state.items()}
    rows.append(("local", "raw read", timed(raw_read, repeats), "read"))
    rows.append(("local", "torch.load", timed(lambda: torch.load(os.path.join(root, "ts.pt"), weights_only=True), repeats), "read"))
    rows.append(("local", "dcp.load", timed(lambda: dcp.load(target, checkpoint_id=dcp_dir), repeats), "read"))

    def load() -> None:
        with distckpt.CheckpointManager(ckpt) as m:
            m.load_latest(target)

    rows.append(("local", "distckpt load", timed(load, repeats), "read"))
    return rows


def s3_rows(state: dict, data: bytes, root: str, repeats: int) -> list[tuple[str, str, float, str]]:
    import s3fs
    from seaweed import SeaweedS3

    server = SeaweedS3(os.path.join(root, "seaweedfs")).start()
    try:
        server.make_bucket("bench")
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())
        rows = [("s3", "s3fs pipe (one object)", timed(lambda: fs.pipe_file("bench/raw.bin", data), repeats), "write")]
        step = iter(range(10**6))

        def save() -> None:
            with distckpt.CheckpointManager("s3://bench/run", storage_options=server.storage_options(), keep_last=1) as m:
                m.save(next(step), state)

        rows.append(("s3", "distckpt save", timed(save, repeats), "write"))
        rows.append(("s3", "s3fs cat (one object)", timed(lambda: fs.cat_file("bench/raw.bin"), repeats), "read"))
        target = {k: torch.empty_like(v) for k, v in state.items()}

        def load() -> None:
            with distckpt.CheckpointManager("s3://bench/run", storage_options=server.storage_options()) as m:
                m.load_latest(target)

        rows.append(("s3", "distckpt load", timed(load, repeats), "read"))
        return rows
    finally:
        server.stop()


def render(rows: list[tuple[str, str, float, str]], nbytes: int) -> str:
    base = {("local", "write"): "raw write + fsync", ("local", "read"): "raw read",
            ("s3", "write"): "s3fs pipe (one object)", ("s3", "read"): "s3fs cat (one object)",
            ("local", "stall"): "raw write + fsync"}
    by_name = {(m, n): s for m, n, s, _ in rows}
    lines = [f"| medium | what | median s | MiB/s | vs. baseline |", "|---|---|---:|---:|---:|"]
    for medium, name, seconds, kind in rows:
        ref = by_name[(medium, base[(medium, kind)])]
        ratio = ref / seconds if kind != "stall" else seconds / ref
        note = f"{ratio:.2f}x" + (" of the write time" if kind == "stall" else "")
        lines.append(f"| {medium} | {name} | {seconds:.3f} | {nbytes / 2**20 / seconds:,.0f} | {note} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-s3", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    state = make_state(args.mib)
    data = payload(state)
    root = tempfile.mkdtemp(prefix="distckpt-bench-")
    try:
        rows = local_rows(state, data, root, args.repeats)
        if not args.no_s3:
            rows += s3_rows(state, data, root, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"state: {len(state)} float32 tensors, {len(data) / 2**20:.0f} MiB; median of {args.repeats}; "
          f"{os.cpu_count()} CPUs; torch {torch.__version__}")
    print(render(rows, len(data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
