"""Saving and loading a state that lives on a GPU, against the baselines a GPU job would use.

    python bench/gpu.py [--mib 1024 4096] [--repeats 3]

The state is a dict of 16 fp32 tensors on cuda:0. Save rows: distckpt's save (the copy to the
host, checksums, write, fsync, commit), torch.save of the same dict (+ fsync + rename) and
dcp.save. Load rows, into the existing GPU tensors: distckpt's load, torch.load(map_location=
"cuda") + copy into the tensors, dcp.load (in place). Medians after one warm-up round,
interleaved; every timing ends with a device synchronisation. Needs CUDA.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from baselines import torch_save_durably  # noqa: E402
from run import interleaved  # noqa: E402

import distckpt  # noqa: E402


def gpu_state(mib: int) -> dict[str, torch.Tensor]:
    n = 16
    g = torch.Generator(device="cuda").manual_seed(0)
    return {f"layer{i}.weight": torch.randn(mib * 2**20 // 4 // n, generator=g, device="cuda") for i in range(n)}


def synced(fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        fn()
        torch.cuda.synchronize()
    return run


def rows(mib: int, repeats: int, root: str) -> list[str]:
    import torch.distributed.checkpoint as dcp

    state = gpu_state(mib)
    mgr = distckpt.CheckpointManager(os.path.join(root, "distckpt"), keep_last=1)
    steps = iter(range(10**6))
    torch_path, dcp_dir = os.path.join(root, "torch.pt"), os.path.join(root, "dcp")

    def dcp_save() -> None:
        shutil.rmtree(dcp_dir, ignore_errors=True)
        dcp.save(state, checkpoint_id=dcp_dir)

    save = interleaved({"distckpt save": synced(lambda: mgr.save(next(steps), {"state": state})),
                        "torch.save + fsync": synced(lambda: torch_save_durably(state, torch_path)),
                        "dcp.save": synced(dcp_save)}, repeats)
    target = {"state": {k: torch.empty_like(v) for k, v in state.items()}}

    def torch_load() -> None:
        loaded = torch.load(torch_path, map_location="cuda")
        for k, v in target["state"].items():
            v.copy_(loaded[k])

    load = interleaved({"distckpt load": synced(lambda: mgr.load_latest(target)),
                        "torch.load + copy": synced(torch_load),
                        "dcp.load (in place)": synced(lambda: dcp.load(target["state"], checkpoint_id=dcp_dir))},
                       repeats)
    mgr.close()
    assert all(torch.equal(target["state"][k], v) for k, v in state.items()), "a load came back different"
    out = []
    for kind, times, base in (("save", save, "torch.save + fsync"), ("load", load, "torch.load + copy")):
        for name, t in times.items():
            out.append(f"| {mib} MiB | {kind} | {name} | {t:.3f} | {t / times[base]:.2f}x | "
                       f"{mib / 1024 / t:.2f} |")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu.py needs CUDA: no CUDA device on this machine")
        return 2
    print(f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPUs; median of {args.repeats}; command: "
          f"python bench/gpu.py --mib {' '.join(map(str, args.mib))} --repeats {args.repeats}")
    print("| state on the GPU | direction | method | seconds | vs torch | GiB/s |\n|---|---|---|---:|---:|---:|")
    for mib in args.mib:
        root = tempfile.mkdtemp(prefix="distckpt-gpu-bench-")
        try:
            print("\n".join(rows(mib, args.repeats, root)), flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
