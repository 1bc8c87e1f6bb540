"""How many cores this rank may use: the cores the process may run on, shared with the other
ranks of its node (torchrun's LOCAL_WORLD_SIZE). Helper threads (copies, digests) size to it."""

from __future__ import annotations

import os


def cores_per_rank() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_ranks = 1
    return max(1, cores // local_ranks)
