"""`make compose-demo`: the docker-compose cluster for real, a node's container killed mid-run.

    python3 launch/compose_demo.py [--workdir DIR] [--kill-node 1] [--kill-after-step 15] [--offline] [--keep]
                                   [--memory-tier]

launch/cluster.py runs this topology as plain processes; here it runs in docker/compose.yaml's
containers: an S3 server (SeaweedFS) and two nodes, each a torchrun agent with 2 workers. The
job runs once uninterrupted, then once more with node 1's container SIGKILLed (agent and
workers at once, as a machine dies) after its ranks logged `--kill-after-step`, which is past a
checkpoint committed to S3. The surviving node's workers fail their next collective and its
agent exits; the job is started again on both nodes, as a scheduler restarts a job that lost a
node, and resumes from S3. Every (rank, step) loss is compared bit for bit with the
uninterrupted run. Exit status 0 only when identical and the restarted job resumed.

With --memory-tier (`make compose-demo-memory`) docker/compose.memory.yaml is layered on the
compose file: the nodes are machines that stay up (the job started on them by `docker exec`), each
with its own /dev/shm, and reach S3 through a counting proxy (launch/s3count.py). Node 1's machine
is killed and replaced by a fresh container with an empty /dev/shm; the restarted job must resume
from node 0's partner copy (Progress.tier "peer") at the newest committed step, bitwise, with no
GET of a step directory counted at S3 during the restore (launch/compose_memory.py reads the logs).

Needs docker and docker compose (v2 plugin) or docker-compose (v1); as root it starts dockerd
itself if the engine is not running. Without an image registry (no python:3.11-slim) the base
image is made with debootstrap by docker/offline-base.sh. Runs on the host's python3 alone: the
comparison code it shares with launch/demo.py and launch/cluster.py needs no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import compose_memory  # noqa: E402
from cluster import last_logged_step, read_env_file  # noqa: E402
from demo import compare, read_losses, resumed_from  # noqa: E402

PROJECT = "distckpt-demo"  # its own compose project: `down -v` never touches a cluster of yours
COMPOSE_FILE = os.path.join(ROOT, "docker", "compose.yaml")
# --memory-tier: the memory tier's variant layered on it, under a project of its own (the two
# demos can run side by side)
MEMORY_COMPOSE_FILE = os.path.join(ROOT, "docker", "compose.memory.yaml")
MEMORY_PROJECT = "distckpt-demo-memory"
REGISTRY_BASE = "python:3.11-slim"  # docker/Dockerfile's defaults (tests/distributed/test_cluster.py keeps them equal)
REGISTRY_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
OFFLINE_BASE = "distckpt-base:bookworm"
OFFLINE_TORCH_INDEX = "https://pypi.org/simple"  # + the base's local CPU wheel (docker/offline-base.sh)
INSTALL_HINT = ("install a container engine and compose, e.g. on Debian/Ubuntu: "
                "apt-get install docker.io docker-compose (or Docker Engine with its compose plugin, "
                "https://docs.docker.com/engine/install/)")


class DemoError(RuntimeError):
    pass


def sh(cmd: list[str], timeout: float | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, **kw)


def say(msg: str) -> None:
    print(msg, flush=True)


# --- the engine ----------------------------------------------------------------------------

def compose_command() -> list[str]:
    """`docker compose` (v2) where the plugin is there, else `docker-compose` (v1): both read the file."""
    if shutil.which("docker") is None:
        raise DemoError(f"the `docker` command is missing: {INSTALL_HINT}")
    if sh(["docker", "compose", "version"]).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise DemoError(f"neither `docker compose` nor `docker-compose` is installed: {INSTALL_HINT}")


def ensure_engine(workdir: str) -> str:
    """The engine answering `docker info`; as root, dockerd started here if it is not running.

    It is left running afterwards (it is the machine's engine, not part of the demo)."""
    if sh(["docker", "info"], timeout=60).returncode == 0:
        return "running"
    if os.geteuid() != 0 or shutil.which("dockerd") is None:
        raise DemoError("the container engine is not running and cannot be started from here: start it "
                        "(e.g. `sudo systemctl start docker`, or as root `dockerd &`), or run this as root")
    # overlay2 first; vfs (slow, but needs nothing of the kernel) where overlay2 will not mount,
    # e.g. when this machine is itself a container on an overlay file system.
    for extra in ([], ["--storage-driver=vfs"]):
        log_path = os.path.join(workdir, "dockerd.log")
        with open(log_path, "ab") as log:  # dockerd keeps its own copy of the descriptor
            proc = subprocess.Popen(["dockerd", *extra], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if sh(["docker", "info"], timeout=30).returncode == 0:
                return f"started dockerd {' '.join(extra)}(pid {proc.pid}, log {log_path})"
            time.sleep(1)
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
        say(f"engine: dockerd {' '.join(extra)}did not come up; see {log_path}")
    raise DemoError(f"could not start dockerd; see {os.path.join(workdir, 'dockerd.log')}")


def choose_base(offline: bool) -> tuple[str, str, str]:
    """(BASE, TORCH_INDEX, how it was chosen) for docker/Dockerfile's build arguments."""
    if os.environ.get("DISTCKPT_BASE"):
        return (os.environ["DISTCKPT_BASE"],
                os.environ.get("DISTCKPT_TORCH_INDEX", REGISTRY_TORCH_INDEX),
                "from DISTCKPT_BASE")
    if not offline:
        if sh(["docker", "image", "inspect", REGISTRY_BASE]).returncode == 0:
            return REGISTRY_BASE, REGISTRY_TORCH_INDEX, "present locally"
        try:
            pulled = sh(["docker", "pull", REGISTRY_BASE], timeout=120)
            if pulled.returncode == 0:
                return REGISTRY_BASE, REGISTRY_TORCH_INDEX, "pulled"
            why = (pulled.stderr.strip().splitlines() or ["failed"])[-1]
        except subprocess.TimeoutExpired:
            why = "timed out after 120s"
        say(f"base: no registry (docker pull {REGISTRY_BASE}: {why})")
    made = subprocess.run([os.path.join(ROOT, "docker", "offline-base.sh"), OFFLINE_BASE], check=False)
    if made.returncode != 0:
        raise DemoError("docker/offline-base.sh could not make the offline base image (see above)")
    return OFFLINE_BASE, OFFLINE_TORCH_INDEX, "debootstrap, docker/offline-base.sh"


# --- the cluster ----------------------------------------------------------------------------

class Cluster:
    """docker/compose.yaml (and the files layered on it) under its own project, with the losses in
    a host directory."""

    def __init__(self, compose: list[str], env: dict[str, str], workdir: str, files: tuple[str, ...] = (COMPOSE_FILE,),
                 project: str = PROJECT) -> None:
        self.base = [*compose, *(a for f in files for a in ("-f", f)), "-p", project]
        self.project = project
        self.env = env
        self.workdir = workdir
        self.log = os.path.join(workdir, "compose.log")

    def __call__(self, *args: str, run: str | None = None, check: bool = True,
                 timeout: float | None = 900) -> subprocess.CompletedProcess:
        env = {**self.env, **({"DISTCKPT_RUN": run} if run else {})}
        result = sh([*self.base, *args], timeout=timeout, env=env, cwd=ROOT)
        with open(self.log, "a") as f:
            f.write(f"$ {' '.join(self.base + list(args))}  (DISTCKPT_RUN={run})\n{result.stdout}{result.stderr}\n")
        if check and result.returncode != 0:
            raise DemoError(f"`compose {' '.join(args)}` failed ({result.returncode}):\n"
                            f"{(result.stdout + result.stderr)[-3000:]}")
        return result

    def container(self, service: str) -> str:
        """The id of the service's container (by compose's labels: the same for v1 and v2, and
        listed after it exited, which `compose ps` of v2 does not do)."""
        out = sh(["docker", "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={self.project}",
                  "--filter", f"label=com.docker.compose.service={service}",
                  "--filter", "label=com.docker.compose.oneoff=False"]).stdout.split()
        if len(out) != 1:
            raise DemoError(f"expected one container for {service}, found {out}")
        return out[0]

    def state(self, cid: str) -> tuple[bool, int]:
        running, code = sh(["docker", "inspect", "-f", "{{.State.Running}} {{.State.ExitCode}}", cid]).stdout.split()
        return running == "true", int(code)

    def wait(self, cids: list[str], timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        while True:
            states = [self.state(c) for c in cids]
            if not any(running for running, _ in states):
                return [code for _, code in states]
            if time.monotonic() > deadline:
                raise DemoError(f"the job did not finish within {timeout:g}s; see {self.log}")
            time.sleep(0.5)

    def nodes(self, count: int) -> list[str]:
        return [self.container(f"node{i}") for i in range(count)]


def run_job(cluster: Cluster, label: str, nodes: int, per_node: int, logs: str, timeout: float,
            kill: tuple[int, int] | None = None, first: bool = False) -> str:
    """One start of the job on every node's container; returns 'finished' or 'lost node'.

    The first start brings up s3 and bucket too (compose waits for s3's health check and the
    bucket); later ones pass --no-deps. A new DISTCKPT_RUN (label) recreates the node
    containers, as their environment changed; the same one starts the exited containers again."""
    cluster("up", "-d", "--no-build", *([] if first else ["--no-deps"]), *[f"node{i}" for i in range(nodes)],
            run=label)
    cids = cluster.nodes(nodes)
    started = time.monotonic()
    if kill is None:
        codes = cluster.wait(cids, timeout)
        if any(codes):
            raise DemoError(f"{label}: the job failed with exit codes {codes}; see {cluster.log} and "
                            f"{cluster.workdir}/containers.log")
        say(f"{label}: finished in {time.monotonic() - started:.0f}s (exit codes {codes})")
        return "finished"
    node, after_step = kill
    ranks = list(range(node * per_node, (node + 1) * per_node))
    deadline, polls = started + timeout, 0
    # Step `after_step` > CKPT_EVERY logged by the node's ranks means they returned from the save
    # of step CKPT_EVERY, and CheckpointManager.save returns only once the checkpoint is committed:
    # the kill comes after a commit to S3 (checked below with `distckpt ls`).
    while last_logged_step(logs, ranks) < after_step:
        polls += 1
        if polls % 20 == 0 and not all(cluster.state(c)[0] for c in cids):
            raise DemoError(f"{label}: a node exited before its ranks logged step {after_step}: "
                            f"{[cluster.state(c) for c in cids]}")
        if time.monotonic() > deadline:
            raise DemoError(f"{label}: step {after_step} not logged within {timeout:g}s")
        time.sleep(0.05)
    # `docker kill` (SIGKILL to the container's init, the torchrun agent: its whole PID namespace,
    # the workers with it, dies at once) rather than `compose kill`: the compose v1 command
    # takes a second to start, in which this job trains ten more steps.
    sh(["docker", "kill", cids[node]], timeout=60)
    lost_at = time.monotonic()
    say(f"{label}: node {node} logged step {after_step}, {lost_at - started:.0f}s after the start: SIGKILL to its "
        "container (agent and workers)")
    survivors = [c for i, c in enumerate(cids) if i != node]
    try:
        codes = cluster.wait(survivors, 120)
        say(f"{label}: the surviving node's agent exited ({codes}) {time.monotonic() - lost_at:.1f}s after the "
            "node was lost")
    except DemoError:
        # A job a scheduler sees lose a node is torn down whole; do that if the survivor hangs.
        for c in survivors:
            sh(["docker", "kill", c])
        say(f"{label}: the surviving node did not exit within 120s; killed it as a scheduler would")
    return "lost node"


def committed_steps(cluster: Cluster, url: str) -> list[int]:
    """`distckpt ls` of the checkpoint root, in a one-off container on the cluster's network."""
    listed = cluster("run", "--rm", "--no-deps", "-T", "node0", "python", "-m", "distckpt", "ls", "--json", url)
    return sorted(row["step"] for row in json.loads(listed.stdout) if row["status"] == "committed")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=None, help="loss logs and compose/container logs (default: a temporary directory)")
    p.add_argument("--kill-node", type=int, default=1)
    p.add_argument("--kill-after-step", type=int, default=15)
    p.add_argument("--offline", action="store_true", help="do not try the registry: build on docker/offline-base.sh's base")
    p.add_argument("--keep", action="store_true", help="leave the containers and volumes (no `down -v`) to inspect them")
    p.add_argument("--timeout", type=float, default=600, help="per start of the job, seconds")
    p.add_argument("--memory-tier", action="store_true", help="the memory tier's variant (docker/compose.memory.yaml): "
                   "node 1's machine replaced by a fresh one, which must resume from its partner's memory (the peer "
                   "tier) reading nothing of the step from S3")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    times: dict[str, float] = {}  # phase: seconds, for the closing line
    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="distckpt-compose-"))
    logs = os.path.join(workdir, "logs")  # bind-mounted at /logs in both nodes (DISTCKPT_LOGS)
    shutil.rmtree(logs, ignore_errors=True)  # a fresh run: stale logs would trigger the kill at once
    os.makedirs(logs, exist_ok=True)
    settings = read_env_file(os.path.join(ROOT, "docker", "cluster.env"))
    nodes, per_node, steps = int(settings["NNODES"]), int(settings["NPROC_PER_NODE"]), int(settings["STEPS"])
    if not int(settings["CKPT_EVERY"]) < args.kill_after_step < steps - 1:
        raise SystemExit(f"--kill-after-step must lie after the first checkpoint (step {settings['CKPT_EVERY']}) "
                         f"and before the last step ({steps - 1})")
    if not 0 <= args.kill_node < nodes:
        raise SystemExit(f"--kill-node must be one of 0..{nodes - 1}")
    say(f"compose demo: {nodes} nodes x {per_node} workers + S3 (SeaweedFS) in containers, {steps} steps, "
        f"checkpoints every {settings['CKPT_EVERY']}{', memory tier' if args.memory_tier else ''}; logs in {workdir}")
    try:
        compose = compose_command()
        start = time.monotonic()
        say(f"engine: {ensure_engine(workdir)}; compose: {' '.join(compose)}")
        times["engine"], start = time.monotonic() - start, time.monotonic()
        base, torch_index, how = choose_base(args.offline)
        times["base"] = time.monotonic() - start
        say(f"base: {base} ({how}); torch from {torch_index}")
    except DemoError as e:
        say(f"compose demo: {e}")
        return 2
    env = {**os.environ, "DISTCKPT_BASE": base, "DISTCKPT_TORCH_INDEX": torch_index, "DISTCKPT_LOGS": logs}
    if args.memory_tier:
        cluster = Cluster(compose, env, workdir, (COMPOSE_FILE, MEMORY_COMPOSE_FILE), MEMORY_PROJECT)
    else:
        cluster = Cluster(compose, env, workdir)
    bucket = settings["S3_BUCKET"]
    killed_logs = os.path.join(logs, "killed")
    memory_run = None
    try:
        cluster("down", "-v", "--remove-orphans", "--timeout", "1")  # what an interrupted earlier run left
        start = time.monotonic()
        say(f"image: building distckpt:cpu (log: {cluster.log})")
        cluster("build", timeout=None)
        # Each rebuild leaves the previous distckpt:cpu untagged; remove those (and only those:
        # the filter is the Dockerfile's label), so reruns do not fill the disk.
        sh(["docker", "image", "prune", "-f", "--filter", "label=distckpt.image=cpu"], timeout=300)
        times["build"], start = time.monotonic() - start, time.monotonic()
        say(f"image: built in {times['build']:.0f}s")

        if args.memory_tier:
            memory_run = compose_memory.memory_runs(cluster, nodes, per_node, logs, args, bucket, committed_steps)
        else:
            run_job(cluster, "reference", nodes, per_node, os.path.join(logs, "reference"), args.timeout, first=True)
            run_job(cluster, "killed", nodes, per_node, killed_logs, args.timeout,
                    kill=(args.kill_node, args.kill_after_step))
            committed = committed_steps(cluster, f"s3://{bucket}/killed")
            say(f"killed: committed in S3 when the node died: steps {committed} (s3://{bucket}/killed)")
            if not committed:
                raise DemoError("no checkpoint was committed before the kill")
            say("killed: starting the job again on both nodes")
            run_job(cluster, "killed", nodes, per_node, killed_logs, args.timeout)
        times["runs"] = time.monotonic() - start
    except (DemoError, RuntimeError, subprocess.TimeoutExpired) as e:
        say(f"compose demo: {e}")
        return 1
    finally:
        with open(os.path.join(workdir, "containers.log"), "w") as f:
            f.write(cluster("logs", "--no-color", check=False).stdout)
        start = time.monotonic()
        if args.keep:
            say(f"kept the containers: {' '.join(cluster.base)} down -v   # when done")
        else:  # containers, network and the S3 volume: a rerun starts fresh. A 1 s stop timeout:
            # SeaweedFS takes over 10 s to stop gracefully, and its data are being deleted anyway.
            cluster("down", "-v", "--remove-orphans", "--timeout", "1", check=False)
        times["clean-up"] = time.monotonic() - start
        say(f"compose demo: {time.monotonic() - t0:.0f}s in all ("
            + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()) + ")")

    result = compare(read_losses(os.path.join(logs, "reference")), read_losses(killed_logs),
                     show_steps=[0, args.kill_after_step, steps - 1])
    print(result.table)
    resumes = resumed_from(killed_logs)
    print("resumes:", resumes)
    if not resumes:
        print("VERDICT: the restarted job did not resume from a checkpoint")
        return 1
    failures = [] if memory_run is None else compose_memory.memory_verdict(
        memory_run, killed_logs, os.path.join(logs, "s3-requests.jsonl"), bucket, args.kill_node, per_node,
        nodes * per_node)
    for failure in failures:
        print(f"FAILED: {failure}")
    verdict = "bitwise identical" if result.identical else f"DIFFERENT from (rank, step) {result.first_difference}"
    what = (f"node {args.kill_node}'s machine killed and replaced by a fresh container" if args.memory_tier
            else f"node {args.kill_node}'s container killed")
    print(f"VERDICT: {verdict} — {result.steps} (rank, step) losses over {nodes} nodes in containers, "
          f"{what}, {resumes[-1]}" + (f"; {len(failures)} memory tier check(s) FAILED" if failures else ""))
    return 0 if result.identical and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
