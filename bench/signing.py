"""The cost of signed checkpoints: a 256 MiB save and load with and without keys, same run.

    python bench/signing.py [--mib 256] [--rounds 7] [--root DIR]

Each measurement is a fresh process (python -c), so no page cache of the process, no warm
hashers and no earlier manager help either row; the two modes alternate within every round
(this VM's disk speed drifts over a minute). Rows: median seconds of `save()` and of
`load_latest()` (the call alone, after the manager is built), and the ratio of signed to unsigned.
Signed: `signing_key=` on save (BLAKE3 digests + Ed25519 signature), `verify_key=` on load
(signature + every file's BLAKE3 checked in the checksum's pass).
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

_CHILD = r"""
import json, os, resource, sys, time
import torch, distckpt
mode, root, mib, key = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] or None
n = 16
g = torch.Generator().manual_seed(0)
state = {f"layer{i}.weight": torch.randn(mib * 2**20 // 4 // n, generator=g) for i in range(n)}
if mode == "save":
    with distckpt.CheckpointManager(root, signing_key=key) as mgr:
        mgr.load_latest({k: torch.empty_like(v) for k, v in state.items()})
        step = 1 + max(mgr.committed_steps(), default=0)
        t0 = time.perf_counter(); mgr.save(step, state); dt = time.perf_counter() - t0
else:
    target = {k: torch.empty_like(v) for k, v in state.items()}
    with distckpt.CheckpointManager(root, verify_key=key) as mgr:
        t0 = time.perf_counter(); progress = mgr.load_latest(target); dt = time.perf_counter() - t0
    assert progress is not None and all(torch.equal(target[k], state[k]) for k in state)
print(json.dumps({"s": dt, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def child(mode: str, root: str, mib: int, key: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode, root, str(mib), key], capture_output=True,
                         text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def keys(folder: str) -> tuple[str, str]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = ed25519.Ed25519PrivateKey.generate()
    private, public = os.path.join(folder, "k.pem"), os.path.join(folder, "k.pub")
    with open(private, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    with open(public, "wb") as f:
        f.write(key.public_key().public_bytes(serialization.Encoding.PEM,
                                              serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--root", default=None)
    args = p.parse_args()
    base = tempfile.mkdtemp(prefix="distckpt-sign-bench-", dir=args.root)
    try:
        private, public = keys(base)
        times: dict[str, list[float]] = {k: [] for k in ("save", "save signed", "load", "load verified")}
        peaks: dict[str, list[float]] = {k: [] for k in times}
        for r in range(args.rounds + 1):  # round 0 warms the disk and the interpreter's imports
            for name, mode, key in (("save", "save", ""), ("save signed", "save", private)):
                root = os.path.join(base, name.replace(" ", "-"))
                shutil.rmtree(root, ignore_errors=True)
                got = child(mode, root, args.mib, key)
                if r:
                    times[name].append(got["s"])
                    peaks[name].append(got["peak_mib"])
            for name, root, key in (("load", "save", ""), ("load verified", "save-signed", public)):
                got = child("load", os.path.join(base, root), args.mib, key)
                if r:
                    times[name].append(got["s"])
                    peaks[name].append(got["peak_mib"])
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"| row ({args.mib} MiB, local disk, fresh processes, median of {args.rounds}) | seconds | "
              "peak RSS MiB | ratio |")
        print("|---|---|---|---|")
        for name, baseline in (("save", None), ("save signed", "save"), ("load", None), ("load verified", "load")):
            ratio = f"{med[name] / med[baseline]:.3f}" if baseline else "1 (baseline)"
            print(f"| {name} | {med[name]:.3f} | {statistics.median(peaks[name]):.0f} | {ratio} |")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
