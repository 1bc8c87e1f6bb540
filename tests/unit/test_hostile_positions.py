"""A loader position forged in a checkpoint (digests re-made, as a writer to the bucket can): a count
that is not an int, negative, or past the end of the pass. Handed to torchdata as it was, the loop's
next batch failed with a raw TypeError or StopIteration, or a negative count replayed the whole epoch,
silently. Now the step is damaged: the load falls back to the older step, which resumes exactly."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import distckpt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers"))
from forger import rewrite_trees  # noqa: E402


def _loader() -> StatefulDataLoader:
    items = list(range(40))
    return StatefulDataLoader(items, batch_size=4, sampler=DistributedSampler(items, num_replicas=1, rank=0, seed=3))


def _forge_counts(root: str, step: int, value: str) -> int:
    return rewrite_trees(root, step, r'\["(_num_yielded|_sampler_iter_yielded)", ?\d+\]', rf'["\1", {value}]')


@pytest.mark.parametrize("value", ['"6"', "-8", "4000", "true"])
def test_a_forged_loader_position_is_damage_and_the_older_step_resumes_exactly(tmp_path, value):
    root = str(tmp_path / "ckpt")
    loader = _loader()
    seen = []
    with distckpt.CheckpointManager(root) as mgr:
        assert mgr.load_latest({"loader": loader}) is None
        for step, batch in enumerate(loader):
            seen.append(batch.tolist())
            if step in (2, 5):
                mgr.save(step, {"loader": loader})
    assert _forge_counts(root, 5, value) >= 1
    loader = _loader()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distckpt.CheckpointManager(root) as mgr:
            progress = mgr.load_latest({"loader": loader})
    assert progress is not None and progress.step == 2
    assert any("saved position" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert [b.tolist() for b in loader] == seen[3:]
