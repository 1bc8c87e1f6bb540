"""A symbolic link inside a local root, where a checkpoint directory goes (`step-N`, its `ranks/` or
`replicated/`, `fence/`): readers never follow one, and neither does a save now. Followed, a save wrote
a whole step outside the root, reported success, and left a newest step no load could read; another
wrote its payload outside and then blamed the storage's listing. The save is refused on that step
with an error naming the link; nothing lands outside, the link's target is untouched, the previous
checkpoints load, and a save of another step goes on."""

from __future__ import annotations

import os

import pytest
import torch

import distckpt


def _state(value: float) -> dict:
    return {"w": torch.full((4,), value)}


def _outside_tree(outside: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), outside) for d, _, files in os.walk(outside) for f in files)


@pytest.mark.parametrize("link", ["step-000000040", "step-000000040/ranks", "step-000000040/replicated"])
def test_a_save_never_writes_through_a_linked_step_directory(tmp_path, link):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep")
    with distckpt.CheckpointManager(str(root)) as mgr:
        mgr.load_latest(_state(0.0))
        mgr.save(30, _state(3.0))
    (root / link).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside, root / link, target_is_directory=True)
    with distckpt.CheckpointManager(str(root)) as mgr:
        mgr.load_latest(_state(0.0))
        with pytest.raises(distckpt.StorageError, match="symbolic link"):
            mgr.save(40, _state(4.0))
    assert _outside_tree(str(outside)) == ["precious.txt"]  # nothing written there, nothing removed
    with distckpt.CheckpointManager(str(root)) as mgr:  # another step saves
        mgr.load_latest(_state(0.0))
        mgr.save(50, _state(5.0))
    state = _state(0.0)
    with distckpt.CheckpointManager(str(root)) as mgr:
        progress = mgr.load_latest(state)
    assert progress is not None and progress.step == 50 and torch.equal(state["w"], _state(5.0)["w"])
    assert _outside_tree(str(outside)) == ["precious.txt"] and (outside / "precious.txt").read_text() == "keep"


def test_a_linked_fence_directory_is_never_written_through(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    root.mkdir()
    os.symlink(outside, root / "fence", target_is_directory=True)
    with distckpt.CheckpointManager(str(root)) as mgr:
        assert mgr.load_latest(_state(0.0)) is None
        with pytest.raises(distckpt.StorageError, match="symbolic link"):
            mgr.save(10, _state(1.0))
    assert _outside_tree(str(outside)) == []


def test_a_file_where_the_fence_directory_goes_is_named_with_what_to_do(tmp_path):
    """Every reader failed with a bare "Not a directory"."""
    root = tmp_path / "root"
    with distckpt.CheckpointManager(str(root)) as mgr:
        mgr.load_latest(_state(0.0))
        mgr.save(10, _state(1.0))
    for entry in (root / "fence").iterdir():
        entry.unlink()
    (root / "fence").rmdir()
    (root / "fence").write_text("not a directory")
    with pytest.raises(distckpt.StorageError, match="a file stands where a directory goes"):
        with distckpt.CheckpointManager(str(root)) as mgr:
            mgr.load_latest(_state(0.0))
