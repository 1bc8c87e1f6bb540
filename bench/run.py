"""Checkpoint cost against baselines measured in the same run.

    python bench/run.py [--mib 256] [--repeats 3] [--no-s3] [--no-ranks] [--no-training] [--no-incremental] [--no-history] [--no-fresh]

Every row is a median over --repeats rounds (at least 7 for the single-process local-disk rows)
after one warm-up round; single-process rows run interleaved (one of each per round), because
this kind of VM's disk speed drifts by 2x over a minute. Ratios compare with the baseline of the same medium and direction measured in this run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "launch"))

from baselines import torch_save_durably  # noqa: E402

import distckpt  # noqa: E402

Row = tuple[str, str, float, str]
# The single-process rows take a second a round: they run at least this many rounds, because
# this VM stalls a 256 MiB write for ~1 s now and then (in every writer, seen in every row),
# which a median of 3 does not always absorb.
LOCAL_REPEATS = 7  # (section, what, seconds, baseline name or "")


def make_state(mib: int) -> dict[str, torch.Tensor]:
    n = 16
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(mib * 2**20 // 4 // n, generator=g) for i in range(n)}


def interleaved(fns: dict[str, Callable[[], object]], repeats: int,
                before: dict[str, Callable[[], object]] | None = None) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats + 1):
        for name, fn in fns.items():
            if before and name in before:
                before[name]()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v[1:]) for k, v in times.items()}


def fresh_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)


def local_rows(state: dict, root: str, repeats: int) -> list[Row]:
    import torch.distributed.checkpoint as dcp

    chunks = [t.numpy().tobytes() for t in state.values()]  # one write per tensor, as a checkpoint does
    raw, ts_path, dcp_dir = (os.path.join(root, n) for n in ("raw.bin", "ts.pt", "dcp"))
    steps = iter(range(10**6))
    # No deletion inside the timed writes, for any row: each row's previous output is removed
    # before it, and the removal made durable (this disk is mounted with `discard`: the blocks
    # of a deleted file are trimmed at the next journal commit, which the next fsync waits for,
    # whichever row it belongs to). Replacing an existing file inside the timing had made the
    # raw row pay for freeing its previous 256 MiB: 1.0 s against 0.2 s. Every row's removed
    # files are evicted from the page cache first, the same for all: on this VM a write into
    # pages freed a moment ago ran up to 4x faster than one into pages free for seconds (the
    # hypervisor takes those back), which would favour a row that frees cached pages just
    # before it writes.
    sync_dir = os.path.join(root, "sync")
    sync_mgr = distckpt.CheckpointManager(sync_dir)

    def raw_write() -> None:
        with open(raw + ".tmp", "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(raw + ".tmp", raw)

    def torch_save() -> None:
        torch_save_durably(state, ts_path)

    writes = interleaved({"raw write + fsync": raw_write, "torch.save + fsync + rename": torch_save,
                          "dcp.save": lambda: dcp.save(state, checkpoint_id=dcp_dir),
                          "distckpt save (sync)": lambda: sync_mgr.save(next(steps), state)},
                         repeats, before={"raw write + fsync": settled(lambda: _remove(raw)),
                                          "torch.save + fsync + rename": settled(lambda: _remove(ts_path)),
                                          "dcp.save": settled(lambda: _evicted_fresh_dir(dcp_dir)),
                                          "distckpt save (sync)": settled(lambda: _drop_checkpoints(sync_mgr))})
    target = {k: torch.empty_like(v) for k, v in state.items()}

    # Every load row does the same work: the bytes into the same existing tensors (`target`, a
    # model built before its weights are loaded). A raw f.read() into a new bytes object, and a
    # torch.load without the copy, had been timed against distckpt's load into `target`.
    def raw_read() -> None:
        with open(raw, "rb", buffering=0) as f:
            for t in target.values():
                f.readinto(t.numpy().data)

    def torch_load(mmap: bool = False) -> None:
        loaded = torch.load(ts_path, weights_only=True, mmap=mmap)
        for k, t in target.items():
            t.copy_(loaded[k])

    reads = interleaved({"raw read": raw_read,
                         "torch.load + copy": torch_load,
                         "torch.load(mmap=True) + copy": lambda: torch_load(mmap=True),
                         "dcp.load": lambda: dcp.load(target, checkpoint_id=dcp_dir),
                         "distckpt load": lambda: sync_mgr.load_latest(target)}, repeats)
    sync_mgr.close()
    rows: list[Row] = [("1 rank, local disk", k, v, "raw write + fsync") for k, v in writes.items()]
    rows += [("1 rank, local disk", k, v, "raw read") for k, v in reads.items()]
    rows += async_rows(state, root, repeats)
    return rows


def settled(fn: Callable[[], object]) -> Callable[[], None]:
    """fn, then every pending write and trim on the disk done, outside the next timing."""
    def run() -> None:
        fn()
        os.sync()
    return run


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _evict(path)
        os.unlink(path)


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _evict_tree(path: str) -> None:
    for folder, _, files in os.walk(path):
        for name in files:
            _evict(os.path.join(folder, name))


def _evicted_fresh_dir(path: str) -> None:
    _evict_tree(path)
    fresh_dir(path)


def _drop_checkpoints(mgr: distckpt.CheckpointManager, keep_newest: int = 0) -> None:
    """Remove committed checkpoints but the newest `keep_newest`, their pages evicted first."""
    from distckpt.io.manifest import step_dir
    from distckpt.protocol.retention import delete_checkpoint

    for step in mgr.committed_steps()[keep_newest:]:
        _evict_tree(os.path.join(mgr.storage.url, step_dir(step)))
        delete_checkpoint(mgr.storage, step)


def async_rows(state: dict, root: str, repeats: int) -> list[Row]:
    """Time until save() returns, and the host memory the save in flight adds."""
    import torch.distributed.checkpoint as dcp

    mgr = distckpt.CheckpointManager(os.path.join(root, "async"), async_save=True)
    with PeakRss() as load_peak:
        mgr.load_latest(state)  # a new run: allocates the staging buffers by the state's shapes
        time.sleep(0.5)  # the training between the load and the first save; the buffers are faulted in meanwhile
    steps = iter(range(10**6))
    stalls, dcp_stalls, peaks, first_peak = [], [], [], 0
    for i in range(repeats + 1):
        mgr.wait()
        _drop_checkpoints(mgr, keep_newest=1)
        with PeakRss() as peak:
            t0 = time.perf_counter()
            mgr.save(next(steps), state)
            stall = time.perf_counter() - t0
            mgr.wait()
        future = None
        fresh_dir(os.path.join(root, "dcp-async"))
        t0 = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=os.path.join(root, "dcp-async"))
        dcp_stall = time.perf_counter() - t0
        future.result()
        if i == 0:
            first_peak = peak.extra_bytes  # the first save allocates the staging buffers
            first_stall, first_dcp_stall = stall, dcp_stall
        else:
            stalls.append(stall)
            dcp_stalls.append(dcp_stall)
            peaks.append(peak.extra_bytes)
    mgr.close()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return [("1 rank, local disk", "memory copy of the state into reused buffers (the stall's floor)",
             _copy_floor(state, repeats), "distckpt save (sync)"),
            ("1 rank, local disk", "dcp.async_save stall", statistics.median(dcp_stalls), "distckpt save (sync)"),
            ("1 rank, local disk", "distckpt async_save stall", statistics.median(stalls), "distckpt save (sync)"),
            ("1 rank, local disk", "dcp.async_save stall, first call of the process (one round)", first_dcp_stall,
             "distckpt save (sync)"),
            ("1 rank, local disk", "distckpt async_save stall, first save of the manager, 0.5 s after load_latest "
             "(which allocated the staging buffers; one round)", first_stall, "distckpt save (sync)"),
            ("1 rank, local disk", f"async save, peak extra host memory: load_latest and the 0.5 s after it "
             f"{load_peak.extra_bytes / nbytes:.2f}x the state (the staging buffers), first save {first_peak / nbytes:.2f}x, later saves "
             f"{statistics.median(peaks) / nbytes:.2f}x", float("nan"), "")]


def _copy_floor(state: dict, repeats: int) -> float:
    """What an async save cannot beat without sharing pages with training: copying every byte once."""
    buffers = {k: torch.empty_like(t) for k, t in state.items()}
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for k, t in state.items():
            buffers[k].copy_(t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


class PeakRss:
    """Samples this process's resident memory every 2 ms; extra_bytes = peak - start."""

    def __enter__(self) -> "PeakRss":
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.extra_bytes = max(0, self.peak - self.start)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rank_rows(root: str, mib: int, repeats: int) -> list[Row]:
    from distckpt.testing import run_world

    rows: list[Row] = []
    for world in (2, 4):
        results = run_world("rank_jobs:save_load_rows", world, timeout=900, root=root, mib=mib, repeats=repeats)
        _raise_failed(results)
        for name, seconds in results[0].value.items():
            base = "dcp.save" if "save" in name else "dcp.load"
            rows.append((f"{world} ranks (gloo), local disk", name, seconds, base if name != base else ""))
    for world in (2, 4):
        results = run_world("rank_jobs:sharded_rows", world, timeout=900, root=root, mib=mib, repeats=repeats)
        _raise_failed(results)
        for name, seconds in results[0].value.items():
            base = "dcp.save" if "save" in name else "dcp.load"
            rows.append((f"{world} ranks FSDP2 (sharded, {mib} MiB in all), local disk", name, seconds,
                         base if name != base else ""))
    for world in (2, 4, 8):
        results = run_world("rank_jobs:coordination_rows", world, timeout=900, root=root, repeats=max(5, repeats))
        _raise_failed(results)
        rows += [(f"{world} ranks, tiny state", name, s, "") for name, s in results[0].value.items()]
    return rows


