"""The compose cluster's topology as plain processes on loopback (see launch/cluster.sh).

An S3 server (SeaweedFS), then two "nodes", each `launch/node.sh` — a torchrun agent with its
workers, joined by c10d rendezvous — with the settings of docker/cluster.env. The cluster runs
once uninterrupted and once with node 1 SIGKILLed (agent and every worker) after it logged step
`--kill-after-step`; the surviving node's workers then fail their next collective and its agent
exits, and the job is started again on both nodes, as a scheduler restarts a multi-node job
that lost a node. The restarted job resumes from the last checkpoint committed to S3, and every
rank's loss is compared bit for bit with the uninterrupted run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from demo import compare, read_losses, resumed_from  # noqa: E402
from seaweed import SeaweedS3, free_ports  # noqa: E402


def read_env_file(path: str) -> dict[str, str]:
    out = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, value = line.partition("=")
                out[key.strip()] = value.strip()
    return out


def start_node(name: str, env: dict[str, str], log_dir: str) -> subprocess.Popen:
    out = open(os.path.join(log_dir, f"{name}.out"), "ab")
    return subprocess.Popen([os.path.join(HERE, "node.sh")], env=env, stdout=out, stderr=subprocess.STDOUT,
                            cwd=ROOT, start_new_session=True)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_node(proc: subprocess.Popen) -> None:
    """A dead node: SIGKILL to the agent and all its workers at once."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def last_logged_step(log_dir: str, ranks: list[int]) -> int:
    steps = read_losses(log_dir) if os.path.isdir(log_dir) else {}
    return min((max(steps.get(r, {}) or [-1]) for r in ranks), default=-1)


def run_job(label: str, attempt: int, base_env: dict[str, str], workdir: str, nodes: int,
            kill: tuple[int, int] | None, timeout: float, tiers: dict[str, str] | None = None) -> str:
    """One start of the job on every node; returns 'finished' or 'lost node'."""
    port = free_ports(1)[0]
    loss_log = os.path.join(workdir, f"log-{label}")
    if attempt == 0 and os.path.isdir(loss_log):
        shutil.rmtree(loss_log)  # a fresh run: stale logs would trigger the kill at once
    os.makedirs(loss_log, exist_ok=True)
    procs = []
    for node in range(nodes):
        env = {**base_env, "RDZV_HOST": "127.0.0.1", "RDZV_PORT": str(port), "RDZV_ID": f"{label}-{attempt}",
               "CKPT_URL": f"s3://{base_env['S3_BUCKET']}/{label}", "LOSS_LOG": loss_log,
               "NODE_NAME": f"node{node}"}
        if tiers is not None:  # each node's own local tier (its "local disk"), named as its node
            env.update({"LOCAL_DIR": os.path.join(workdir, f"local-{label}-node{node}"), "DISTCKPT_NODE": f"node{node}",
                        "DURABLE_EVERY": tiers["durable_every"]})
        procs.append(start_node(f"{label}-node{node}-attempt{attempt}", env, workdir))
    deadline = time.monotonic() + timeout
    per_node = int(base_env["NPROC_PER_NODE"])
    lost_at = None
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            for p in procs:
                kill_node(p)
            raise RuntimeError(f"{label} attempt {attempt}: the job did not finish within {timeout:g}s")
        if kill is not None:
            node, after_step = kill
            ranks = list(range(node * per_node, (node + 1) * per_node))
            if last_logged_step(loss_log, ranks) >= after_step:
                print(f"{label}: node {node} logged step {after_step}: SIGKILL to its agent and workers", flush=True)
                kill_node(procs[node])
                kill = None
                lost_at = time.monotonic()
        time.sleep(0.2)
    codes = [p.returncode for p in procs]
    if all(c == 0 for c in codes):
        return "finished"
    if lost_at is not None:
        print(f"{label}: the surviving node's agent exited ({codes}) {time.monotonic() - lost_at:.1f}s after the node was lost",
              flush=True)
        return "lost node"
    raise RuntimeError(f"{label} attempt {attempt} failed with exit codes {codes}; see {workdir}/*.out")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=None, help="logs, S3 data (default: a temporary directory)")
    p.add_argument("--kill-node", type=int, default=1)
    p.add_argument("--kill-after-step", type=int, default=15)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--local-tier", action="store_true",
                   help="two tiers: each node saves to a local dir of its own, every 2nd save also to S3")
    p.add_argument("--replace-node", action="store_true",
                   help="with --local-tier: the killed node comes back with an empty local dir (every save durable)")
    args = p.parse_args(argv)
    tiers = {"durable_every": "1" if args.replace_node else "2"} if args.local_tier else None
    workdir = args.workdir or tempfile.mkdtemp(prefix="distckpt-cluster-")
    if os.path.isdir(os.path.join(workdir, "s3")):
        shutil.rmtree(os.path.join(workdir, "s3"))  # a fresh bucket for a fresh run
    os.makedirs(workdir, exist_ok=True)
    settings = read_env_file(os.path.join(ROOT, "docker", "cluster.env"))
    nodes = int(settings["NNODES"])
    s3 = SeaweedS3(os.path.join(workdir, "s3")).start()
    try:
        s3.make_bucket(settings["S3_BUCKET"])
        env = {**os.environ, **settings, **s3.env(), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT}
        print(f"S3 at {s3.endpoint}; {nodes} nodes x {settings['NPROC_PER_NODE']} workers; logs in {workdir}", flush=True)
        run_job("reference", 0, env, workdir, nodes, None, args.timeout)
        outcome = run_job("killed", 0, env, workdir, nodes, (args.kill_node, args.kill_after_step), args.timeout, tiers)
        if outcome != "lost node":
            raise RuntimeError("the node was never killed: the run finished before --kill-after-step")
        if args.replace_node:
            shutil.rmtree(os.path.join(workdir, f"local-killed-node{args.kill_node}"), ignore_errors=True)
            print(f"killed: node {args.kill_node} replaced (its local tier is gone)", flush=True)
        print("killed: starting the job again on both nodes", flush=True)
        run_job("killed", 1, env, workdir, nodes, None, args.timeout, tiers)
    finally:
        s3.stop()
    result = compare(read_losses(os.path.join(workdir, "log-reference")), read_losses(os.path.join(workdir, "log-killed")),
                     show_steps=[0, args.kill_after_step, int(settings["STEPS"]) - 1])
    print(result.table)
    resumes = resumed_from(os.path.join(workdir, "log-killed"))
    print("resumes:", resumes)
    if not resumes:
        print("VERDICT: the restarted job did not resume from a checkpoint")
        return 1
    verdict = "bitwise identical" if result.identical else f"DIFFERENT from (rank, step) {result.first_difference}"
    print(f"VERDICT: {verdict} — {result.steps} (rank, step) losses over {nodes} nodes")
    return 0 if result.identical else 1


if __name__ == "__main__":
    sys.exit(main())
