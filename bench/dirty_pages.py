"""A local save's peak dirty page cache, with and without starting the disk early.

    python bench/dirty_pages.py [--mib 1024] [--repeats 3]

Each save runs in a process of its own (a fresh 1 GiB state of 16 float32 tensors) while a thread
samples /proc/meminfo's Dirty + Writeback every 10 ms; "without" turns off the windowed early
writeback of storage/local.py (sync_file_range), so the file stays dirty until the fsync. The
peak is system-wide: run it on an otherwise quiet machine. Linux only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, tempfile, threading, time
import torch
import distckpt
import distckpt.storage.local as local

mib, root, early = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "with"
if not early:
    local._SYNC_FILE_RANGE = None
state = {f"t{i}": torch.randn(mib * 2**18 // 16) for i in range(16)}
peak, done = [0], threading.Event()


def in_flight_kib():
    with open("/proc/meminfo") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith(("Dirty:", "Writeback:")))


def sample():
    while not done.is_set():
        peak[0] = max(peak[0], in_flight_kib())
        time.sleep(0.01)


thread = threading.Thread(target=sample)
thread.start()
start = time.perf_counter()
with distckpt.CheckpointManager(root) as mgr:
    mgr.save(1, state)
seconds = time.perf_counter() - start
done.set()
thread.join()
print(json.dumps({"seconds": seconds, "peak_mib": peak[0] / 1024}))
"""


def dirty_table(mib: int, repeats: int) -> str:
    samples: dict[str, list[dict[str, float]]] = {"with": [], "without": []}
    for _ in range(repeats):
        for mode in samples:
            subprocess.run(["sync"], check=True)
            with tempfile.TemporaryDirectory(prefix="distckpt-dirty-") as root:
                out = subprocess.run([sys.executable, "-c", CHILD, str(mib), root, mode],
                                     capture_output=True, text=True, check=True)
            samples[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    lines = [f"| {mib} MiB save, fresh process | median s | peak dirty + writeback, MiB |", "|---|---:|---:|"]
    for mode, runs in samples.items():
        lines.append(f"| {mode} early writeback | {statistics.median(r['seconds'] for r in runs):.3f} | "
                     f"{statistics.median(r['peak_mib'] for r in runs):.0f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(dirty_table(args.mib, args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
