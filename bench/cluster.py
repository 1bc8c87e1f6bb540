"""Save and load on a simulated cluster: N nodes, each behind a shaped link to one S3 server.

    sudo python bench/cluster.py [--nodes 1,2,4] [--mib 32] [--link-mbs 10] [--repeats 2] [--baseline PATH|none]
    make bench-cluster                      # the same, the table also put in docs/benchmarks/cluster.md

Each node is a network namespace with a veth into a bridge; SeaweedFS runs in a namespace of its
own on the same bridge (bench/cluster_net.py). Each node's traffic to and from the S3 server is
shaped to --link-mbs MB/s each way with tc; node-to-node traffic (gloo) is not shaped, as on a
cluster whose interconnect is faster than its storage link. The shaping is measured with a raw
TCP transfer before the rows (and the node-to-node speed beside it).

For each node count, one torchrun agent per node (inside its namespace, 2 ranks each) runs
bench/cluster_job.py: per write path (rank 0 alone, split writes, sharded FSDP2) a save and a
fresh manager's load, each timed (slowest rank) and its bytes to and from S3 counted by the
shaped tc classes. The same job runs again on the code before (--baseline: a checkout whose
distckpt goes first on PYTHONPATH; by default a git worktree of df718c4 under build/). Prints
a markdown table and writes it to build/bench-cluster.md (and the raw rows to
build/bench-cluster.json). Everything it creates (namespaces, their interfaces and qdiscs, the
processes in them) is removed on exit, Ctrl-C and failure included. Needs root, ip and tc.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "launch"))

import checkouts  # noqa: E402
import cluster_net as net  # noqa: E402
from cluster_report import into_docs, report  # noqa: E402

BASELINE_COMMIT = "df718c4"
PATHS = ("rank0", "split", "sharded")
PROBE_PORT, S3_PORT, MASTER_PORT = 9000, 8333, 29500


@dataclass
class Run:
    """One cluster run: what was asked, what was measured."""

    args: argparse.Namespace
    cluster: net.Cluster
    work: str
    shaping: list[dict[str, float]] = field(default_factory=list)
    interconnect_mbs: float | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    snapshots: dict[str, dict[str, list[int]]] = field(default_factory=dict)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="1,2,4", help="node counts, comma-separated (default 1,2,4)")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--mib", type=float, default=32, help="state size in MiB (replicated; sharded: in all)")
    p.add_argument("--link-mbs", type=float, default=10, help="each node's link to S3, MB/s each way")
    p.add_argument("--repeats", type=int, default=2, help="saves and loads per path (the fastest is shown)")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--baseline", default=None,
                   help=f"checkout of the code before (its distckpt first on PYTHONPATH); 'none' skips the "
                        f"before rows; default: a git worktree of {BASELINE_COMMIT} under build/")
    p.add_argument("--out", default=os.path.join(ROOT, "build", "bench-cluster.md"))
    p.add_argument("--job-timeout", type=float, default=600)
    p.add_argument("--docs", action="store_true", help="also put the table in docs/benchmarks/cluster.md")
    p.add_argument("--keep-logs", action="store_true", help="keep the work folder (each node's log, with "
                   "distckpt's per-save phase lines)")
    args = p.parse_args(argv)
    args.node_counts = [int(n) for n in args.nodes.split(",")]
    args.path_list = [x for x in args.paths.split(",") if x]
    unknown = set(args.path_list) - set(PATHS)
    if unknown or not args.path_list or min(args.node_counts) < 1:
        p.error(f"--paths takes {','.join(PATHS)}; --nodes positive counts")
    return args


def baseline_checkout(arg: str | None) -> tuple[str | None, str]:
    return checkouts.baseline_checkout(arg, BASELINE_COMMIT, "cluster-baseline")


def start_server(run: Run) -> subprocess.Popen[bytes]:
    """SeaweedFS in the server namespace, its S3 port on every address there; a bucket."""
    c = run.cluster
    log = open(os.path.join(run.work, "seaweed.log"), "wb")
    proc = subprocess.Popen(c.exec_prefix(c.server) + [
        sys.executable, os.path.join(ROOT, "launch", "seaweed.py"), "serve", "--ip", "0.0.0.0",
        "--s3-port", str(S3_PORT), "--dir", os.path.join(run.work, "seaweedfs")],
        stdout=subprocess.PIPE, stderr=log, start_new_session=True)
    assert proc.stdout is not None
    if not proc.stdout.readline():  # the endpoint, once the server answers
        raise RuntimeError(f"SeaweedFS did not start; see {run.work}/seaweed.log and seaweedfs/weed.log")
    subprocess.run(c.exec_prefix(c.node(0)) + [
        sys.executable, os.path.join(ROOT, "launch", "seaweed.py"), "make-bucket", "--endpoint", endpoint(),
        "--bucket", "bench"], check=True)
    return proc


def endpoint() -> str:
    return f"http://{net.SERVER_IP}:{S3_PORT}"


def _probe(c: net.Cluster, ns: str, host: str, mb: float) -> dict[str, float]:
    out = subprocess.run(c.exec_prefix(ns) + [sys.executable, os.path.join(HERE, "cluster_probe.py"),
                                              "measure", host, str(PROBE_PORT), str(mb)],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"the link probe from {ns} to {host} failed: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def _probe_server(c: net.Cluster, ns: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(c.exec_prefix(ns) + [sys.executable, os.path.join(HERE, "cluster_probe.py"),
                                                 "serve", str(PROBE_PORT)], stdout=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdout is not None
    proc.stdout.readline()
    return proc


def measure_links(run: Run) -> None:
    """Each node's link to the server (raw TCP, both ways), checked against --link-mbs, and the
    unshaped node-to-node speed. Refuses to go on if the shaping is not in effect."""
    c, rate = run.cluster, run.args.link_mbs
    mb = max(2.0, rate * 0.5)  # half a second at the shaped rate
    for ns, host in [(c.server, None)] + ([(c.node(1), net.node_ip(1))] if c.nodes > 1 else []):
        server = _probe_server(c, ns)
        try:
            if host is None:
                run.shaping = [_probe(c, c.node(i), net.SERVER_IP, mb) for i in range(c.nodes)]
            else:
                run.interconnect_mbs = _probe(c, c.node(0), host, 200)["up_mbs"]
        finally:
            server.kill()
            server.wait()
    for i, got in enumerate(run.shaping):
        for way in ("up_mbs", "down_mbs"):
            if not 0.6 * rate <= got[way] <= 1.15 * rate:
                raise RuntimeError(f"node {i}'s link to S3 measured {got[way]:.1f} MB/s ({way[:-4]}), "
                                   f"not the shaped {rate} MB/s: tc shaping is not in effect")


class Handshake:
    """Answers the job's phase marks: reads the counters, then acknowledges (cluster_job.Job.mark)."""

    def __init__(self, run: Run, folder: str, prefix: str) -> None:
        self.run, self.folder, self.prefix = run, folder, prefix
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        try:
            while not self.stop.is_set():
                for name in sorted(os.listdir(self.folder)):
                    if name.endswith(".req"):
                        phase = name[:-4]
                        self.run.snapshots[self.prefix + phase] = self.run.cluster.counters()
                        os.rename(os.path.join(self.folder, name), os.path.join(self.folder, phase + ".done"))
                        open(os.path.join(self.folder, phase + ".ack"), "w").close()
                time.sleep(0.01)
        except BaseException as e:  # reported by close(): the job then times out on its mark
            self.error = e

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"reading the tc counters failed: {self.error}") from self.error


