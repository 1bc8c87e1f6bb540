"""Retention and garbage collection (rank 0 only, after a commit).

A checkpoint is deleted marker first, then data, so a half-deleted checkpoint is never seen
as committed. Leftovers of saves that never committed are removed once they are older than a
grace period (a save in progress elsewhere must not be collected under its writer).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from . import manifest as mf
from .errors import DistCkptError
from .storage import Storage

log = logging.getLogger("distckpt")


@dataclass(frozen=True)
class Committed:
    step: int
    metric: float | None


def plan_retention(committed: list[Committed], keep_last: int | None, keep_best: int | None,
                   best_mode: str) -> list[int]:
    """Steps to delete: everything outside the newest `keep_last` and the best `keep_best`."""
    if keep_last is None and keep_best is None:
        return []
    by_step = sorted(committed, key=lambda c: c.step, reverse=True)
    keep = {c.step for c in by_step[:keep_last]} if keep_last is not None else {c.step for c in by_step}
    if keep_best:
        scored = [(c.metric, c.step) for c in by_step if c.metric is not None]
        scored.sort(key=lambda ms: ms[0] if best_mode == "min" else -ms[0])
        keep |= {step for _, step in scored[:keep_best]}

    return sorted(c.step for c in committed if c.step not in keep)


def read_committed(storage: Storage, steps: list[int]) -> list[Committed]:
    out = []
    for step in steps:
        try:
            manifest = json.loads(storage.read_bytes(f"{mf.step_dir(step)}/{mf.MANIFEST}", mf._MAX_MANIFEST_BYTES))
            metric = manifest.get("metric") if isinstance(manifest, dict) else None
        except (OSError, ValueError, RecursionError) as e:  # unreadable: never "best", still subject to keep_last
            log.warning("retention: cannot read the manifest of step %d: %s", step, e)
            metric = None
        out.append(Committed(step, metric if isinstance(metric, (int, float)) else None))
    return out


def delete_checkpoint(storage: Storage, step: int) -> None:
    base = mf.step_dir(step)
    storage.remove_file(f"{base}/{mf.MARKER}")  # first: from here on it is not committed
    storage.remove_tree(base)


def collect_leftovers(storage: Storage, grace_s: float, now: float | None = None) -> list[str]:
    """Remove step directories without a marker that are older than `grace_s`; returns them."""
    now = time.time() if now is None else now
    removed = []
    for name in storage.list_dir(""):
        if mf.parse_step_dir(name) is None or storage.exists(f"{name}/{mf.MARKER}"):
            continue
        try:
            newest = storage.newest_mtime(name)
            if newest is not None and now - newest < grace_s:
                continue
            log.info("collecting %s/%s: an uncommitted save", storage.url, name)
            storage.remove_tree(name)
        except (OSError, DistCkptError) as e:  # a stray file of that name: not ours, left alone
            log.warning("gc: skipping %s/%s: %s", storage.url, name, e)
            continue
        removed.append(name)
    aborted = storage.collect_abandoned_uploads(grace_s)
    if aborted:
        log.info("aborted %d abandoned multipart upload(s) under %s", aborted, storage.url)
    return removed
