"""The in-job side of `distckpt doctor` (tools/doctor.py runs the job twice and compares): the
hooks the manager calls at construction, after each save and commit, and at each load. Each is a
no-op unless the doctor set its environment variables for this job."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from typing import Any, Iterable

import torch

from distckpt.io.staging import memory_of
from distckpt.state.wrapped_optimizers import stepping_optimizer

ROOT_ENV = "DISTCKPT_DOCTOR_ROOT"
KILL_AFTER_ENV = "DISTCKPT_DOCTOR_KILL_AFTER"
KILL_RANK_ENV = "DISTCKPT_DOCTOR_KILL_RANK"
KILLED_MARK_ENV = "DISTCKPT_DOCTOR_KILLED_MARK"
STOP_AFTER_ENV = "DISTCKPT_DOCTOR_STOP_AFTER"
WORLD_MARK_ENV = "DISTCKPT_DOCTOR_WORLD_MARK"  # rank 0 writes the job's world size there once
EVERY_ENV = "DISTCKPT_DOCTOR_EVERY"  # --every K: fingerprint the parameters every K optimizer steps
FIRST = "first"  # --kill-at not given: kill after the first commit of the run
SAMPLES_ENV = "DISTCKPT_DOCTOR_SAMPLES"  # --resize: the folder each rank's doctor_record lines go to


# -- the hooks the manager calls ---------------------------------------------------------------

def root_override(url: Any) -> Any:
    """The doctor's root for this job, or `url` when not run by the doctor."""
    return os.environ.get(ROOT_ENV) or url


def local_override(local_dir: Any) -> Any:
    """The doctor's local tier for this job (next to its root), or `local_dir` unchanged."""
    root = os.environ.get(ROOT_ENV)
    return local_root(root) if root and local_dir is not None else local_dir


def doctor_record(step: int, *, epoch: int, samples: Iterable[Any] = (), loss: float | None = None) -> None:
    """Record what a training step consumed on this rank, for `distckpt doctor --resize`: the
    step, its epoch, the dataset indices of this rank's batch and its loss. Call on every rank
    once per step, after the step. A no-op unless the doctor runs the job (it sets
    DISTCKPT_DOCTOR_SAMPLES), so it can stay in the script."""
    folder = os.environ.get(SAMPLES_ENV)
    if not folder:
        return
    rank = int(os.environ.get("RANK", "0"))
    line = {"step": int(step), "epoch": int(epoch), "samples": [int(s) for s in samples],
            "loss": None if loss is None else float(loss)}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank-{rank}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


def keeps_everything() -> bool:
    """Under the doctor, retention is off in its roots, so that every step both runs committed
    can be compared (they are the doctor's own directories)."""
    return bool(os.environ.get(ROOT_ENV))


def local_root(root: str) -> str:
    return f"{root.rstrip('/')}-local"


def fingerprint_root(root: str) -> str:
    return f"{root.rstrip('/')}-fingerprints"


def notes_root(root: str) -> str:
    return f"{root.rstrip('/')}-notes"


LOADERS_LEFT_OUT = "loaders-left-out"  # <root>-notes/loaders-left-out-rank-R.txt: one line per loader found


def note_loaders_left_out(found: list[str], rank: int) -> None:
    """Called by a save with the loaders it found in the middle of a pass that no loader in `state`
    iterates (loader_hazards.positions_left_out, which the job is warned of): under the doctor,
    kept for its report, whose likely cause names them (the checkpoints alone cannot show what is
    not in them)."""
    root = os.environ.get(ROOT_ENV)
    if not root or not found:
        return
    os.makedirs(notes_root(root), exist_ok=True)
    with open(os.path.join(notes_root(root), f"{LOADERS_LEFT_OUT}-rank-{rank}.txt"), "a") as f:
        f.writelines(f"{line}\n" for line in found)


FIRST_PASS_DRAWS = "first-pass-draws"  # <root>-notes/first-pass-draws-rank-R.txt: one line per loader found


def note_first_pass_draws(found: list[str], rank: int) -> None:
    """Called by every save with the loaders outside `state` whose persistent workers drew their
    base seed from torch's global stream (loader_hazards.first_pass_draws_left_out, which the job
    is warned of): under the doctor, kept for its report (a resumed run draws that seed again at
    the loader's first pass, and only the job can see that loader)."""
    _note(FIRST_PASS_DRAWS, found, rank)


