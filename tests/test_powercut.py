"""A power cut before each durability-relevant operation of a save (and right after it
returns), on a disk that keeps only what was fsynced: the disk found afterwards always loads
the previous or the new checkpoint, byte-identical, and the new one once save() returned."""

from __future__ import annotations

import shutil

import torch
from powercut import PowerCut, PowerCutNow
from step_states import blank, state_for

import distckpt
from distckpt.cli import main as cli_main


def committed_run(path: str) -> None:
    with distckpt.CheckpointManager(path) as mgr:
        mgr.save(1, state_for(1))


def save_under(cut: PowerCut, path: str) -> bool:
    """The restarted job's next save (keep_last=1: retention deletes step 1); True if it returned."""
    with distckpt.CheckpointManager(path, keep_last=1) as mgr:
        mgr.load_latest(blank())
        with cut:
            try:
                mgr.save(2, state_for(2))
                return True
            except PowerCutNow:
                return False


def count_operations(tmp_path) -> int:
    path = str(tmp_path / "count")
    committed_run(path)
    cut = PowerCut(path)
    assert save_under(cut, path)
    return cut.ops


def test_a_power_cut_at_every_operation_of_a_save(tmp_path):
    total = count_operations(tmp_path)
    assert total >= 10  # files, directories, manifest, marker, retention
    outcomes = []
    for k in range(1, total + 2):  # k = total + 1: the cut comes after save() returned
        live = str(tmp_path / f"live{k}")
        committed_run(live)
        cut = PowerCut(live, at=k)
        returned = save_under(cut, live)
        assert returned == (k == total + 1)
        found = str(tmp_path / f"after{k}")
        cut.image(found)
        state = blank()
        with distckpt.CheckpointManager(found) as mgr:
            progress = mgr.load_latest(state)
        assert progress is not None, f"cut before operation {k}: no checkpoint survived"
        assert torch.equal(state["model"].weight, state_for(progress.step)["model"].weight)
        assert torch.equal(state["gen"].get_state(), state_for(progress.step)["gen"].get_state())
        if returned:
            assert progress.step == 2, "save() returned, yet the new checkpoint did not survive the cut"
        assert cli_main(["verify", found, "--all"]) == 0
        outcomes.append(progress.step)
        shutil.rmtree(live), shutil.rmtree(found)
    assert 1 in outcomes and 2 in outcomes, outcomes
    print(f"\n[power-cut] cut before each of {total} operations and after save() returned: resumed from",
          outcomes)


def _shared_state(step: int) -> dict:
    """state_for(step) plus a frozen part that is the same at every step (referenced, not rewritten)."""
    return {**state_for(step), "frozen": state_for(0)["model"]}


def incremental_save_under(path: str, at: int | None) -> tuple[PowerCut, bool]:
    """Step 1, then (under the cut) step 2 of the same incremental manager: step 2 references the
    frozen part in step 1's file, and retention (keep_last=1) retires step 1 around it."""
    with distckpt.CheckpointManager(path, keep_last=1, incremental=True, leftover_grace_s=0) as mgr:
        mgr.load_latest({})
        mgr.save(1, _shared_state(1))
        cut = PowerCut(path) if at is None else PowerCut(path, at=at)
        with cut:
            try:
                mgr.save(2, _shared_state(2))
                return cut, True
            except PowerCutNow:
                return cut, False


def test_a_power_cut_at_every_operation_of_an_incremental_save_and_its_retention(tmp_path):
    cut, returned = incremental_save_under(str(tmp_path / "count"), None)
    assert returned
    total = cut.ops
    outcomes = []
    for k in range(1, total + 2):
        live = str(tmp_path / f"live{k}")
        cut, returned = incremental_save_under(live, k)
        assert returned == (k == total + 1)
        found = str(tmp_path / f"after{k}")
        cut.image(found)
        state = _shared_state(0)
        with torch.no_grad():
            state["model"].weight.zero_()
            state["frozen"].weight.zero_()
        with distckpt.CheckpointManager(found) as mgr:
            progress = mgr.load_latest(state)
        assert progress is not None, f"cut before operation {k}: no checkpoint survived"
        assert torch.equal(state["model"].weight, state_for(progress.step)["model"].weight)
        assert torch.equal(state["frozen"].weight, state_for(0)["model"].weight)
        if returned:
            assert progress.step == 2
        assert cli_main(["verify", found, "--all"]) == 0
        outcomes.append(progress.step)
        shutil.rmtree(live), shutil.rmtree(found)
    assert 1 in outcomes and 2 in outcomes, outcomes
    print(f"\n[power-cut, incremental] cut before each of {total} operations: resumed from", outcomes)
