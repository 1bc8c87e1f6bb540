"""The verify pass of a load alone: one mapped file hashed as `verify_file` hashes it (8 MiB
pieces, each piece's pages let go once hashed), warm page cache, in one process.

    python bench/digest_pass.py [--mib 256] [--rounds 25]

Rows: xxh3 (an unverified load), BLAKE3 on one thread, BLAKE3 on every core of the machine
(a verified load uses `checksums.digest_threads`: the rank's cores less one). Median and minimum seconds over the
rounds, the rows alternating within every round; the minimum is the least disturbed by other jobs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any, Callable

from distckpt.io import checksums, signing
from distckpt.io import manifest as mf
from distckpt.storage import open_storage, release_pages


def timed(storage: Any, record: dict[str, Any], digest: bool) -> float:
    data = storage.read_buffer("f")
    started = time.perf_counter()
    mf.verify_file(data, record, "f", lambda start, n: release_pages(data, start, n), digest=digest)
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=25)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="distckpt-digest-bench-") as root:
        raw = os.urandom(args.mib << 20)
        with open(os.path.join(root, "f"), "wb") as f:
            f.write(raw)
        record = {"size": len(raw), "xxh3_64": mf.checksum_of(raw), signing.DIGEST: signing.digest_of(raw)}
        del raw
        storage = open_storage(root)
        threads = max(2, os.cpu_count() or 2)
        chosen = checksums.digest_threads

        def on(n: int) -> float:
            checksums.digest_threads = lambda size: n  # type: ignore[assignment]
            try:
                return timed(storage, record, True)
            finally:
                checksums.digest_threads = chosen  # type: ignore[assignment]

        rows: dict[str, Callable[[], float]] = {
            "xxh3": lambda: timed(storage, record, False),
            "BLAKE3, 1 thread": lambda: on(1),
            f"BLAKE3, {threads} threads": lambda: on(threads),
        }

        times: dict[str, list[float]] = {name: [] for name in rows}
        for r in range(args.rounds + 1):  # round 0 warms the page cache
            for name, run in rows.items():
                took = run()
                if r:
                    times[name].append(took)
        print(f"| verify pass, {args.mib} MiB mapped ({args.rounds} rounds) | median s | min s |")
        print("|---|---:|---:|")
        for name, got in times.items():
            print(f"| {name} | {statistics.median(got):.3f} | {min(got):.3f} |")


if __name__ == "__main__":
    main()
