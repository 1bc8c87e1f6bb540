"""Run tests/helpers/elastic_loop.py under real torchrun, killed at one world size and resumed at
another, and account for every sample of the interrupted epoch."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
LOOP = os.path.join(HERE, "elastic_loop.py")
ROOT = os.path.dirname(os.path.dirname(HERE))


def torchrun(nproc: int, args: list[str], timeout: float = 300, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--max-restarts", "0",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--monitor-interval", "0.5", LOOP, *args]
    full = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=timeout)


@dataclass
class Step:
    rank: int
    step: int
    epoch: int
    loss: float
    ids: list[int]


@dataclass
class Log:
    steps: list[Step] = field(default_factory=list)
    events: dict[int, list[str]] = field(default_factory=dict)  # rank -> "# ..." lines


def read_log(directory: str) -> Log:
    log = Log()
    for name in sorted(os.listdir(directory)):
        rank = int(name[len("rank-"):-len(".txt")])
        with open(os.path.join(directory, name)) as f:
            for line in f:
                if line.startswith("#"):
                    log.events.setdefault(rank, []).append(line[1:].strip())
                    continue
                step, epoch, loss, ids = line.split()
                log.steps.append(Step(rank, int(step), int(epoch), float(loss), [int(i) for i in ids.split(",")]))
    return log


@dataclass
class Elastic:
    killed: Log
    resumed: Log
    rc: tuple[int, int]
    output: str

    def consumed(self, epoch: int, save_at: int) -> list[int]:
        """The interrupted epoch's sample ids as consumed across both runs, in global order: each
        run's ranks' ids interleaved as DistributedSampler deals them (rank r's i-th id at position
        r + world * i), the killed run's up to the checkpoint, then the resumed run's."""
        before = [s for s in self.killed.steps if s.epoch == epoch and s.step <= save_at]
        after = [s for s in self.resumed.steps if s.epoch == epoch]
        return _interleaved(before) + _interleaved(after)

    def epoch_ids(self, epoch: int) -> list[int]:
        return [i for s in self.resumed.steps if s.epoch == epoch for i in s.ids]


def run_elastic(tmp: str, old: int, new: int, save_at: int, extra: list[str] | None = None,
                ckpt: str | None = None, env: dict[str, str] | None = None, new_extra: list[str] | None = None,
                timeout: float = 300) -> Elastic:
    """The loop at `old` ranks, saving at step `save_at` and killed one step later; then at `new`
    ranks with world_size_policy='elastic' to the end."""
    ckpt = ckpt or os.path.join(tmp, "ckpt")
    extra = extra or []
    first = torchrun(old, ["--ckpt", ckpt, "--records", os.path.join(tmp, "log-killed"), "--save-at", str(save_at),
                           "--kill-after", str(save_at + 1), *extra], timeout, env)
    second = torchrun(new, ["--ckpt", ckpt, "--records", os.path.join(tmp, "log-resumed"), *extra, *(new_extra or [])],
                      timeout, env)
    return Elastic(read_log(os.path.join(tmp, "log-killed")), read_log(os.path.join(tmp, "log-resumed")),
                   (first.returncode, second.returncode), first.stderr[-3000:] + second.stderr[-3000:])


def counts(ids: list[int]) -> collections.Counter:
    return collections.Counter(ids)


def _interleaved(steps: list[Step]) -> list[int]:
    per_rank: dict[int, list[int]] = collections.defaultdict(list)
    for s in sorted(steps, key=lambda s: (s.rank, s.step)):
        per_rank[s.rank].extend(s.ids)
    ranks = [per_rank[r] for r in sorted(per_rank)]
    out = []
    for i in range(max((len(r) for r in ranks), default=0)):
        out.extend(r[i] for r in ranks if i < len(r))
    return out


def run_chain(tmp: str, worlds: list[int], saves: list[int], extra: list[str] | None = None,
              timeout: float = 300) -> tuple[list[Log], list[int]]:
    """Runs at worlds[0], worlds[1], ...: run i saves at saves[i] and is killed one step later, the
    last runs to the end; each resumes the previous one's checkpoint (elastic, or exact at the same
    size). Returns every run's log and return code."""
    ckpt = os.path.join(tmp, "ckpt")
    logs, codes = [], []
    for i, world in enumerate(worlds):
        args = ["--ckpt", ckpt, "--records", os.path.join(tmp, f"log-{i}"), *(extra or [])]
        if i < len(saves):
            args += ["--save-at", str(saves[i]), "--kill-after", str(saves[i] + 1)]
        codes.append(torchrun(world, args, timeout).returncode)
        logs.append(read_log(os.path.join(tmp, f"log-{i}")))
    return logs, codes


def chain_consumed(logs: list[Log], saves: list[int], epoch: int = 0) -> list[int]:
    """The epoch's ids in dealing order across a chain: run i's steps after the previous save up
    to its own save (the last run: all its steps of the epoch)."""
    out: list[int] = []
    for i, log in enumerate(logs):
        low = saves[i - 1] if i else -1
        high = saves[i] if i < len(saves) else 1 << 60
        out += _interleaved([s for s in log.steps if s.epoch == epoch and low < s.step <= high])
    return out
