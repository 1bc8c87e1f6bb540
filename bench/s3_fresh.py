"""S3 saves and loads each in a new process, as a resume is: time and peak extra memory.

    python bench/s3_fresh.py [--sizes 256x16,1024x16] [--repeats 3]

One SeaweedFS server on loopback (started here). For each state (MiB x tensors, float32) every
operation runs in its own Python process that first builds and touches the state, then times
the operation alone:

* s3fs `pipe` / `open().write` of the same bytes as one object; s3fs `cat` of it (into memory);
  the CRT client of s3torchconnector reading it whole (its own concurrent ranged GETs);
* distckpt: manager construction + save + close; manager + load_latest into the existing state
  + close, with each payload client (s3fs ranged GETs, the CRT client) and each place for the
  download (a local file, mapped, or memory: ``spill_dir=None``).

Peak extra memory is the process's peak resident set during the operation (VmHWM reset through
/proc/self/clear_refs just before it) minus its resident set before it. Operations run
interleaved, one of each per round; each row is the median of --repeats.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

from process_cost import run_child

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "launch"))

CHILD = r"""
import os, sys
import torch
from process_cost import measure, report

op, prefix, mib, count, endpoint = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.set_num_threads(1)
numel = mib * 2**18 // count
ENV_OPTIONS = {"client_kwargs": {"endpoint_url": endpoint}}  # credentials: the AWS_* environment


def state_of(fill):
    torch.manual_seed(0)
    if fill == "random":
        return {f"t{i}": torch.randn(numel) for i in range(count)}
    return {f"t{i}": torch.zeros(numel) for i in range(count)}  # a model built before it is loaded


def raw_bytes(state):
    return b"".join(t.numpy().tobytes() for t in state.values())


def fs():
    import s3fs
    return s3fs.S3FileSystem(skip_instance_cache=True, **ENV_OPTIONS)


def s3fs_pipe(state):
    data = raw_bytes(state)
    return lambda: fs().pipe_file(f"{prefix}/raw.bin", data)


def s3fs_open_write(state):
    def run():
        with fs().open(f"{prefix}/raw-open.bin", "wb") as f:
            for t in state.values():
                f.write(t.numpy().data)
    return run


def s3fs_cat(_):
    return lambda: fs().cat_file(f"{prefix}/raw.bin")


def crt_get(_):
    def run():
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        client = S3Client("us-east-1", endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True))
        bucket, _, key = f"{prefix}/raw.bin".partition("/")
        return [chunk for chunk in client._get_object_stream(bucket, key)]
    return run


def distckpt_save(state):
    import distckpt
    try:  # a new run's root, emptied before the clock starts
        fs().rm(f"{prefix}/distckpt", recursive=True)
    except FileNotFoundError:
        pass
    def run():
        with distckpt.CheckpointManager(f"s3://{prefix}/distckpt", storage_options=ENV_OPTIONS, keep_last=1) as mgr:
            mgr.save(1, state)
    return run


def distckpt_load(options):
    def make(state):
        import distckpt
        def run():
            with distckpt.CheckpointManager(f"s3://{prefix}/distckpt", storage_options={**ENV_OPTIONS, **options}) as mgr:
                assert mgr.load_latest(state).step == 1
        return run
    return make


OPS = {"s3fs pipe (one object)": (s3fs_pipe, "random"), "s3fs open().write (one object)": (s3fs_open_write, "random"),
       "distckpt save": (distckpt_save, "random"),
       "s3fs cat (one object, into memory)": (s3fs_cat, None), "CRT client GET (one object, into memory)": (crt_get, None),
       "distckpt load, s3fs, in memory": (distckpt_load({"client": "s3fs", "spill_dir": None}), "zeros"),
       "distckpt load, s3fs, download file": (distckpt_load({"client": "s3fs"}), "zeros"),
       "distckpt load, CRT, download file": (distckpt_load({"client": "crt"}), "zeros")}
make, fill = OPS[op]
state = state_of(fill) if fill else None
fn = make(state)
import distckpt, s3fs  # noqa: F401,E401  the imports are not the operation's cost
kept, measured = measure(fn)
if fill == "zeros":  # a load into the state: it must hold the saved values now
    expected = state_of("random")
    assert all(torch.equal(state[k], expected[k]) for k in state), "loaded values differ"
report(measured)
"""

SAVES = ["s3fs pipe (one object)", "s3fs open().write (one object)", "distckpt save"]
LOADS = ["s3fs cat (one object, into memory)", "CRT client GET (one object, into memory)",
         "distckpt load, s3fs, in memory", "distckpt load, s3fs, download file", "distckpt load, CRT, download file"]


def run(op: str, prefix: str, mib: int, count: int, server) -> dict[str, float]:
    return run_child(CHILD, [op, prefix, str(mib), str(count), server.endpoint], {**os.environ, **server.env()})


def table(sizes: list[tuple[int, int]], repeats: int, echo: bool = False) -> str:
    from seaweed import SeaweedS3

    lines = ["| state | operation | median s | vs baseline | peak extra memory, MiB | x the state |",
             "|---|---|---:|---:|---:|---:|"]
    if echo:
        print("\n".join(lines), flush=True)
    root = tempfile.mkdtemp(prefix="distckpt-s3fresh-")
    server = SeaweedS3(os.path.join(root, "seaweedfs")).start()
    try:
        server.make_bucket("bench")
        for mib, count in sizes:
            prefix = f"bench/s{mib}x{count}"
            samples: dict[str, list[dict[str, float]]] = {}
            for op in SAVES:  # one round to create the objects the loads read
                run(op, prefix, mib, count, server)
            for _ in range(repeats):
                for op in SAVES + LOADS:
                    samples.setdefault(op, []).append(run(op, prefix, mib, count, server))
            median = {op: statistics.median(s["seconds"] for s in v) for op, v in samples.items()}
            extra = {op: statistics.median(s["extra_mib"] for s in v) for op, v in samples.items()}
            for op in SAVES + LOADS:
                base = SAVES[0] if op in SAVES else LOADS[0]
                lines.append(f"| {mib} MiB, {count:,} tensors | {op} | {median[op]:.3f} | "
                             f"{median[base] / median[op]:.2f}x | {extra[op]:.0f} | {extra[op] / mib:.2f}x |")
                if echo:
                    print(lines[-1], flush=True)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    return "\n".join(lines)


DEFAULT_SIZES = [(256, 16), (1024, 16)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(f"{m}x{n}" for m, n in DEFAULT_SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sizes = [(int(m), int(n)) for m, n in (s.split("x") for s in args.sizes.split(","))]
    table(sizes, args.repeats, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
