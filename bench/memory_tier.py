"""The memory tier: how long a resume takes from a node's shared memory against from S3.

    python bench/memory_tier.py [--mib 256] [--repeats 5] [--links loopback] [--state empty|init]
                                [--baseline PATH|none]
    sudo python bench/memory_tier.py --links loopback,1000,300,125 --baseline none   # shaped links

A state of `mib` MiB (16 tensors) is saved once to S3 (SeaweedFS) with `memory_tier=True`, so it
is committed on S3 and in shared memory (/dev/shm). Then, in rounds interleaved, a fresh process
(interpreter start, manager, the state built, `load_latest`, close) resumes it (a) from the memory
tier and (b) from S3, the memory copy moved away (a node that lost its memory: the load falls back
to the durable tier, as without a memory tier). The manager is made before the state is built, as
a job does (README's quickstart), so what the manager starts at construction may go on meanwhile:
`--state empty` (torch.empty: next to nothing to overlap, the tensors' pages first touched by the
load) or `--state init` (initialised as a model's weights are, uniform_).

`--links`: where the S3 server is. `loopback`: on 127.0.0.1 in this network namespace (the best
case for S3). A number: MB/s (10**6 bytes) each way on a link shaped with tc htb between a network
namespace of the resuming processes and one of the server (bench/cluster_net.py, as `make
bench-cluster` builds its cluster); the link is measured with a raw TCP transfer before its rows,
and a link that does not run at its rate stops the run. Shaped links need root, ip and tc.

`--baseline`: the same rows on the code before (its distckpt first on PYTHONPATH); by default the
package at commit BASELINE_COMMIT, extracted with `git archive` under build/. `none` skips them.

Reported per link and code: medians of the manager's construction, of load_latest alone, of
construction to loaded (what a job waits for, the state's building included), of the whole process,
and peak RSS; ratios against the S3 resume of the same link and code; the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from typing import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "launch"))

import checkouts  # noqa: E402

BASELINE_COMMIT = "bf158ce"  # the resume path as kept; the rows beside it measured a variant (benchmarks page)
BUCKET, URL = "bench", "s3://bench/memory-resume"
TIERS = ("memory", "durable")

RESUME_SCRIPT = """
import resource, sys, time, warnings
import torch, distckpt
url, mib, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
began = time.perf_counter()
mgr = distckpt.CheckpointManager(url, memory_tier=True)
built = time.perf_counter()
state = {f"t{i}": torch.empty(mib * 2**18 // 16) for i in range(16)}
if how == "init":  # as a model's constructor initialises its weights (nn.Linear: uniform)
    for t in state.values():
        torch.nn.init.uniform_(t, -0.1, 0.1)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the fallback's warning, in the S3 rows
    before_load = time.perf_counter()
    progress = mgr.load_latest(state)
loaded = time.perf_counter()
mgr.close()
torch.manual_seed(0)
expected = torch.randn(mib * 2**18 // 16)
assert torch.equal(state["t0"], expected), "the resumed state is not the saved one"
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
print(progress.tier, built - began, loaded - before_load, loaded - began, rss, distckpt.__file__)
"""

SAVE_SCRIPT = """
import sys, torch, distckpt
url, mib = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
state = {f"t{i}": torch.randn(mib * 2**18 // 16) for i in range(16)}
with distckpt.CheckpointManager(url, memory_tier=True) as mgr:
    mgr.save(1, state)
"""

MEASURES = ("build", "load", "to_loaded", "wall", "rss")


@dataclass
class Place:
    """Where the S3 server runs for one link, and how the resuming processes reach it."""

    name: str
    env: dict[str, str]
    prefix: list[str] = field(default_factory=list)  # `ip netns exec NS` for a shaped link
    measured: str = ""


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5, help="counted rounds per link (one more warms up)")
    p.add_argument("--links", default="loopback",
                   help="comma-separated: 'loopback' and/or link rates in MB/s (shaped with tc; needs root)")
    p.add_argument("--state", choices=("empty", "init"), default="empty",
                   help="how the resuming process builds its state after the manager: torch.empty (nothing to "
                        "overlap, pages untouched) or initialised as a model's weights are (uniform_)")
    p.add_argument("--baseline", default=None, help=f"checkout of the code before, 'none' to skip; default: "
                   f"distckpt at {BASELINE_COMMIT} under build/")
    args = p.parse_args(argv)
    try:
        args.link_list = [None if x == "loopback" else float(x) for x in args.links.split(",") if x]
    except ValueError:
        p.error(f"--links {args.links}: takes 'loopback' and link rates in MB/s, comma-separated")
    if not args.link_list or any(x is not None and x <= 0 for x in args.link_list):
        p.error(f"--links {args.links}: give at least one link; rates must be positive")
    if args.mib < 1 or args.repeats < 1:
        p.error("--mib and --repeats must be at least 1")
    return args


def baseline_checkout(arg: str | None) -> tuple[str | None, str]:
    return checkouts.baseline_checkout(arg, BASELINE_COMMIT, "memory-baseline")


def _run(place: Place, script: str, args: list[str], code_path: str | None, cwd: str) -> str:
    """`script` in a fresh interpreter; `cwd` is not the repository, whose distckpt would come
    first on sys.path, before PYTHONPATH's."""
    env = {**os.environ, **place.env, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    if code_path is not None:
        env["PYTHONPATH"] = code_path
    out = subprocess.run(place.prefix + [sys.executable, "-c", script, *args], env=env, capture_output=True,
                         text=True, cwd=cwd)
    if out.returncode != 0:
        raise RuntimeError(f"a bench process exited with {out.returncode}: {out.stderr.strip()[-3000:]}")
    return (out.stdout.strip().splitlines() or [""])[-1]


def resume_rounds(place: Place, shm: str, args: argparse.Namespace,
                  codes: dict[str, str | None]) -> dict[tuple[str, str], dict[str, float]]:
    """Medians per (code, tier), the first round left out (it warms the page cache and the server)."""
    memory, kept = os.path.join(shm, "node0"), os.path.join(shm, "kept")
    mib = str(args.mib)
    _run(place, SAVE_SCRIPT, [URL, mib], None, shm)
    os.rename(memory, kept)
    samples: dict[tuple[str, str], dict[str, list[float]]] = {
        (c, t): {m: [] for m in MEASURES} for c in codes for t in TIERS}
    for _ in range(args.repeats + 1):
        for code, path in codes.items():
            for tier in TIERS:
                if tier == "memory":
                    shutil.copytree(kept, memory)
                start = time.perf_counter()
                got, build, load, to_loaded, rss, where = _run(place, RESUME_SCRIPT, [URL, mib, args.state],
                                                                path, shm).split()
                wall = time.perf_counter() - start
                shutil.rmtree(memory, ignore_errors=True)
                if got != tier:
                    raise RuntimeError(f"expected a resume from the {tier} tier, got {got}")
                if not where.startswith((path or ROOT) + os.sep):
                    raise RuntimeError(f"the {code} rows imported {where}, not {path or ROOT}'s distckpt")
                for name, value in zip(MEASURES, (build, load, to_loaded, wall, rss)):
                    samples[(code, tier)][name].append(float(value))
    return {key: {m: statistics.median(v[1:]) for m, v in got.items()} for key, got in samples.items()}


def table_rows(link: str, medians: dict[tuple[str, str], dict[str, float]], codes: list[str]) -> Iterator[str]:
    for code in codes:
        s = medians[(code, "durable")]
        for tier, shown in (("memory", "memory tier (/dev/shm)"), ("durable", "S3 (memory copy gone)")):
            m = medians[(code, tier)]
            yield (f"| {link} | {code} | {shown} | {m['build']:.3f} | {m['load']:.3f} | {s['load'] / m['load']:.2f}x "
                   f"| {m['to_loaded']:.3f} | {s['to_loaded'] / m['to_loaded']:.2f}x | {m['wall']:.3f} "
                   f"| {s['wall'] / m['wall']:.2f}x | {m['rss']:.0f} |")


HEADER = ["| link to S3 | code | resume from | manager built, s | load_latest, s | vs S3 | manager to loaded "
          "(state built), s | vs S3 | whole process, s | vs S3 | peak RSS, MiB |",
          "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]


@contextlib.contextmanager
def loopback_place(work: str) -> Iterator[Place]:
    from seaweed import SeaweedS3

    server = SeaweedS3(os.path.join(work, "seaweedfs")).start()
    try:
        server.make_bucket(BUCKET)
        yield Place("loopback (unshaped)", server.env())
    finally:
        server.stop(grace_s=2)


def _bench_cluster() -> types.ModuleType:
    """bench/cluster.py (launch/ has a cluster.py of its own, first on sys.path)."""
    spec = importlib.util.spec_from_file_location("bench_cluster", os.path.join(HERE, "cluster.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def shaped_place(work: str, rate: float) -> Iterator[Place]:
    """One node namespace behind a link of `rate` MB/s to the server's namespace, measured first."""
    import cluster_net as net
    from seaweed import ACCESS_KEY, SECRET_KEY

    cluster = _bench_cluster()
    c = net.Cluster(1, rate)
    shaped = cluster.Run(types.SimpleNamespace(link_mbs=rate), c, work)
    try:
        c.build()
        server = cluster.start_server(shaped)
        try:
            cluster.measure_links(shaped)  # raises when the link does not run at its rate
            got = shaped.shaping[0]
            env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                   "AWS_ENDPOINT_URL": cluster.endpoint(), "AWS_DEFAULT_REGION": "us-east-1"}
            yield Place(f"{rate:g} MB/s shaped", env, c.exec_prefix(c.node(0)),
                        f"measured {got['up_mbs']:.0f} up / {got['down_mbs']:.0f} down MB/s")
        finally:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    finally:
        c.teardown()


def link_rows(args: argparse.Namespace, rate: float | None, codes: dict[str, str | None]) -> tuple[str, list[str]]:
    """The note (measured link, load average) and the table rows of one link."""
    work = tempfile.mkdtemp(prefix="distckpt-memory-bench-", dir="/var/tmp")
    shm = tempfile.mkdtemp(prefix="distckpt-bench-", dir="/dev/shm")
    try:
        with loopback_place(work) if rate is None else shaped_place(work, rate) as place:
            place.env["DISTCKPT_MEMORY_DIR"] = os.path.join(shm, "node0")
            before = os.getloadavg()[0]
            medians = resume_rounds(place, shm, args, codes)
            after = os.getloadavg()[0]
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    measured = f"{place.measured}, " if place.measured else ""
    note = f"{place.name}: {measured}load average {before:.1f} before its rows, {after:.1f} after"
    return note, list(table_rows(place.name, medians, list(codes)))


def measure(args: argparse.Namespace, codes: dict[str, str | None]) -> list[str]:
    """Each link's rows, printed as soon as they are measured (a later link that fails its
    shaping check stops the run, not what was measured before it); then all of them."""
    notes: list[str] = []
    rows: list[str] = []
    for rate in args.link_list:
        note, more = link_rows(args, rate, codes)
        print("\n".join([note, *more]), flush=True)
        notes.append(note)
        rows.extend(more)
    return notes + [""] + HEADER + rows


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if any(rate is not None for rate in args.link_list):
        import cluster_net as net

        why = net.refusal("bench/memory_tier.py --links with a rate")
        if why:
            print(f"bench/memory_tier.py: {why}; `--links loopback` runs without", file=sys.stderr)
            return 2
    baseline, said = baseline_checkout(args.baseline)
    codes: dict[str, str | None] = {"now": None, **({"before": baseline} if baseline else {})}
    shown = " ".join(sys.argv[1:] if argv is None else argv)
    print(f"command: python bench/memory_tier.py {shown}".rstrip(), flush=True)
    print(said, flush=True)
    print("\n".join(measure(args, codes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
