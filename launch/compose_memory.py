"""What `make compose-demo-memory` adds to launch/compose_demo.py: jobs on machines, S3's request log.

With docker/compose.memory.yaml the node containers are machines that stay up (the job is started
on them with `docker exec`), so a restarted job finds each surviving node's /dev/shm; a node that
died is replaced by a fresh container. The nodes reach S3 through launch/s3count.py, which logs
every request with its response bytes. This module runs the three starts of the job on those
machines (memory_runs: the reference, the run whose node 1 dies, the restart on a fresh node 1)
and checks the outcome (memory_verdict: the tier each rank resumed from, what S3 served during the
restore, the time to the replacement's first step); compose_demo builds the image, compares the
losses and cleans up. Host python3 only, like compose_demo.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import unquote, urlsplit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import last_logged_step  # noqa: E402

# An object inside a step directory (distckpt/io/manifest.py's step_dir: step-<9+ digits>):
# its payload, manifest or marker. Listings (GET /bucket?list-type=2&prefix=...) are not.
PAYLOAD_RE = re.compile(r"/step-\d{9,}/")
RESUMED_RE = re.compile(r"# resumed from step (\d+) epoch (\d+)(?: \((\w+) tier\))?$")
LOAD_RE = re.compile(r"# load_latest ([\d.]+) s, returned at ([\d.]+)$")
SHM_ROOT = "/dev/shm"


class JobError(RuntimeError):
    """The memory tier's run failed before its checks could run (the message says where)."""


class ComposeCluster(Protocol):
    """What is used of launch/compose_demo.py's Cluster."""
    workdir: str

    def __call__(self, *args: str, run: str | None = None, check: bool = True,
                 timeout: float | None = 900) -> subprocess.CompletedProcess: ...

    def container(self, service: str) -> str: ...

    def state(self, cid: str) -> tuple[bool, int]: ...


def say(msg: str) -> None:
    print(msg, flush=True)


@dataclass(frozen=True)
class Request:
    """One line of launch/s3count.py's log."""
    t: float
    method: str
    path: str
    status: int
    bytes: int  # response body
    sent: int   # request body

    @property
    def object_path(self) -> str:
        return unquote(urlsplit(self.path).path)

    @property
    def payload(self) -> bool:
        return PAYLOAD_RE.search(self.object_path) is not None


def read_requests(path: str) -> list[Request]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [Request(**json.loads(line)) for line in f if line.strip()]


@dataclass(frozen=True)
class Traffic:
    """The requests S3 answered in a window of time, summed."""
    requests: list[Request]

    @property
    def response_bytes(self) -> int:
        return sum(r.bytes for r in self.requests)

    @property
    def payload_gets(self) -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and r.payload]

    @property
    def payload_get_bytes(self) -> int:
        return sum(r.bytes for r in self.payload_gets)

    def describe(self) -> str:
        kinds: dict[str, list[int]] = {}
        for r in self.requests:
            where = "of a step directory" if r.payload else "listing" if "?" in r.path else "of another object"
            kind = f"{r.method} {where}"
            count_bytes = kinds.setdefault(kind, [0, 0])
            count_bytes[0] += 1
            count_bytes[1] += r.bytes
        return ", ".join(f"{n} {kind} ({b} B)" for kind, (n, b) in sorted(kinds.items())) or "none"


def window(requests: list[Request], since: float, until: float) -> Traffic:
    return Traffic([r for r in requests if since <= r.t <= until])


def uploaded_step_bytes(requests: list[Request], bucket: str, run: str, step: int) -> int:
    """Request body bytes written under the step's directory: what a restore from S3 would read."""
    prefix = f"/{bucket}/{run}/step-{step:09d}/"
    return sum(r.sent for r in requests if r.method in ("PUT", "POST") and r.object_path.startswith(prefix))


@dataclass(frozen=True)
class Load:
    """A rank's last resume, from its loss log (launch/train.py --memory-tier)."""
    step: int
    tier: str
    seconds: float
    returned_at: float  # wall clock


def read_loads(log_dir: str) -> dict[int, Load]:
    out = {}
    for name in sorted(os.listdir(log_dir)):
        match = re.fullmatch(r"rank-(\d+)\.txt", name)
        if not match:
            continue
        resumed = loaded = None
        with open(os.path.join(log_dir, name)) as f:
            for line in f:
                resumed = RESUMED_RE.match(line.rstrip("\n")) or resumed
                loaded = LOAD_RE.match(line.rstrip("\n")) or loaded
        if resumed and loaded:
            out[int(match.group(1))] = Load(int(resumed.group(1)), resumed.group(3) or "?",
                                            float(loaded.group(1)), float(loaded.group(2)))
    return out


