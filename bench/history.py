"""Cost against history: save, load and listing time on S3 with 10 to 2,000 committed steps.

    python bench/history.py [--steps 10,200,2000] [--repeats 3]

One root on SeaweedFS (loopback) grows to each count in turn: step 1 is a real save of a small
state (1 MiB in 4 tensors and a generator); the steps after it are copies of the newest real save made with
the store's server-side copy and a manifest and marker rewritten for their step (checkpoints
of the newest real save that load and verify like any other: faster to make than 2,000 real saves). At each count, a
new manager (a new process's position: nothing remembered) times `load_latest`, its first
save right after it (with `keep_last` above the count, so retention weighs every step) and a
second save; another times its first save TRAINING_S seconds after its `load_latest` (the
root's listing for retention starts when a load or save does and runs meanwhile); a third
`committed_steps()` alone. Each a median of --repeats; every request is counted through a
counting proxy in front of the server (a row's count includes what a listing made ahead of time
sent while the row ran).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

TRAINING_S = 5.0

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "launch"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "helpers"))

from faultproxy import FaultProxy  # noqa: E402
from seaweed import SeaweedS3  # noqa: E402

import distckpt  # noqa: E402
from distckpt.io import manifest as mf  # noqa: E402

ROOT = "bench/history"


def small_state() -> dict:
    torch.manual_seed(0)
    return {"weights": {f"t{i}": torch.randn(2**16) for i in range(4)}, "gen": torch.Generator().manual_seed(0)}


def forge_steps(fs, source: int, first: int, last: int) -> None:
    """Steps first..last as copies of step `source`, the newest real save (server-side copies,
    manifest and marker rewritten for their step, under its writer's lease)."""
    base1 = f"{ROOT}/{mf.step_dir(source)}"
    manifest = json.loads(fs.cat_file(f"{base1}/{mf.MANIFEST}"))
    marker = mf.Marker.parse(fs.cat_file(f"{base1}/{mf.MARKER}"), base1)
    for start in range(first, last + 1, 200):
        batch = range(start, min(last, start + 199) + 1)
        pairs = [(f"{base1}/{name}", f"{ROOT}/{mf.step_dir(step)}/{name}") for step in batch for name in manifest["files"]]
        fs.copy([src for src, _ in pairs], [dst for _, dst in pairs])
        manifests = {step: mf.manifest_bytes({**manifest, "step": step}) for step in batch}
        fs.pipe({f"{ROOT}/{mf.step_dir(s)}/{mf.MANIFEST}": data for s, data in manifests.items()})
        fs.pipe({f"{ROOT}/{mf.step_dir(s)}/{mf.MARKER}":
                 mf.Marker(s, mf.checksum_of(data), marker.run_id, marker.generation).to_bytes()
                 for s, data in manifests.items()})


def timed(proxy: FaultProxy, fn, *args) -> tuple[float, int]:
    proxy.log.clear()
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start, len(proxy.log)


def measure(url: str, options: dict, proxy: FaultProxy, count: int, repeats: int) -> dict[str, tuple[float, int]]:
    """Each operation in a new manager, `repeats` times; the saves add steps, removed again after
    (so the next count starts from the same root). Median seconds and requests."""
    samples: dict[str, list[tuple[float, int]]] = {}
    for _ in range(repeats):
        state = small_state()
        with distckpt.CheckpointManager(url, storage_options=options, keep_last=10**6) as mgr:
            loaded: list = []
            samples.setdefault("load_latest", []).append(timed(proxy, lambda out=loaded, s=state: out.append(mgr.load_latest(s))))
            newest = loaded[0].step
            samples.setdefault("first save, right after load_latest", []).append(
                timed(proxy, mgr.save, newest + 1, state))
            samples.setdefault("next save", []).append(timed(proxy, mgr.save, newest + 2, state))
        with distckpt.CheckpointManager(url, storage_options=options, keep_last=10**6) as mgr:
            mgr.load_latest(state)
            time.sleep(TRAINING_S)  # the training between a resume and its first save
            samples.setdefault(f"first save, {TRAINING_S:.0f} s after load_latest", []).append(
                timed(proxy, mgr.save, newest + 3, state))
        with distckpt.CheckpointManager(url, storage_options=options, keep_last=10**6) as mgr:
            samples.setdefault("committed_steps()", []).append(timed(proxy, mgr.committed_steps))
    assert newest >= count
    return {what: (statistics.median(t for t, _ in s), int(statistics.median(n for _, n in s)))
            for what, s in samples.items()}


def history_table(counts: list[int], repeats: int) -> str:
    import s3fs

    with tempfile.TemporaryDirectory() as tmp:
        server = SeaweedS3(os.path.join(tmp, "seaweedfs")).start()
        proxy = FaultProxy(server.s3_port).start()
        try:
            server.make_bucket("bench")
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())
            options = server.storage_options(proxy.endpoint)
            url = f"s3://{ROOT}"
            with distckpt.CheckpointManager(url, storage_options=options) as mgr:
                mgr.load_latest(small_state())
                mgr.save(1, small_state())
            rows, made = [], 1
            for count in sorted(counts):
                forge_steps(fs, made, made + 1, count)
                made = count
                rows.append((count, measure(url, options, proxy, count, repeats)))
                made += 3 * repeats  # the saves measured added steps after `count`
        finally:
            proxy.stop()
            server.stop()
    return render(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="10,200,2000", help="committed-step counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(history_table([int(c) for c in args.steps.split(",")], args.repeats))
    return 0


def render(rows: list[tuple[int, dict[str, tuple[float, int]]]]) -> str:
    first = rows[0][1]
    lines = ["| committed steps | operation | median s | requests | time vs the fewest steps |",
             "|---:|---|---:|---:|---:|"]
    for count, results in rows:
        for what, (seconds, requests) in results.items():
            lines.append(f"| {count:,} | {what} | {seconds:.3f} | {requests} | {seconds / first[what][0]:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
