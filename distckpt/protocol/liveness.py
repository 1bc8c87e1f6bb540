"""Whether a peer rank's process still exists, where this process can tell: the same machine.

Rank 0 waits for the other ranks' reports of their files through the key-value store
(reports.StoreReports), which does not notice a peer's death: a rank SIGKILLed (or OOM-killed)
while writing its files left rank 0 waiting for the whole timeout (600 s by default; under
torchrun, until its SIGKILL 30 s after the teardown's SIGTERM, which a process blocked in that
wait did not act on). Each rank publishes who it is; a waiting rank 0 looks at the peers it
can see and fails the wait, naming the dead rank, as soon as one is gone.

"Can see" is strict: the same kernel boot and the same PID namespace (two containers of one host
have their own), and the process's start time, so a recycled PID is not taken for the rank.
Ranks on other machines are not judged here; their deaths reach rank 0 through the collectives.

This module never imports torch.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ProcessIdentity:
    boot_id: str      # the kernel boot: PIDs mean nothing across machines or reboots
    pid_namespace: int  # the PID namespace's inode: PIDs mean nothing across containers
    pid: int
    start_ticks: int  # /proc/<pid>/stat field 22: tells a recycled PID from the rank's process

    @classmethod
    def current(cls) -> "ProcessIdentity | None":
        """This process, or None where /proc cannot say (not Linux)."""
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot_id = f.read().strip()
            namespace = os.stat("/proc/self/ns/pid").st_ino
            pid = os.getpid()
            ticks = _start_ticks(pid)
        except (OSError, ValueError, IndexError):
            return None
        return None if ticks is None else cls(boot_id, namespace, pid, ticks)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> "ProcessIdentity | None":
        try:
            return cls(str(data["boot_id"]), int(data["pid_namespace"]), int(data["pid"]), int(data["start_ticks"]))
        except (TypeError, KeyError, ValueError):
            return None

    def is_gone(self, here: "ProcessIdentity | None") -> bool:
        """True only when this process is known to have ended: it ran where `here` runs (same
        boot, same PID namespace) and its PID now names no process, a zombie, or another process."""
        if here is None or (here.boot_id, here.pid_namespace) != (self.boot_id, self.pid_namespace):
            return False  # another machine or container: not for this process to judge
        try:
            ticks = _start_ticks(self.pid)
        except (OSError, ValueError, IndexError):
            return True  # no /proc/<pid>: no such process
        return ticks is None or ticks != self.start_ticks


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; None for a zombie (it has exited and
    waits only for its parent to collect its status). OSError when there is no such process."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()  # the name in parentheses may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])  # field 22 of the whole line: the 20th after the name
