"""A step whose rank file a load refuses — the file holds another rank, or a random stream that would
not restore — with every digest re-made (as a writer to the bucket can): `verify` said "ok", `export`
and `load_weights` took it, and `prune --keep-last 1` removed the older steps, leaving nothing a
resume could load. They now check the payload trees as a load does (protocol/payload_trees.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import distckpt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers"))
from forger import rewrite_trees  # noqa: E402

FORGERIES = {
    "another-rank": (r'\["rank", ?0\]', '["rank", 1]'),
    "numpy-position": (r'\["pos", ?\d+\]', '["pos", 99999]'),
}


def _forge_rank_file(root: str, step: int, pattern: str, replacement: str) -> None:
    assert rewrite_trees(root, step, pattern, replacement, files="ranks/") >= 1


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distckpt", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_step_every_load_skips_is_not_ok_to_verify_export_or_prune(tmp_path, forgery):
    root = str(tmp_path / "ckpt")
    with distckpt.CheckpointManager(root, keep_last=3) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, {"model": torch.nn.Linear(2, 2)})
    _forge_rank_file(root, 30, *FORGERIES[forgery])

    verify = _cli("verify", root, "--step", "30")
    assert verify.returncode == 1 and "rank-00000" in verify.stdout + verify.stderr, verify
    assert distckpt.export_weights(root, str(tmp_path / "out")).step == 20
    assert distckpt.load_weights(root, torch.nn.Linear(2, 2)).step == 20

    prune = _cli("prune", root, "--keep-last", "1")
    assert prune.returncode in (0, 1), prune
    state = {"model": torch.nn.Linear(2, 2)}
    with distckpt.CheckpointManager(root) as mgr:
        progress = mgr.load_latest(state)  # something a resume can still load
    assert progress is not None and progress.step == 20
