"""Incremental checkpoints against full ones, in the same run, on local disk and on S3.

* LoRA-like: a frozen base (`--base-mib`, 64 tensors), 4 MiB of trainable adapters and their
  AdamW moments, saved every step: bytes written per save and seconds per save, after the first.
* Fully trained: every tensor changes before every save: the cost of hashing for nothing.
* Storage: what keep_last=5 occupies after 10 saves of the LoRA-like state.

Seconds are medians over the saves after the first (the first writes everything in both modes).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "launch"))

import distckpt  # noqa: E402


def lora_state(base_mib: int) -> dict:
    torch.manual_seed(0)
    base = {f"base{i}": torch.randn(base_mib * 2**18 // 64) for i in range(64)}
    adapters = [torch.nn.Parameter(torch.randn(2**18)) for _ in range(4)]  # 4 x 1 MiB = 4 MiB
    opt = torch.optim.AdamW(adapters, lr=1e-3)
    return {"base": base, "adapters": adapters, "optimizer": opt}


def step_adapters(state: dict) -> None:
    for p in state["adapters"]:
        p.grad = torch.ones_like(p)
    state["optimizer"].step()


def step_everything(state: dict) -> None:
    step_adapters(state)
    for t in state["base"].values():
        t.add_(1e-3)


def root_bytes(storage_root: str, fs=None) -> int:
    if fs is not None:
        return sum(info["size"] for info in fs.find(storage_root, detail=True).values())
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs_ in os.walk(storage_root) for f in fs_)


def run(url: str, state: dict, change, incremental: bool, saves: int, options: dict | None,
        keep_last: int | None = None, fs=None, path: str | None = None) -> tuple[list[float], list[int]]:
    """Seconds and bytes added per save (bytes: growth of the root, before retention)."""
    seconds, written = [], []
    with distckpt.CheckpointManager(url, incremental=incremental, keep_last=keep_last,
                                    storage_options=options) as mgr:
        mgr.load_latest({})
        for step in range(saves):
            change(state)
            before = root_bytes(path, fs) if keep_last is None else 0
            start = time.perf_counter()
            mgr.save(step, state)
            seconds.append(time.perf_counter() - start)
            written.append(root_bytes(path, fs) - before if keep_last is None else 0)
    return seconds, written


def table(rows: list[tuple[str, str, float, float, float, float]]) -> str:
    lines = ["| storage | state | full save s | incremental save s | time ratio | bytes ratio |", "|---|---|---:|---:|---:|---:|"]
    for where, what, full_s, inc_s, full_b, inc_b in rows:
        lines.append(f"| {where} | {what} | {full_s:.3f} | {inc_s:.3f} | {inc_s / full_s:.3f}x | {inc_b / full_b:.4f}x |")
    return "\n".join(lines)


def measure(where: str, make_url, base_mib: int, saves: int, options: dict | None, fs=None) -> tuple[list, str]:
    rows = []
    for what, change in (("LoRA-like (frozen base, adapters train)", step_adapters),
                         ("fully trained (every tensor changes)", step_everything)):
        results = {}
        for incremental in (False, True):
            url, path = make_url(f"{what[:4]}-{incremental}")
            state = lora_state(base_mib)
            secs, written = run(url, state, change, incremental, saves, options, fs=fs, path=path)
            results[incremental] = (statistics.median(secs[1:]), statistics.median(written[1:]))
        rows.append((where, what, results[False][0], results[True][0], results[False][1], results[True][1]))
    storage = {}
    for incremental in (False, True):
        url, path = make_url(f"keep5-{incremental}")
        run(url, lora_state(base_mib), step_adapters, incremental, 10, options, keep_last=5, fs=fs, path=path)
        storage[incremental] = root_bytes(path, fs)
    note = (f"{where}: keep_last=5 after 10 saves of the LoRA-like state occupies {storage[True] / 2**20:,.0f} MiB "
            f"incremental vs {storage[False] / 2**20:,.0f} MiB full ({storage[True] / storage[False]:.3f}x)")
    return rows, note


def incremental_tables(work: str, base_mib: int = 256, saves: int = 6, s3: bool = True) -> str:
    """The table and the storage lines, measured under `work` (and a SeaweedFS started there)."""
    local = lambda tag: (os.path.join(work, tag), os.path.join(work, tag))  # noqa: E731
    rows, notes = [], []
    r, n = measure("local disk", local, base_mib, saves, None)
    rows += r
    notes.append(n)
    if s3:
        import s3fs
        from seaweed import SeaweedS3

        server = SeaweedS3(os.path.join(work, "seaweedfs")).start()
        try:
            server.make_bucket("bench")
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())
            s3_url = lambda tag: (f"s3://bench/{tag.replace(' ', '-')}", f"bench/{tag.replace(' ', '-')}")  # noqa: E731
            r, n = measure("S3 (SeaweedFS, loopback)", s3_url, base_mib, saves, server.storage_options(), fs)
            rows += r
            notes.append(n)
        finally:
            server.stop()
    head = (f"incremental: {base_mib} MiB frozen base in 64 tensors, 4 MiB adapters + AdamW moments; "
            f"medians of saves 2-{saves}")
    return "\n".join([head, table(rows), *[f"* {n}" for n in notes]])


def main() -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-mib", type=int, default=256)
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--no-s3", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="distckpt-inc-bench-")
    try:
        text = incremental_tables(work, args.base_mib, args.saves, not args.no_s3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"command: python bench/incremental.py --base-mib {args.base_mib} --saves {args.saves}"
          + (" --no-s3" if args.no_s3 else ""))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