def _raise_failed(results: list) -> None:
    bad = [r for r in results if r.error or r.died]
    if bad:
        raise RuntimeError(f"benchmark ranks failed: {[(r.rank, r.error_type, r.error) for r in bad]}")


def s3_rows(state: dict, root: str, repeats: int) -> list[Row]:
    import s3fs
    import torch.distributed.checkpoint as dcp
    from seaweed import SeaweedS3
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    data = b"".join(t.numpy().tobytes() for t in state.values())
    server = SeaweedS3(os.path.join(root, "seaweedfs")).start()
    try:
        server.make_bucket("bench")
        os.environ.update(server.env())  # dcp's fsspec writer takes credentials from the environment
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())
        mgr = distckpt.CheckpointManager("s3://bench/run", storage_options=server.storage_options(), keep_last=1)
        steps = iter(range(10**6))
        target = {k: torch.empty_like(v) for k, v in state.items()}
        def open_write() -> None:  # s3fs's own multipart upload (blocksize parts), chunk by chunk
            with fs.open("bench/raw-open.bin", "wb") as f:
                for t in state.values():
                    f.write(t.numpy().data)

        writes = interleaved({"s3fs pipe (one object)": lambda: fs.pipe_file("bench/raw.bin", data),
                              "s3fs open().write (one object)": open_write,
                              "dcp.save (FsspecWriter)": lambda: dcp.save(state, storage_writer=FsspecWriter("s3://bench/dcp")),
                              "distckpt save": lambda: mgr.save(next(steps), state)}, repeats)
        reads = interleaved({"s3fs cat (one object)": lambda: fs.cat_file("bench/raw.bin"),
                             "dcp.load (FsspecReader)": lambda: dcp.load(target, storage_reader=FsspecReader("s3://bench/dcp")),
                             "distckpt load": lambda: mgr.load_latest(target)}, repeats)
        mgr.close()
    finally:
        server.stop()
    return ([("1 rank, S3 (SeaweedFS, loopback)", k, v, "s3fs pipe (one object)") for k, v in writes.items()]
            + [("1 rank, S3 (SeaweedFS, loopback)", k, v, "s3fs cat (one object)") for k, v in reads.items()])


