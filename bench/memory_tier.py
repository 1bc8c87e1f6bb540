"""The memory tier: how long a resume takes from a node's shared memory against from S3.

    python bench/memory_tier.py [--mib 256] [--repeats 5]

A state of `mib` MiB (16 tensors) is saved once to S3 (SeaweedFS on loopback, as in the tests)
with `memory_tier=True`, so it is committed on S3 and in shared memory (/dev/shm). Then, in
rounds interleaved, a fresh process (interpreter start, manager, `load_latest`, close) resumes it
(a) from the memory tier and (b) from S3, the memory copy moved away (a node that lost its memory:
the load falls back to the durable tier, as without a memory tier). Reported: the medians of
load_latest alone, the whole process, and its peak RSS; ratios against the S3 resume of the same run.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "launch"))

RESUME_SCRIPT = """
import resource, sys, time, warnings, torch, distckpt
start = time.perf_counter()
url, mib = sys.argv[1], int(sys.argv[2])
state = {f"t{i}": torch.empty(mib * 2**18 // 16) for i in range(16)}
mgr = distckpt.CheckpointManager(url, memory_tier=True)
built = time.perf_counter()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the fallback's warning, in the S3 rows
    progress = mgr.load_latest(state)
loaded = time.perf_counter()
mgr.close()
torch.manual_seed(0)
expected = torch.randn(mib * 2**18 // 16)
assert torch.equal(state["t0"], expected), "the resumed state is not the saved one"
print(progress.tier, built - start, loaded - built, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
"""

SAVE_SCRIPT = """
import sys, torch, distckpt
url, mib = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
state = {f"t{i}": torch.randn(mib * 2**18 // 16) for i in range(16)}
with distckpt.CheckpointManager(url, memory_tier=True) as mgr:
    mgr.save(1, state)
"""


def _python(script: str, *args: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", script, *args], env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def resume_rows(server, mib: int, repeats: int) -> list[str]:
    shm = tempfile.mkdtemp(prefix="distckpt-bench-", dir="/dev/shm")
    memory, kept = os.path.join(shm, "node0"), os.path.join(shm, "kept")
    env = {**server.env(), "DISTCKPT_MEMORY_DIR": memory}
    url = "s3://bench/memory-resume"
    try:
        subprocess.run([sys.executable, "-c", SAVE_SCRIPT, url, str(mib)], check=True,
                       env={**os.environ, **env, "OMP_NUM_THREADS": "1"})
        os.rename(memory, kept)
        rows: dict[str, dict[str, list[float]]] = {t: {"load": [], "wall": [], "rss": []} for t in ("memory", "durable")}
        for _ in range(repeats + 1):  # the first round warms the page cache and the server: not counted
            for tier in ("memory", "durable"):
                if tier == "memory":
                    shutil.copytree(kept, memory)
                start = time.perf_counter()
                got, _build, inner, rss = _python(RESUME_SCRIPT, url, str(mib), env=env).split()
                wall = time.perf_counter() - start
                shutil.rmtree(memory, ignore_errors=True)
                if got != tier:
                    raise RuntimeError(f"expected a resume from the {tier} tier, got {got}")
                for name, value in (("load", float(inner)), ("wall", wall), ("rss", float(rss))):
                    rows[tier][name].append(value)
        med = {t: {k: statistics.median(v[1:]) for k, v in r.items()} for t, r in rows.items()}
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    m, s = med["memory"], med["durable"]
    return [f"| resume in a fresh process ({mib} MiB, 16 tensors) | load_latest, median s | vs from S3 "
            "| whole process incl. interpreter and torch import, s | vs from S3 | peak RSS, MiB |",
            "|---|---:|---:|---:|---:|---:|",
            f"| from the memory tier (/dev/shm) | {m['load']:.3f} | {s['load'] / m['load']:.2f}x faster "
            f"| {m['wall']:.3f} | {s['wall'] / m['wall']:.2f}x faster | {m['rss']:.0f} |",
            f"| from S3 (memory copy gone) | {s['load']:.3f} | 1.00x | {s['wall']:.3f} | 1.00x | {s['rss']:.0f} |"]


def memory_tables(root: str, mib: int = 256, repeats: int = 5) -> str:
    from seaweed import SeaweedS3

    server = SeaweedS3(os.path.join(root, "seaweedfs")).start()
    try:
        server.make_bucket("bench")
        return "\n".join(resume_rows(server, mib, repeats))
    finally:
        server.stop()


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="distckpt-memory-bench-")
    try:
        print(f"command: python bench/memory_tier.py --mib {args.mib} --repeats {args.repeats}")
        print(memory_tables(work, args.mib, args.repeats))
    finally:
        shutil.rmtree(work, ignore_errors=True)