def _note(name: str, found: list[str], rank: int) -> None:
    root = os.environ.get(ROOT_ENV)
    if not root or not found:
        return
    path = os.path.join(notes_root(root), f"{name}-rank-{rank}.txt")
    known = set(open(path).read().splitlines()) if os.path.exists(path) else set()
    if not set(found) - known:
        return  # noted at an earlier save
    os.makedirs(notes_root(root), exist_ok=True)
    with open(path, "a") as f:
        f.writelines(f"{line}\n" for line in found if line not in known)


class _Fingerprints:
    """Under `--every K`: after every optimizer step, label it and, every K labels, append a hash
    of this rank's parameters to <root>-fingerprints/rank-R.txt. The label is the step of the
    last save or load plus the optimizer steps since, so both runs label a step alike even when
    a GradScaler skipped steps; it is the loop's step when each loop step steps once."""

    def __init__(self, every: int, path: str) -> None:
        self.every, self.path, self.base, self.since = every, path, -1, 0
        self.modules: list[Any] = []

    def rebase(self, step: int) -> None:
        self.base, self.since = step, 0

    def after_optimizer_step(self, *_: Any) -> None:
        self.since += 1
        label = self.base + self.since
        if label % self.every == 0:
            with open(self.path, "a") as f:
                f.write(f"{label} {self._digest()}\n")

    def _digest(self) -> str:
        import xxhash

        h = xxhash.xxh3_64()
        for module in self.modules:
            for name, p in module.named_parameters():
                local = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
                h.update(name.encode())
                h.update(memory_of(local.detach().cpu()))
        return h.hexdigest()


_fingerprints: _Fingerprints | None = None


def install_fingerprints(entries: list[Any], step: int | None, rank: int) -> None:
    """Called by every load (the step loaded, None on a fresh start): under `--every K`, hook the
    state's optimizers once and label the next optimizer step step+1."""
    global _fingerprints
    every, root = os.environ.get(EVERY_ENV), os.environ.get(ROOT_ENV)
    if not every or not root:
        return
    if _fingerprints is None:
        os.makedirs(fingerprint_root(root), exist_ok=True)
        _fingerprints = _Fingerprints(int(every), os.path.join(fingerprint_root(root), f"rank-{rank}.txt"))
    for entry in entries:
        if entry.kind_spec.holds_weights and entry.target not in _fingerprints.modules:
            _fingerprints.modules.append(entry.target)
        if not isinstance(entry.target, torch.optim.Optimizer):
            continue
        stepping = stepping_optimizer(entry.target)  # under a wrapper without hooks (Accelerate's)
        if not getattr(stepping, "_distckpt_fingerprinted", False):
            stepping.register_step_post_hook(_fingerprints.after_optimizer_step)
            stepping._distckpt_fingerprinted = True  # type: ignore[attr-defined]
    _fingerprints.rebase(-1 if step is None else step)


def rebase_fingerprints(step: int) -> None:
    """Called by every save: optimizer steps are counted from the saved step on."""
    if _fingerprints is not None:
        _fingerprints.rebase(step)


def after_commit(step: int, rank: int, world_size: int) -> None:
    """Called on every rank once the commit of `step` is known everywhere. Under the doctor: the
    chosen rank SIGKILLs itself after the chosen commit (once per doctor run), and with --steps
    every rank ends the job after the commit of that step (all ranks decide alike)."""
    stop = os.environ.get(STOP_AFTER_ENV)
    _note_world_size(rank, world_size)
    _maybe_kill(step, rank, world_size)
    if stop is not None and step >= int(stop):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _note_world_size(rank: int, world_size: int) -> None:
    """Rank 0 tells the doctor the job's world size (once): --kill-rank is checked against it."""
    mark = os.environ.get(WORLD_MARK_ENV)
    if mark is None or rank != 0 or os.path.exists(mark):
        return
    with open(mark, "w") as f:
        f.write(str(world_size))


def _maybe_kill(step: int, rank: int, world_size: int) -> None:
    target = os.environ.get(KILL_AFTER_ENV)
    mark = os.environ.get(KILLED_MARK_ENV)
    if target is None or mark is None or (target != FIRST and int(target) != step):
        return
    if rank != int(os.environ.get(KILL_RANK_ENV, world_size - 1)):
        return
    try:
        fd = os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # the relaunch must not kill again
    except FileExistsError:
        return
    os.write(fd, f"rank {rank} killed after step {step}\n".encode())
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def killed_after(mark: str) -> int | None:
    """The step the kill followed, as _maybe_kill wrote it in `mark` ("rank R killed after step N");
    None where the file is absent or says no such line."""
    try:
        with open(mark) as f:
            found = re.search(r"killed after step (-?\d+)", f.read())
    except OSError:
        return None
    return int(found.group(1)) if found else None