def run_job(run: Run, nodes: int, code: str, baseline: str | None) -> dict[str, Any]:
    """One torchrun agent per node; returns rank 0's results, the counters per phase merged in."""
    c, args = run.cluster, run.args
    key = f"{nodes}-{code}"
    folder = os.path.join(run.work, key)
    os.makedirs(os.path.join(folder, "handshake"))
    config = {"url": f"s3://bench/{key}", "mib": args.mib, "paths": args.path_list, "repeats": args.repeats,
              "storage_options": {"key": "distckpt-test-access", "secret": "distckpt-test-secret-Zq8Xv",
                                  "client_kwargs": {"endpoint_url": endpoint(), "region_name": "us-east-1"}},
              "handshake": os.path.join(folder, "handshake"), "out": os.path.join(folder, "result.json")}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    procs = []
    handshake = Handshake(run, config["handshake"], key + ":")
    try:
        for i in range(nodes):
            local = os.path.join(folder, f"node{i}")  # node-local scratch (TMPDIR)
            os.makedirs(local)
            # a node of its own by every test distckpt or torch may make: its host name (a UTS
            # namespace), DISTCKPT_NODE, its network namespace and its scratch folder
            env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1", TMPDIR=local,
                       PYTHONUNBUFFERED="1", DISTCKPT_NODE=f"node{i}")
            env.pop("PYTHONPATH", None)
            if baseline is not None:
                env["PYTHONPATH"] = baseline
            cmd = c.exec_prefix(c.node(i)) + [
                "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', c.node(i),
                sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={i}",
                f"--nproc-per-node={args.ranks_per_node}", f"--master-addr={net.node_ip(0)}",
                f"--master-port={MASTER_PORT}", os.path.join(HERE, "cluster_job.py"), os.path.join(folder, "config.json")]
            log = open(os.path.join(folder, f"node{i}.log"), "wb")
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=local,
                                          start_new_session=True))
        _wait_all(procs, args.job_timeout, folder)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        handshake.close()
    with open(config["out"]) as f:
        result: dict[str, Any] = json.load(f)
    return result


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout: float, folder: str) -> None:
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            why = f"node {failed[0]} exited with {procs[failed[0]].returncode}" if failed else \
                f"still running after {timeout:.0f} s"
            tail = open(os.path.join(folder, f"node{failed[0] if failed else 0}.log"), errors="replace").read()
            raise RuntimeError(f"the job failed: {why}; its log ends:\n{tail[-3000:]}")
        time.sleep(0.2)
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tail = open(os.path.join(folder, f"node{failed[0]}.log"), errors="replace").read()
        raise RuntimeError(f"node {failed[0]} exited with {procs[failed[0]].returncode}; its log ends:\n"
                           f"{tail[-3000:]}")


