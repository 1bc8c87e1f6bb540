"""Saves and loads each in a new process, as a resume is: time and peak extra memory.

    python bench/fresh.py [--sizes 64x100,64x2000,64x20000,256x16,512x16,1024x16,2048x16] [--repeats 3] [--cold]

For each state (MiB x tensors, float32, tensors of equal size) every operation runs in its own
Python process that first builds and touches the state, then times the operation alone:

* raw write + fsync of the same bytes (one file, renamed into place, directory synced) / raw read
  of them into fresh tensors (readinto);
* torch.save + fsync + rename / torch.load, and torch.load (plain and mmap=True) + copy into the
  existing state;
* dcp.save / dcp.load (in place into the existing state);
* distckpt: manager construction + save + close / manager + load_latest into the existing state
  + close, and load_latest into a state of fresh (allocated, never touched) tensors.

Every save writes into an empty place: its previous output is removed and the disk synced
before the clock starts, for every method alike.

Peak extra memory is the process's peak resident set during the operation (VmHWM reset through
/proc/self/clear_refs just before it) minus its resident set before it: what a resume costs on top
of the model. Mapped file pages count. With --cold (root only) the page cache is dropped
(`sync; echo 1 > /proc/sys/vm/drop_caches`) before every load, so loads read from the disk.
A full garbage collection runs before every timed operation: the first one after the imports
(~70 ms with torch loaded) is owed by them and would otherwise land in whichever operation
crosses the collector's threshold. Operations run interleaved, one of each per round, and each row is the median of --repeats.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile

from process_cost import run_child

CHILD = r"""
import os, sys
import torch
from process_cost import fsync_dir, measure, report

op, root, mib, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
numel = mib * 2**18 // count


def state_of(fill):
    torch.manual_seed(0)
    if fill == "random":
        return {f"t{i}": torch.randn(numel) for i in range(count)}
    if fill == "zeros":  # allocated and touched: a model built before its weights are loaded
        return {f"t{i}": torch.zeros(numel) for i in range(count)}
    return {f"t{i}": torch.empty(numel) for i in range(count)}  # allocated, never touched


def raw_path():
    return os.path.join(root, "raw.bin")


