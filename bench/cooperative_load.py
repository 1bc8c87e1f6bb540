"""Cooperative loads: bytes moved from S3 and time, and whether they pay off on local disk.

    python bench/cooperative_load.py [--ranks 4] [--mib 32] [--rounds 5] [--compare PYTHONPATH] [--no-s3]

S3 rows: one SeaweedFS server on loopback (started here) behind a byte-counting proxy
(tests/helpers/faultproxy.py). A fresh `torchrun --standalone --nproc-per-node N` saves a
replicated state of --mib MiB, then loads it --rounds times after one warm-up load; the row gives
the median load time (from a barrier to the slowest rank's return) and the bytes the proxy
returned to the ranks per load, as a multiple of the state's bytes. With --compare, the same
with that PYTHONPATH (another checkout, e.g. the code before cooperative loads), in the same run.

Local-disk rows: the same state in a local directory, loaded each way, interleaved: `direct`
(every rank maps the file, as loads from local paths do) and `cooperative` (forced: the ranks
split the file, read their ranges and exchange them over gloo, as loads from object stores do).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def s3_worker(url: str, options: dict, mib: float, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    import distckpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(int(mib * 2**20) // 4, generator=g)}
    times = []
    with distckpt.CheckpointManager(url, storage_options=options, timeout=300) as mgr:
        mgr.save(1, state)
        for i in range(rounds + 1):
            target = {"w": torch.empty_like(state["w"])}
            _handshake(f"LOAD {i}")  # the driver resets the proxy's counters
            started = time.perf_counter()
            mgr.load(target, 1)
            took = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if i:
                times.append(float(took.item()))
            _handshake(f"DONE {i}")  # the driver reads the counters
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"load": statistics.median(times)}), flush=True)
    dist.destroy_process_group()


def _handshake(line: str) -> None:
    """Rank 0 says `line` to the driver and waits for its answer; every rank waits for rank 0."""
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        print(line, flush=True)
        input()
    dist.barrier()


def s3_row(ranks: int, mib: float, rounds: int, pythonpath: str) -> dict[str, float]:
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "helpers"))
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "launch"))
    from faultproxy import FaultProxy
    from seaweed import SeaweedS3

    with tempfile.TemporaryDirectory() as root:
        server = SeaweedS3(os.path.join(root, "seaweedfs")).start()
        proxy = FaultProxy(server.s3_port).start()
        try:
            server.make_bucket("bench")
            options = server.storage_options(proxy.endpoint)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                   os.path.abspath(__file__), "--s3-worker", "--root", "s3://bench/run", "--options",
                   json.dumps(options), "--mib", str(mib), "--rounds", str(rounds)]
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True)
            moved, result = [], None
            assert proc.stdin is not None and proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("LOAD "):
                    proxy.clear()
                elif line.startswith("DONE "):
                    if line.strip() != "DONE 0":  # the warm-up load left out
                        moved.append(proxy.received)
                else:
                    if line.startswith("RESULT "):
                        result = json.loads(line[len("RESULT "):])
                    continue
                proc.stdin.write("\n")
                proc.stdin.flush()
            proc.wait()
        finally:
            proxy.stop()
            server.stop(grace_s=2)
    if result is None:
        raise SystemExit(f"{ranks} ranks on S3: no result (exit {proc.returncode})")
    return {"load": result["load"], "moved": statistics.median(moved) / (int(mib * 2**20) // 4 * 4)}


def worker(root: str, mib: float, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    import distckpt
    from distckpt.protocol import cooperative
    from distckpt.storage.local import LocalStorage

    torch.set_num_threads(1)
    dist.init_process_group("gloo")

    def read_range(self: LocalStorage, path: str, start: int, end: int, put: object) -> None:
        with open(self._abs(path), "rb") as f:
            f.seek(start)
            put(start, f.read(end - start))  # type: ignore[operator]

    LocalStorage.read_range = read_range  # type: ignore[attr-defined]
    direct = cooperative.cooperates
    forced = lambda coord, storage: coord.world_size > 1  # noqa: E731
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(int(mib * 2**20) // 4, generator=g)}
    times: dict[str, list[float]] = {"direct": [], "cooperative": []}
    with distckpt.CheckpointManager(root, timeout=300) as mgr:
        mgr.save(1, state)
        for i in range(rounds + 1):
            for how, rule in (("direct", direct), ("cooperative", forced)):
                cooperative.cooperates = rule  # type: ignore[assignment]
                target = {"w": torch.empty_like(state["w"])}
                dist.barrier()
                started = time.perf_counter()
                mgr.load(target, 1)
                took = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                if i:
                    times[how].append(float(took.item()))
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({k: statistics.median(v) for k, v in times.items()}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--mib", type=float, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compare", default=None, help="PYTHONPATH of another checkout, measured alike (S3 rows)")
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--s3-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--options", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.root, args.mib, args.rounds)
        return
    if args.s3_worker:
        s3_worker(args.root, json.loads(args.options), args.mib, args.rounds)
        return
    print("| what | load ms | bytes from storage per load / state |\n|---|---:|---:|")
    if not args.no_s3:
        here = os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")
        for name, path in [("this checkout", here)] + ([("compared", args.compare)] if args.compare else []):
            got = s3_row(args.ranks, args.mib, args.rounds, path)
            print(f"| {args.ranks} ranks, {args.mib:g} MiB, S3 ({name}) | {got['load'] * 1e3:.0f} | "
                  f"{got['moved']:.2f}x |", flush=True)
    with tempfile.TemporaryDirectory() as root:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
               os.path.abspath(__file__), "--worker", "--root", os.path.join(root, "run"),
               "--mib", str(args.mib), "--rounds", str(args.rounds)]
        out = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    result = next((json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")), None)
    if result is None:
        raise SystemExit(f"no result (exit {out.returncode}):\n{out.stderr[-3000:]}")
    for how in ("direct", "cooperative"):
        print(f"| {args.ranks} ranks, {args.mib:g} MiB, local disk, {how} | {result[how] * 1e3:.0f} "
              f"({result[how] / result['direct']:.2f}x direct) | - |")


if __name__ == "__main__":
    main()
