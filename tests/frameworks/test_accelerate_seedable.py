"""Accelerate's SeedableRandomSampler (`use_seedable_sampler=True`; the HF Trainer's default) under a
prepared loader with workers, resumed from a save at a pass's last batch or a few batches before it:
every batch after the resume is the uninterrupted run's. The restore replays the saved pass, and the
workers' fetch-ahead ran the sampler past its end, which counted an epoch the uninterrupted run had
counted already: the next epoch took the order of the one after it, silently."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

LOOP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers", "seedable_loop.py")


def _batches(root: str, *args: str) -> list[str]:
    out = subprocess.run([sys.executable, LOOP, root, *args], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


@pytest.mark.parametrize("save_at", [7, 5])  # the first pass's last batch; two batches before it
def test_a_seedable_sampler_with_workers_resumes_every_batch_exactly(tmp_path, save_at):
    pytest.importorskip("accelerate")
    reference = _batches(str(tmp_path / "reference"), "2")
    assert len(reference) == 24
    root = str(tmp_path / "run")
    assert _batches(root, "2", str(save_at)) == reference[:save_at + 1]
    assert _batches(root, "2") == reference[save_at + 1:]
