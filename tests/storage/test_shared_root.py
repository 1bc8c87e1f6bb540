"""Runs sharing one URL: a writer that never loaded refuses its first save into a root holding
another run's commits, so two runs never interleave steps and a restart never resumes from the
other run's step."""

from __future__ import annotations

import pytest
import torch

import distckpt


def test_a_new_job_that_never_loaded_cannot_save_under_an_old_runs_steps(tmp_path):
    old = {"w": torch.ones(3)}
    with distckpt.CheckpointManager(str(tmp_path), keep_last=1) as mgr:
        assert mgr.load_latest(old) is None
        mgr.save(10, old)
    new = {"w": torch.zeros(3)}
    with distckpt.CheckpointManager(str(tmp_path), keep_last=1) as mgr:
        with pytest.raises(distckpt.RunConflictError, match=r"steps \[10\].*load_latest\(state\) first"):
            mgr.save(6, new)
        assert mgr.committed_steps() == [10]  # the old run's checkpoint is untouched, nothing added


def test_two_jobs_that_never_loaded_do_not_interleave(tmp_path):
    a = distckpt.CheckpointManager(str(tmp_path))
    b = distckpt.CheckpointManager(str(tmp_path))
    a.save(1, {"x": 1})
    with pytest.raises(distckpt.RunConflictError):
        b.save(2, {"x": 2})
    a.save(3, {"x": 3})  # the first writer goes on
    assert a.committed_steps() == [3, 1]
    a.close()
    b.close()


def test_a_job_that_loaded_continues_the_run(tmp_path):
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"x": 1})
    state = {"x": 0}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.load_latest(state).step == 1
        mgr.save(2, state)
        assert mgr.committed_steps() == [2, 1]


def test_a_fresh_start_on_an_empty_root_saves_freely(tmp_path):
    with distckpt.CheckpointManager(str(tmp_path / "new")) as mgr:
        mgr.save(0, {"x": 1})
        mgr.save(1, {"x": 2})
        assert mgr.committed_steps() == [1, 0]


def test_a_full_disk_with_retention_says_the_disk_must_hold_keep_last_plus_one(tmp_path):
    import errno

    from distckpt.runtime import faults
    with distckpt.CheckpointManager(str(tmp_path), keep_last=2) as mgr:
        mgr.save(0, {"x": 0})

        def full(name, ctx):
            if name == "save/replicated-written":
                raise distckpt.StorageError(errno.ENOSPC, "No space left on device")

        remove = faults.on_point(full)
        try:
            with pytest.raises(distckpt.StorageError, match=r"keep_last \+ 1 = 3 checkpoints") as info:
                mgr.save(1, {"x": 1})
        finally:
            remove()
        assert info.value.errno == errno.ENOSPC
        assert mgr.committed_steps() == [0]


_PER_NODE_DIRECTORIES = """
import os, sys, torch, distckpt
info = distckpt.init_distributed(timeout=30.0)
torch.manual_seed(0)  # the same weights on both ranks (a model that differs is refused for that)
state = {"model": torch.nn.Linear(3, 2)}
mgr = distckpt.CheckpointManager(os.path.join(sys.argv[1], f"node{info.rank}"), timeout=30.0)
mgr.load_latest(state)
try:
    mgr.save(1, state)
    print(f"rank {info.rank}: SAVED", flush=True)
except distckpt.RankDisagreementError as e:
    print(f"rank {info.rank}: REFUSED {e}", flush=True)
mgr.close()
"""


def test_ranks_given_directories_that_are_not_one_storage_commit_nothing(tmp_path):
    """Each rank its own directory (a node-local path per node): the save is refused on every
    rank before any marker, never a committed step that no load can read."""
    import os
    import subprocess
    import sys

    script = tmp_path / "per_node.py"
    script.write_text(_PER_NODE_DIRECTORIES)
    root = tmp_path / "roots"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(script), str(root)],
                          capture_output=True, text=True, timeout=240)
    assert "rank 0: REFUSED" in done.stdout and "rank 1: REFUSED" in done.stdout, done.stdout + done.stderr
    assert "do not see one storage" in done.stdout
    committed = [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f == "COMMITTED"]
    assert committed == []
