"""The cost of signed checkpoints: a 256 MiB save and load with and without keys, same run.

    python bench/signing.py [--mib 256] [--rounds 7] [--root DIR] [--compare CHECKOUT] [--s3]

Each measurement is a fresh process (python -c), so no page cache of the process, no warm
hashers and no earlier manager help either row; the two modes alternate within every round
(this VM's disk speed drifts over a minute). Rows: median seconds of `save()` and of
`load_latest()` (the call alone, after the manager is built), and the ratio of signed to unsigned.
Signed: `signing_key=` on save (BLAKE3 digests + Ed25519 signature), `verify_key=` on load
(signature + every file's BLAKE3 checked in the checksum's pass).

The ratio column is of the medians; "per-round ratio" gives the quartiles of each round's own
ratio (signed over unsigned within one round), the noise a shared machine adds. `--compare DIR`
(another checkout of distckpt, e.g. `git archive <commit> | tar -x -C DIR`) runs the same rows
with that version too, interleaved in every round, each version's rows against its own baseline.
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
    with distckpt.CheckpointManager(root, signing_key=key) as mgr:  # S3 (--s3): the server's AWS_* variables
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


HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout


S3_ENV: dict[str, str] = {}  # --s3: the SeaweedFS server's credentials and endpoint, for every child


def child(mode: str, root: str, mib: int, key: str, checkout: str = HERE, cwd: str | None = None) -> dict:
    """One measurement in a fresh process importing distckpt from `checkout` (run from its
    temporary directory, so no working directory's copy shadows it)."""
    env = {**os.environ, **S3_ENV, "PYTHONPATH": checkout}
    out = subprocess.run([sys.executable, "-c", _CHILD, mode, root, str(mib), key], capture_output=True,
                         text=True, timeout=600, check=True, env=env, cwd=cwd or os.path.dirname(root))
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


ROWS = (("save", None), ("save signed", "save"), ("load", None), ("load verified", "load"))


def one_round(base: str, versions: dict[str, str], mib: int, private: str, public: str,
              bucket: str | None = None, round_no: int = 0) -> dict[str, dict]:
    """Every row of every version once, the versions interleaved: {row (version): child's answer}.
    With `bucket` (--s3) the roots are in it, new ones every round (nothing is removed there)."""
    got: dict[str, dict] = {}

    def root_of(name: str) -> str:
        leaf = (name + tag).replace(" ", "-").replace("(", "").replace(")", "")
        return f"s3://{bucket}/r{round_no}-{leaf}" if bucket else os.path.join(base, leaf)

    for tag, checkout in versions.items():
        for name, key in (("save", ""), ("save signed", private)):
            root = root_of(name)
            if not bucket:
                shutil.rmtree(root, ignore_errors=True)
            got[name + tag] = child("save", root, mib, key, checkout, cwd=base)
    for tag, checkout in versions.items():
        for name, saved, key in (("load", "save", ""), ("load verified", "save signed", public)):
            got[name + tag] = child("load", root_of(saved), mib, key, checkout, cwd=base)
    return got


def quartiles(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}" if values else "-"
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return f"{q1:.3f} / {q2:.3f} / {q3:.3f}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--root", default=None)
    p.add_argument("--compare", default=None, metavar="CHECKOUT",
                   help="another checkout of distckpt whose rows are measured in the same rounds")
    p.add_argument("--s3", action="store_true", help="save to and load from S3 (SeaweedFS on loopback, started "
                   "here) instead of local disk: a verified load's hash beside the download")
    args = p.parse_args()
    versions = {"": HERE}
    if args.compare:
        if not os.path.isfile(os.path.join(args.compare, "distckpt", "__init__.py")):
            p.error(f"--compare {args.compare}: no distckpt/__init__.py there (give a checkout's root)")
        versions[" (compared)"] = os.path.abspath(args.compare)
    base = tempfile.mkdtemp(prefix="distckpt-sign-bench-", dir=args.root)
    server = None
    try:
        if args.s3:
            sys.path.insert(0, os.path.join(HERE, "launch"))
            from seaweed import SeaweedS3

            server = SeaweedS3(os.path.join(base, "seaweedfs")).start()
            server.make_bucket("bench")
            S3_ENV.update(server.env())
        private, public = keys(base)
        rounds: list[dict[str, dict]] = []
        for r in range(args.rounds + 1):  # round 0 warms the disk and the interpreter's imports
            got = one_round(base, versions, args.mib, private, public, "bench" if args.s3 else None, r)
            if r:
                rounds.append(got)
        where = "S3 (SeaweedFS on loopback)" if args.s3 else "local disk"
        print(f"| row ({args.mib} MiB, {where}, fresh processes, median of {args.rounds}) | seconds | "
              "peak RSS MiB | ratio | per-round ratio (quartiles) |")
        print("|---|---|---|---|---|")
        for tag in versions:
            med = {n + tag: statistics.median(g[n + tag]["s"] for g in rounds) for n, _ in ROWS}
            for name, baseline in ROWS:
                row, peak = name + tag, statistics.median(g[name + tag]["peak_mib"] for g in rounds)
                ratio, spread = "1 (baseline)", ""
                if baseline:
                    ratio = f"{med[row] / med[baseline + tag]:.3f}"
                    spread = quartiles([g[row]["s"] / g[baseline + tag]["s"] for g in rounds])
                print(f"| {row} | {med[row]:.3f} | {peak:.0f} | {ratio} | {spread} |")
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