def render(rows: list[Row], nbytes: int) -> str:
    seconds = {(sec, name): s for sec, name, s, _ in rows}
    lines = ["| setting | what | median s | MiB/s | ratio |", "|---|---|---:|---:|---:|"]
    for section, name, s, base in rows:
        if s != s:  # a note row (nan seconds)
            lines.append(f"| {section} | {name} | | | |")
            continue
        ratio = ""
        if base and (section, base) in seconds:
            ratio = f"speed {seconds[(section, base)] / s:.2f}x {base}" if "stall" not in name else \
                f"{s / seconds[(section, base)]:.3f}x the time of {base}"
        rate = f"{nbytes / 2**20 / s:,.0f}" if "tiny" not in section else ""
        lines.append(f"| {section} | {name} | {s:.3f} | {rate} | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-s3", action="store_true")
    p.add_argument("--no-ranks", action="store_true")
    p.add_argument("--no-training", action="store_true", help="skip the training-throughput table")
    p.add_argument("--no-incremental", action="store_true", help="skip the incremental-checkpoint table")
    p.add_argument("--no-history", action="store_true", help="skip the S3 cost-against-history table")
    p.add_argument("--no-fresh", action="store_true",
                   help="skip the fresh-process tables (bench/fresh.py, and bench/s3_fresh.py unless --no-s3)")
    p.add_argument("--no-overlap", action="store_true", help="skip the overlapped-snapshot table (bench/overlap.py)")
    args = p.parse_args()
    torch.set_num_threads(1)
    state = make_state(args.mib)
    root = tempfile.mkdtemp(prefix="distckpt-bench-")
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    try:
        rows = local_rows(state, root, max(args.repeats, LOCAL_REPEATS))
        from keep_one import keep_one_table

        keep_one = keep_one_table(args.mib, 6, 0.5)
        if sys.platform.startswith("linux"):
            from dirty_pages import dirty_table

            keep_one += "\n\n" + dirty_table(1024, args.repeats)
        per_rank = ""
        if not args.no_ranks:
            from per_rank import per_rank_table

            rows += rank_rows(root, args.mib, args.repeats)
            per_rank = per_rank_table(args.mib / 4, [2, 4], max(args.repeats, 5))
            from protocol_scaling import measure as protocol_rows
            from protocol_scaling import table as protocol_table

            per_rank += ("\n\nThe protocol as the ranks grow (tiny state, fresh torchrun per row; "
                         "bench/protocol_scaling.py):\n\n" + protocol_table(protocol_rows([2, 4, 8, 16], 10, None), False))
        if not args.no_s3:
            rows += s3_rows(state, root, args.repeats)
        if not args.no_training:
            from training import training_table

            training = training_table(os.path.join(root, "training"))
            if not args.no_s3:
                from tiers import tier_tables

                training += "\n\n" + tier_tables(os.path.join(root, "tiers"), args.mib)
        incremental = ""
        if not args.no_incremental:
            from incremental import incremental_tables

            incremental = incremental_tables(os.path.join(root, "incremental"), args.mib, 6, not args.no_s3)
        fresh = ""
        if not args.no_fresh:
            from fresh import DEFAULT_SIZES, table

            heavy = [(64, 20000), (2048, 16)]  # one round: three of dcp at 20,000 tensors take minutes
            fresh = table([s for s in DEFAULT_SIZES if s not in heavy], args.repeats, cold=False)
            fresh += "\n\n" + table(heavy, 1, cold=False)
            if os.geteuid() == 0:  # dropping the page cache takes root
                fresh += "\n\n" + table([(256, 16), (1024, 16)], args.repeats, cold=True)
            from model_state import table as model_table

            fresh += "\n\n" + model_table([(64, 200), (64, 2000)], args.repeats)
            fresh += "\n\n" + model_table([(16, 20000)], 1)  # dcp takes ~30 s a call here
        if not args.no_fresh and not args.no_s3:
            from s3_fresh import DEFAULT_SIZES as S3_SIZES
            from s3_fresh import table as s3_fresh_table

            fresh += "\n\n" + s3_fresh_table(S3_SIZES, args.repeats)
        overlap = ""
        if not args.no_overlap:
            from overlap import overlap_table

            torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
            overlap = overlap_table([256, 512], max(args.repeats, 5))
            torch.set_num_threads(1)
        history = ""
        if not args.no_history and not args.no_s3:
            from history import history_table

            history = history_table([10, 200, 2000], args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    print(f"state: {len(state)} float32 tensors, {nbytes / 2**20:.0f} MiB (per rank, replicated); "
          f"median of {args.repeats} after warm-up ({max(args.repeats, LOCAL_REPEATS)} for the single-process local-disk rows); {os.cpu_count()} CPUs; torch {torch.__version__}")
    print(f"command: python bench/run.py --mib {args.mib} --repeats {args.repeats}"
          + (" --no-s3" if args.no_s3 else "") + (" --no-ranks" if args.no_ranks else "")
          + (" --no-training" if args.no_training else "") + (" --no-incremental" if args.no_incremental else "")
          + (" --no-history" if args.no_history else "") + (" --no-fresh" if args.no_fresh else "")
          + (" --no-overlap" if args.no_overlap else ""))
    print(render(rows, nbytes))
    print()
    print(keep_one)
    if per_rank:
        print()
        print(per_rank)
    if not args.no_training:
        print()
        print(training)
    if incremental:
        print()
        print(incremental)
    if fresh:
        print()
        print(fresh)
    if overlap:
        print()
        print(overlap)
    if history:
        print()
        print(history)
    return 0


if __name__ == "__main__":
    sys.exit(main())
