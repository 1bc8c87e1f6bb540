"""What `make compose-demo-memory` adds to launch/compose_demo.py: jobs on machines, S3's request log.

With docker/compose.memory.yaml the node containers are machines that stay up (the job is started
on them with `docker exec`), so a restarted job finds each surviving node's /dev/shm; a node that
died is replaced by a fresh container. The nodes reach S3 through launch/s3count.py, which logs
every request with its response bytes; this module reads that log and the jobs' loss logs to check
what the restore read from S3 and which tier it came from. Host python3 only, like compose_demo.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

# An object inside a step directory (distckpt/io/manifest.py's step_dir: step-<9+ digits>):
# its payload, manifest or marker. Listings (GET /bucket?list-type=2&prefix=...) are not.
PAYLOAD_RE = re.compile(r"/step-\d{9,}/")
RESUMED_RE = re.compile(r"# resumed from step (\d+) epoch (\d+)(?: \((\w+) tier\))?$")
LOAD_RE = re.compile(r"# load_latest ([\d.]+) s, returned at ([\d.]+)$")
SHM_ROOT = "/dev/shm"


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
