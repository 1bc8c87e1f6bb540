"""Where a verified load's extra time goes: a 256 MiB load with and without a verify key, with
BLAKE3 on one thread or on the rank's cores, with and without the destination prefault thread.

    python bench/verify_profile.py [--mib 256] [--rounds 7]

Each measurement a fresh process, the variants alternating within every round; columns: the
`load_latest()` call and, inside it, the verify pass (`verify_read`) and the signature check
(`check_step`), medians in seconds. The variants replace library functions in the child only
(`checksums.digest_threads`, `loading.Prefault`): a measurement aid, not a setting.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from signing import HERE, child, keys  # bench/signing.py: the same state, saves and keys

_CHILD = r"""
import json, sys, time
import torch, distckpt
import distckpt.io.reading as reading
import distckpt.protocol.loading as loading
from distckpt.io import checksums, signing
root, mib, key, threads, prefault = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None, sys.argv[4], sys.argv[5]
spent = {"verify_read": 0.0, "check_step": 0.0}
def timed(module, name):
    inner = getattr(module, name)
    def run(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - started
    setattr(module, name, run)
timed(reading, "verify_read")
timed(signing, "check_step")
if threads != "auto":
    checksums.digest_threads = lambda n: int(threads)
if prefault == "off":
    class Off:
        def __init__(self, tensors): pass
        def stop(self): pass
    loading.Prefault = Off
n = 16
target = {f"layer{i}.weight": torch.empty(mib * 2**20 // 4 // n) for i in range(n)}
with distckpt.CheckpointManager(root, verify_key=key) as mgr:
    started = time.perf_counter(); mgr.load_latest(target); spent["load"] = time.perf_counter() - started
print(json.dumps(spent))
"""

VARIANTS = (("load", False, "auto", "on"), ("load verified", True, "auto", "on"),
            ("load verified, 1 thread", True, "1", "on"), ("load, no prefault", False, "auto", "off"),
            ("load verified, no prefault", True, "auto", "off"),
            ("load verified, 1 thread, no prefault", True, "1", "off"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    base = tempfile.mkdtemp(prefix="distckpt-verify-profile-")
    try:
        private, public = keys(base)
        roots = {False: os.path.join(base, "plain"), True: os.path.join(base, "signed")}
        child("save", roots[False], args.mib, "")
        child("save", roots[True], args.mib, private)
        got: dict[str, list[dict[str, float]]] = {name: [] for name, *_ in VARIANTS}
        env = {**os.environ, "PYTHONPATH": HERE}
        for r in range(args.rounds + 1):  # round 0 warms the page cache and the imports
            for name, verified, threads, prefault in VARIANTS:
                out = subprocess.run([sys.executable, "-c", _CHILD, roots[verified], str(args.mib),
                                      public if verified else "", threads, prefault],
                                     capture_output=True, text=True, timeout=600, check=True, env=env, cwd=base)
                if r:
                    got[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"| {args.mib} MiB, fresh processes, median of {args.rounds} | load s | verify pass s | signature s |")
        print("|---|---:|---:|---:|")
        for name, rows in got.items():
            med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
            print(f"| {name} | {med['load']:.3f} | {med['verify_read']:.3f} | {med['check_step']:.4f} |")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