def steps_after_resume(log_dir: str, rank: int) -> list[int]:
    """The steps a rank logged after its last `# resumed` line (none where it never resumed)."""
    path = os.path.join(log_dir, f"rank-{rank}.txt")
    if not os.path.exists(path):
        return []
    steps: list[int] | None = None
    with open(path) as f:
        for line in f:
            if line.startswith("# resumed"):
                steps = []
            elif steps is not None and line[:1].isdigit():
                steps.append(int(line.split()[0]))
    return steps or []


# --- the machines ----------------------------------------------------------------------------

def exec_job(cid: str, out_path: str) -> subprocess.Popen:
    """Start the job's part on a node: launch/node.sh in its running container, output to out_path."""
    with open(out_path, "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(["docker", "exec", cid, "launch/node.sh"], stdout=out, stderr=subprocess.STDOUT)


def stop_job(cid: str) -> None:
    """SIGKILL the job's processes on a node whose machine stays up (its /dev/shm with it), as a
    scheduler ends a job's processes on the nodes it keeps: every process but the container's own."""
    script = ("import os, signal\n"
              "keep = {1, os.getpid(), os.getppid()}\n"
              "for pid in [int(p) for p in os.listdir('/proc') if p.isdigit()]:\n"
              "    try:\n"
              "        cmd = open(f'/proc/{pid}/cmdline', 'rb').read()\n"
              "        if pid not in keep and (b'launch/train.py' in cmd or b'torch.distributed.run' in cmd):\n"
              "            os.kill(pid, signal.SIGKILL)\n"
              "    except OSError:\n"
              "        pass\n")
    subprocess.run(["docker", "exec", cid, "python", "-c", script], check=False, capture_output=True, timeout=60)


def shm_steps(cid: str) -> list[str]:
    """The memory tier's step directories in a node's /dev/shm, relative to it (own and partner copies)."""
    found = subprocess.run(["docker", "exec", cid, "find", SHM_ROOT, "-mindepth", "1", "-maxdepth", "5",
                            "-type", "d", "-name", "step-*"], check=False, capture_output=True, text=True, timeout=60)
    if found.returncode != 0:
        raise RuntimeError(f"could not list {SHM_ROOT} in container {cid}: {found.stderr.strip()}")
    return sorted(os.path.relpath(p, SHM_ROOT) for p in found.stdout.split())


def shm_entries(cid: str) -> list[str]:
    listed = subprocess.run(["docker", "exec", cid, "ls", "-A", SHM_ROOT], check=False, capture_output=True,
                            text=True, timeout=60)
    if listed.returncode != 0:
        raise RuntimeError(f"could not list {SHM_ROOT} in container {cid}: {listed.stderr.strip()}")
    return listed.stdout.split()


def shm_size(cid: str) -> int:
    """The size of a node's /dev/shm in bytes (compose's shm_size)."""
    df = subprocess.run(["docker", "exec", cid, "df", "-B1", "--output=size", SHM_ROOT], check=False,
                        capture_output=True, text=True, timeout=60)
    return int(df.stdout.split()[-1]) if df.returncode == 0 else -1


# --- the runs -------------------------------------------------------------------------------

@dataclass
class MemoryRun:
    """What the memory tier's run measured, for the checks after it."""
    committed: list[int]           # steps committed in S3 when the node died
    restart_wall: float            # wall clock when the job was started again (S3's log is counted from it)
    replaced_to_first_step: float  # seconds from `up` of the fresh container to its ranks' first resumed step
    replace_up: float              # of which `up` itself (container created and started)
    survivor_shm: list[str]        # the memory tier's steps in the surviving node's /dev/shm at the restart


def start_jobs(cids: list[str], label: str, workdir: str) -> list[subprocess.Popen]:
    return [exec_job(cid, os.path.join(workdir, f"{label}-node{i}.out")) for i, cid in enumerate(cids)]


def wait_jobs(jobs: list[subprocess.Popen], cids: list[str], label: str, timeout: float, workdir: str) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(job.poll() is None for job in jobs):
        if time.monotonic() > deadline:
            for cid in cids:
                stop_job(cid)
            raise JobError(f"{label}: the job did not finish within {timeout:g}s; see {workdir}/{label}-node*.out")
        time.sleep(0.2)
    return [job.returncode for job in jobs]


def machines_up(cluster: ComposeCluster, label: str, services: list[str], *flags: str) -> list[str]:
    """`up` the node containers (idle machines: the job is started on them by exec); their ids."""
    cluster("up", "-d", "--no-build", *flags, *services, run=label)
    return [cluster.container(s) for s in services]


def run_on_machines(cluster: ComposeCluster, label: str, nodes: int, logs: str, timeout: float, first: bool = False) -> None:
    """An uninterrupted run: fresh machines (a new DISTCKPT_RUN recreates them), the job on each."""
    names = [f"node{i}" for i in range(nodes)]
    cids = machines_up(cluster, label, names, *([] if first else ["--no-deps"]))
    started = time.monotonic()
    codes = wait_jobs(start_jobs(cids, label, cluster.workdir), cids, label, timeout, cluster.workdir)
    if any(codes):
        raise JobError(f"{label}: the job failed with exit codes {codes}; see {cluster.workdir}/{label}-node*.out")
    say(f"{label}: finished in {time.monotonic() - started:.0f}s (exit codes {codes})")


def kill_machine(cluster: ComposeCluster, label: str, nodes: int, per_node: int, logs: str, timeout: float,
                 node: int, after_step: int) -> list[str]:
    """Fresh machines, the job on each, machine `node` SIGKILLed once its ranks logged `after_step`;
    the other machines stay up, their jobs ended. Returns the container ids."""
    cids = machines_up(cluster, label, [f"node{i}" for i in range(nodes)], "--no-deps")
    jobs = start_jobs(cids, label, cluster.workdir)
    started = time.monotonic()
    ranks = list(range(node * per_node, (node + 1) * per_node))
    while last_logged_step(logs, ranks) < after_step:  # past a commit: see compose_demo.run_job
        if any(job.poll() is not None for job in jobs):
            raise JobError(f"{label}: a node's job exited before step {after_step}: {[j.poll() for j in jobs]}")
        if time.monotonic() > started + timeout:
            raise JobError(f"{label}: step {after_step} not logged within {timeout:g}s")
        time.sleep(0.05)
    subprocess.run(["docker", "kill", cids[node]], check=False, capture_output=True, timeout=60)
    lost_at = time.monotonic()
    say(f"{label}: node {node} logged step {after_step}, {lost_at - started:.0f}s after the start: SIGKILL to its "
        "container (the machine: agent, workers and its /dev/shm)")
    survivors = [(job, cid) for i, (job, cid) in enumerate(zip(jobs, cids)) if i != node]
    deadline = lost_at + 120
    while any(job.poll() is None for job, _ in survivors) and time.monotonic() < deadline:
        time.sleep(0.2)
    if any(job.poll() is None for job, _ in survivors):
        for job, cid in survivors:  # a job that lost a node is torn down whole: its processes, not the machines
            stop_job(cid)
            job.wait(timeout=60)
        say(f"{label}: the surviving node's job did not exit within 120s; ended its processes as a scheduler would")
    else:
        say(f"{label}: the surviving node's job exited ({[job.returncode for job, _ in survivors]}) "
            f"{time.monotonic() - lost_at:.1f}s after the node was lost; its machine stays up")
    for _, cid in survivors:
        if not cluster.state(cid)[0]:
            raise JobError(f"{label}: a surviving machine's container stopped with its job: its /dev/shm is gone")
    return cids


def replace_and_restart(cluster: ComposeCluster, label: str, nodes: int, per_node: int, logs: str, timeout: float,
                        node: int, old: list[str]) -> tuple[float, float, float]:
    """Machine `node` replaced by a fresh container (empty /dev/shm), the job started on every
    machine again. Returns (the restart's wall clock, seconds from the replacement's `up` to its
    ranks' first resumed step, seconds of that `up`)."""
    replaced_at = time.monotonic()
    new = machines_up(cluster, label, [f"node{node}"], "--no-deps", "--force-recreate")[0]
    replace_up = time.monotonic() - replaced_at
    if new == old[node]:
        raise JobError(f"{label}: node {node}'s container was not replaced")
    leftover = shm_entries(new)
    if leftover:
        raise JobError(f"{label}: the replacement for node {node} has a /dev/shm that is not empty: {leftover}")
    cids = [new if i == node else cid for i, cid in enumerate(old)]
    say(f"{label}: node {node} replaced by a fresh container in {replace_up:.1f}s (/dev/shm of "
        f"{shm_size(new) >> 20} MiB, empty); starting the job on both nodes")
    restart_wall = time.time()
    jobs = start_jobs(cids, f"{label}-restart", cluster.workdir)
    ranks = range(node * per_node, (node + 1) * per_node)
    first_step = None
    while first_step is None and any(job.poll() is None for job in jobs):
        if all(steps_after_resume(logs, r) for r in ranks):
            first_step = time.monotonic() - replaced_at
        elif time.monotonic() > replaced_at + timeout:
            break
        time.sleep(0.05)
    codes = wait_jobs(jobs, cids, label, timeout, cluster.workdir)
    if any(codes) or first_step is None:
        raise JobError(f"{label}: the restarted job failed (exit codes {codes}); see {cluster.workdir}/{label}-restart-node*.out")
    say(f"{label}: the restarted job finished (exit codes {codes})")
    return restart_wall, first_step, replace_up


def memory_runs(cluster: ComposeCluster, nodes: int, per_node: int, logs: str, args: argparse.Namespace,
                bucket: str, list_committed: Callable[[ComposeCluster, str], list[int]]) -> MemoryRun:
    """The reference run, the run whose machine dies, its replacement and the restart."""
    killed = os.path.join(logs, "killed")
    run_on_machines(cluster, "reference", nodes, os.path.join(logs, "reference"), args.timeout, first=True)
    cids = kill_machine(cluster, "killed", nodes, per_node, killed, args.timeout, args.kill_node, args.kill_after_step)
    committed = list_committed(cluster, f"s3://{bucket}/killed")
    say(f"killed: committed in S3 when the node died: steps {committed} (s3://{bucket}/killed)")
    if not committed:
        raise JobError("no checkpoint was committed before the kill")
    survivor_shm = [step for i, cid in enumerate(cids) if i != args.kill_node for step in shm_steps(cid)]
    say(f"killed: the surviving machine's /dev/shm holds {survivor_shm}")
    restart_wall, first_step, replace_up = replace_and_restart(cluster, "killed", nodes, per_node, killed, args.timeout,
                                                               args.kill_node, cids)
    return MemoryRun(committed, restart_wall, first_step, replace_up, survivor_shm)


def memory_verdict(run: MemoryRun, killed_logs: str, requests_log: str, bucket: str, node: int,
                   per_node: int, world: int) -> list[str]:
    """Prints what the restore did and read from S3; returns the failed checks (none: it passed)."""
    failures = []
    loads = read_loads(killed_logs)
    newest = max(run.committed)
    print("loads:", {rank: f"step {ld.step} from the {ld.tier} tier in {ld.seconds:.2f}s" for rank, ld in loads.items()})
    if set(loads) != set(range(world)) or any((ld.step, ld.tier) != (newest, "peer") for ld in loads.values()):
        failures.append(f"every rank of {world} should have resumed step {newest} (the newest committed before "
                        f"the kill) from the peer tier: {loads}")
    requests = read_requests(requests_log)
    load_end = max((ld.returned_at for ld in loads.values()), default=run.restart_wall)
    restore = window(requests, run.restart_wall, load_end)
    step_size = uploaded_step_bytes(requests, bucket, "killed", newest)
    print(f"S3 during the restore ({load_end - run.restart_wall:.1f}s from the restart to the last rank's "
          f"load_latest, counted at the S3 service by launch/s3count.py): {len(restore.requests)} requests, "
          f"{restore.response_bytes} bytes in all: {restore.describe()}; GETs of step directories: "
          f"{restore.payload_get_bytes} bytes (step {newest} is {step_size} bytes in S3)")
    if not restore.requests:
        failures.append(f"no S3 request counted during the restore: is {requests_log} written by launch/s3count.py?")
    if restore.payload_get_bytes or restore.payload_gets:
        failures.append(f"the restore read step directories from S3: {[r.path for r in restore.payload_gets][:5]}")
    if not step_size:
        failures.append(f"no upload of step {newest} counted: the nodes do not reach S3 through launch/s3count.py")
    node_loads = [loads[r] for r in range(node * per_node, (node + 1) * per_node) if r in loads]
    began = max((ld.returned_at - ld.seconds for ld in node_loads), default=float("nan")) - run.restart_wall
    print(f"replacement node {node}: {run.replaced_to_first_step:.1f}s from `up` of its fresh container to its ranks' "
          f"first resumed step (container up {run.replace_up:.1f}s; from the job's start to load_latest {began:.1f}s: "
          f"torchrun, imports, rendezvous, process group; load_latest "
          f"{max((ld.seconds for ld in node_loads), default=float('nan')):.2f}s on its ranks)")
    return failures
