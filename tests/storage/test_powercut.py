"""A power cut before each durability-relevant operation of a save (and right after it
returns), on a disk that keeps only what was fsynced: the disk found afterwards always loads
the previous or the new checkpoint, byte-identical, and the new one once save() returned."""

from __future__ import annotations

import shutil

import pytest
import torch
from powercut import PowerCut, PowerCutNow
from step_states import blank, state_for

import distckpt
from distckpt.protocol import retention
from distckpt.tools.cli import main as cli_main


@pytest.fixture(autouse=True, params=["retired-files-inline", "retired-files-after-save"])
def sweep_order(request, monkeypatch):
    """Retention retires a step inside save() and removes its files on a thread of its own; the
    thread's operations interleave with the end of save() in any order. The two extremes, made
    deterministic so that every operation has a fixed number: the files removed at once (inside
    save), or only once save() returned (at the next drain: the next save, or close())."""
    if request.param == "retired-files-inline":
        monkeypatch.setattr(retention.Sweeper, "submit", lambda self, storage, steps, keep: [
            retention.delete_files(storage, step, keep) for step in steps])
    else:
        def submit(self, storage, steps, keep):
            self.__dict__.setdefault("held", []).append((storage, steps, keep))

        def drain(self):
            while self.__dict__.get("held"):
                storage, steps, keep = self.held.pop(0)
                for step in steps:
                    retention.delete_files(storage, step, keep)

        monkeypatch.setattr(retention.Sweeper, "submit", submit)
        monkeypatch.setattr(retention.Sweeper, "drain", drain)
    return request.param


def committed_run(path: str) -> None:
    with distckpt.CheckpointManager(path) as mgr:
        mgr.save(1, state_for(1))


def save_under(cut: PowerCut, path: str) -> tuple[bool, int]:
    """The restarted job's next save (keep_last=1: retention retires step 1, whose files go on a
    thread of their own, finished by close()): (whether save() returned, the operations it made)."""
    with distckpt.CheckpointManager(path, keep_last=1) as mgr:
        mgr.load_latest(blank())
        with cut:
            try:
                mgr.save(2, state_for(2))
            except PowerCutNow:
                return False, cut.ops
            ops = cut.ops
            try:
                mgr.close()  # the retired step's files: a cut there comes after save() returned
            except PowerCutNow:
                pass
            return True, ops


def count_operations(tmp_path) -> tuple[int, int]:
    path = str(tmp_path / "count")
    committed_run(path)
    cut = PowerCut(path)
    returned, in_save = save_under(cut, path)
    assert returned
    return cut.ops, in_save


def test_a_power_cut_at_every_operation_of_a_save(tmp_path):
    total, in_save = count_operations(tmp_path)
    assert total >= 10 and total >= in_save  # files, directories, manifest, marker, retention
    outcomes = []
    for k in range(1, total + 2):  # k = total + 1: the cut comes after everything
        live = str(tmp_path / f"live{k}")
        committed_run(live)
        cut = PowerCut(live, at=k)
        returned, _ = save_under(cut, live)
        assert returned == (k > in_save)
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


def incremental_save_under(path: str, at: int | None) -> tuple[PowerCut, bool, int]:
    """Step 1, then (under the cut) step 2 of the same incremental manager: step 2 references the
    frozen part in step 1's file, and retention (keep_last=1) retires step 1 around it (its files
    on the sweeper's thread, finished by close()). (cut, whether save() returned, its operations)"""
    with distckpt.CheckpointManager(path, keep_last=1, incremental=True, leftover_grace_s=0) as mgr:
        mgr.load_latest({})
        mgr.save(1, _shared_state(1))
        cut = PowerCut(path) if at is None else PowerCut(path, at=at)
        with cut:
            try:
                mgr.save(2, _shared_state(2))
            except PowerCutNow:
                return cut, False, cut.ops
            ops = cut.ops
            try:
                mgr.close()
            except PowerCutNow:
                pass
            return cut, True, ops


def test_a_power_cut_at_every_operation_of_an_incremental_save_and_its_retention(tmp_path):
    cut, returned, in_save = incremental_save_under(str(tmp_path / "count"), None)
    assert returned and cut.ops >= in_save
    total = cut.ops
    outcomes = []
    for k in range(1, total + 2):
        live = str(tmp_path / f"live{k}")
        cut, returned, _ = incremental_save_under(live, k)
        assert returned == (k > in_save)
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