def raw_write(state):
    with open(raw_path() + ".tmp", "wb") as f:
        for t in state.values():
            f.write(t.numpy().data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(raw_path() + ".tmp", raw_path())
    fsync_dir(root)


def raw_read(_):
    out = {f"t{i}": torch.empty(numel) for i in range(count)}
    with open(raw_path(), "rb", buffering=0) as f:
        for t in out.values():
            f.readinto(t.numpy().data)
    return out


def torch_save(state):
    path = os.path.join(root, "state.pt")
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    fsync_dir(root)


def torch_load(_):
    return torch.load(os.path.join(root, "state.pt"), weights_only=True)


def torch_load_copy(state, mmap=False):
    loaded = torch.load(os.path.join(root, "state.pt"), weights_only=True, mmap=mmap)
    for k, t in state.items():
        t.copy_(loaded[k])


def torch_load_mmap_copy(state):
    torch_load_copy(state, mmap=True)


def dcp_save(state):
    import torch.distributed.checkpoint as dcp
    dcp.save(state, checkpoint_id=os.path.join(root, "dcp"))


def dcp_load(state):
    import torch.distributed.checkpoint as dcp
    dcp.load(state, checkpoint_id=os.path.join(root, "dcp"))


def shutil_rm(path):
    import shutil
    shutil.rmtree(path, ignore_errors=True)


def distckpt_save(state):
    import distckpt
    with distckpt.CheckpointManager(os.path.join(root, "distckpt")) as mgr:
        mgr.load_latest(state)  # an empty root: a new run
        mgr.save(1, state)


def distckpt_load(state):
    import distckpt
    with distckpt.CheckpointManager(os.path.join(root, "distckpt")) as mgr:
        assert mgr.load_latest(state).step == 1


OPS = {"raw write + fsync": (raw_write, "random"), "raw read into fresh tensors": (raw_read, None),
       "torch.save + fsync + rename": (torch_save, "random"), "torch.load (fresh tensors)": (torch_load, None),
       "torch.load + copy into the state": (torch_load_copy, "zeros"),
       "torch.load(mmap=True) + copy into the state": (torch_load_mmap_copy, "zeros"),
       "dcp.save": (dcp_save, "random"), "dcp.load (in place)": (dcp_load, "zeros"),
       "distckpt save": (distckpt_save, "random"), "distckpt load into the state": (distckpt_load, "zeros"),
       "distckpt load into fresh tensors": (distckpt_load, "empty")}
SAVE_OUTPUTS = {"raw write + fsync": ("raw.bin",), "torch.save + fsync + rename": ("state.pt",),
                "dcp.save": ("dcp",), "distckpt save": ("distckpt",)}
fn, fill = OPS[op]
state = state_of(fill) if fill else None
if op.startswith("distckpt"):
    import distckpt  # the import is not the operation's cost (torch's is not either)
import torch.distributed.checkpoint  # noqa: F401
# A save writes into an empty place, every method alike: the previous output is removed and the
# disk synced before the clock starts (unlinking a 1 GiB file and the writeback of another
# method's pages are not the save's cost).
for previous in SAVE_OUTPUTS.get(op, ()):
    path = os.path.join(root, previous)
    shutil_rm(path) if os.path.isdir(path) else os.path.exists(path) and os.remove(path)
if op in SAVE_OUTPUTS:
    os.sync()
kept, measured = measure(lambda: fn(state))
if fill in ("zeros", "empty"):  # a load into the state: it must hold the saved values now
    expected = state_of("random")
    assert all(torch.equal(state[k], expected[k]) for k in state), "loaded values differ"
report(measured)
"""

SAVES = ["raw write + fsync", "torch.save + fsync + rename", "dcp.save", "distckpt save"]
LOADS = ["raw read into fresh tensors", "torch.load (fresh tensors)", "torch.load + copy into the state",
         "torch.load(mmap=True) + copy into the state", "dcp.load (in place)", "distckpt load into the state", "distckpt load into fresh tensors"]


def run(op: str, root: str, mib: int, count: int, cold: bool) -> dict[str, float]:
    if cold and op in LOADS:
        subprocess.run("sync; echo 1 > /proc/sys/vm/drop_caches", shell=True, check=True)
    return run_child(CHILD, [op, root, str(mib), str(count)])


def table(sizes: list[tuple[int, int]], repeats: int, cold: bool, echo: bool = False) -> str:
    """The rows for every size; with `echo`, each size's rows are printed as soon as measured."""
    lines = ["| state | operation | median s | vs baseline | peak extra memory, MiB | x the state |",
             "|---|---|---:|---:|---:|---:|"]
    if echo:
        print("\n".join(lines), flush=True)
    for mib, count in sizes:
        root = tempfile.mkdtemp(prefix="distckpt-fresh-")
        try:
            samples: dict[str, list[dict[str, float]]] = {}
            for op in SAVES:  # one round to create the files the loads read
                run(op, root, mib, count, False)
            for _ in range(repeats):
                for op in SAVES + LOADS:
                    samples.setdefault(op, []).append(run(op, root, mib, count, cold))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        median = {op: statistics.median(s["seconds"] for s in v) for op, v in samples.items()}
        extra = {op: statistics.median(s["extra_mib"] for s in v) for op, v in samples.items()}
        for op in SAVES + LOADS:
            base = SAVES[0] if op in SAVES else LOADS[0]
            speed = median[base] / median[op]
            label = f"{mib} MiB, {count:,} tensors" + (", cold cache" if cold and op in LOADS else "")
            lines.append(f"| {label} | {op} | {median[op]:.3f} | {speed:.2f}x | {extra[op]:.0f} | {extra[op] / mib:.2f}x |")
            if echo:
                print(lines[-1], flush=True)
    return "\n".join(lines)


DEFAULT_SIZES = [(64, 100), (64, 2000), (64, 20000), (256, 16), (512, 16), (1024, 16), (2048, 16)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(f"{m}x{n}" for m, n in DEFAULT_SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before every load (root)")
    args = parser.parse_args()
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    table(sizes, args.repeats, args.cold, echo=True)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
