"""Peak extra host memory of an async save on each rank, and the time save() holds training.

4 ranks (fresh processes, gloo), a replicated state (a module's parameters, DDP-style: the
same on every rank) of --mib MiB. Each rank builds its manager, resets its peak RSS
(/proc/self/clear_refs) and notes its RSS, runs two async saves (the first allocates the
staging buffers and starts the writer; the second, timed, reuses them), waits for them, and
reports VmHWM minus that RSS: the host memory the saves added at their peak
(staging buffers are kept between saves, so this is what a training job holds). The stall is
the second save() on rank 0. Configurations: today's staging (rank 0 stages the
whole replicated state), split writes (each rank stages what it writes), staging_bytes
bounds, and the writer process.

    python bench/staging_memory.py [--ranks 4] [--mib 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CONFIGS = [
    ("async, no bound (today)", {}),
    ("async, split_writes", {"split_writes": True}),
    ("async, staging_bytes=0.25x", {"staging_fraction": 0.25}),
    ("async, staging_bytes=0.1x", {"staging_fraction": 0.1}),
    ("async, split_writes + staging_bytes=0.1x", {"split_writes": True, "staging_fraction": 0.1}),
    ("async, writer=process", {"writer": "process"}),
    ("async, writer=process + staging_bytes=0.1x", {"writer": "process", "staging_fraction": 0.1}),
]


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def worker(rank: int, world: int, port: int, mib: int, options: dict, root: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    import distckpt

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    layers = max(1, mib // 4)  # 1024x1024 float32: 4 MiB each
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(layers)])
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    fraction = options.pop("staging_fraction", None)
    if fraction is not None:
        options["staging_bytes"] = int(state_bytes * fraction)
    mgr = distckpt.CheckpointManager(root, async_save=True, keep_last=1, timeout=300, **options)
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status("VmRSS")
    mgr.save(0, {"model": model})  # the first save: buffers allocated, the writer's group (and process) started
    mgr.wait()
    t0 = time.perf_counter()
    mgr.save(1, {"model": model})  # the one timed: buffers reused
    stall = time.perf_counter() - t0
    mgr.wait()
    peak = _status("VmHWM")
    mgr.close()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"rank": rank, "extra": peak - before, "state": state_bytes, "stall_s": stall}, f)


def run(ranks: int, mib: int, options: dict) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="distckpt-staging-mem-")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(ranks), str(port), str(mib),
                               json.dumps(options), os.path.join(tmp, "ckpt"), os.path.join(tmp, f"r{r}.json")], env=env)
             for r in range(ranks)]
    for p in procs:
        if p.wait(600) != 0:
            raise RuntimeError(f"a rank failed ({p.returncode})")
    return [json.load(open(os.path.join(tmp, f"r{r}.json"))) for r in range(ranks)]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, world, port, mib = map(int, sys.argv[2:6])
        worker(rank, world, port, mib, json.loads(sys.argv[6]), sys.argv[7], sys.argv[8])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    print(f"{os.cpu_count()} CPUs; command: python bench/staging_memory.py --ranks {args.ranks} --mib {args.mib} "
          f"--rounds {args.rounds}")
    print("| configuration | peak extra host memory, max over ranks (x state) | per rank (x state) | "
          "save() stall, rank 0 (ms) |")
    print("|---|---:|---|---:|")
    results: dict[str, list[list[dict]]] = {label: [] for label, _ in CONFIGS}
    for _ in range(args.rounds):  # interleaved
        for label, options in CONFIGS:
            results[label].append(run(args.ranks, args.mib, dict(options)))
    for label, _ in CONFIGS:
        rounds = results[label]
        worst = statistics.median(max(r["extra"] / r["state"] for r in rnd) for rnd in rounds)
        per_rank = [statistics.median(rnd[i]["extra"] / rnd[i]["state"] for rnd in rounds) for i in range(args.ranks)]
        stall = statistics.median(rnd[0]["stall_s"] for rnd in rounds) * 1e3
        print(f"| {label} | {worst:.2f}x | {', '.join(f'{x:.2f}' for x in per_rank)} | {stall:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