def rows_of(run: Run, nodes: int, code: str, result: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """One row per path: the fastest save and load of the repeats (the CPU is shared with other
    work: a slow repeat is mostly someone else's, not the code's or the link's), every repeat's
    time, and the bytes to and from S3 of the fastest."""
    by_phase = {p["phase"]: p for p in result["phases"]}
    for path in run.args.path_list:
        row: dict[str, Any] = {"nodes": nodes, "ranks": nodes * run.args.ranks_per_node, "path": path,
                               "code": code, "distckpt": result["distckpt"], "hosts": result["hosts"]}
        for op in ("save", "load"):
            names = [f"{path}.{op}.{r}" for r in range(run.args.repeats)]
            best = min(names, key=lambda n: by_phase[n]["seconds"])
            row[f"{op}_s"] = by_phase[best]["seconds"]
            row[f"{op}_repeats_s"] = [by_phase[n]["seconds"] for n in names]
            row[f"{op}_per_rank_s"] = by_phase[best]["per_rank"]
            row[f"{op}_up"], row[f"{op}_down"] = _moved(run, f"{nodes}-{code}:{best}")
        yield row


def _moved(run: Run, phase: str) -> tuple[int, int]:
    start, end = run.snapshots[phase + ".start"], run.snapshots[phase + ".end"]
    return (sum(end["up"]) - sum(start["up"]), sum(end["down"]) - sum(start["down"]))


def measure(run: Run, baseline: str | None) -> None:
    server = start_server(run)
    try:
        measure_links(run)
        print(_links_line(run), flush=True)
        for nodes in run.args.node_counts:
            for code, path in [("now", None)] + ([("before", baseline)] if baseline else []):
                t0 = time.monotonic()
                result = run_job(run, nodes, code, path)
                for row in rows_of(run, nodes, code, result):
                    run.rows.append(row)
                    print(f"  {nodes} node(s), {row['path']:8s} {code:6s}: save {row['save_s']:.2f} s, "
                          f"load {row['load_s']:.2f} s", flush=True)
                print(f"{nodes} node(s), {code}: {time.monotonic() - t0:.0f} s with the launch", flush=True)
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _links_line(run: Run) -> str:
    shaped = ", ".join(f"node {i} {s['up_mbs']:.1f} up / {s['down_mbs']:.1f} down" for i, s in enumerate(run.shaping))
    inter = f"; node to node {run.interconnect_mbs:,.0f} MB/s" if run.interconnect_mbs else ""
    return f"links to S3 measured (MB/s): {shaped}{inter}"


def _raise_on_signal(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    why = net.refusal()
    if why:
        print(f"bench/cluster.py: {why}", file=sys.stderr)
        return 2
    baseline, said = baseline_checkout(args.baseline)
    print(said, flush=True)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)  # the finally below runs on these as on Ctrl-C
    work = tempfile.mkdtemp(prefix="distckpt-cluster-", dir=os.path.join(ROOT, "build")
                            if os.path.isdir(os.path.join(ROOT, "build")) else None)
    cluster = net.Cluster(max(args.node_counts), args.link_mbs)
    stale = net.our_namespaces()
    if stale:
        print(f"note: namespaces left by a run that was killed outright: {' '.join(stale)} (not ours to "
              "remove: `ip netns pids NAME`, then `ip netns del NAME`)", flush=True)
    print(f"cluster {cluster.tag}, work folder {work}", flush=True)
    run = Run(args, cluster, work)
    started = time.monotonic()
    try:
        cluster.build()
        measure(run, baseline)
    except KeyboardInterrupt as e:
        print(f"interrupted ({e or 'Ctrl-C'}): removing the cluster", file=sys.stderr, flush=True)
        return 130
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not stop the clean-up halfway
        cluster.teardown()
        if args.keep_logs:
            print(f"logs kept in {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    text = report(run, said, time.monotonic() - started, argv if argv is not None else sys.argv[1:])
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    if args.docs:
        into_docs(text)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump({"rows": run.rows, "shaping": run.shaping, "interconnect_mbs": run.interconnect_mbs,
                   "link_mbs": args.link_mbs, "mib": args.mib, "namespaces": cluster.tag,
                   "machine": platform.platform()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
