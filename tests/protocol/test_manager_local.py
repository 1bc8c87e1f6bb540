"""CheckpointManager on local disk in a world of one: pitfalls, commit protocol, retention."""

from __future__ import annotations

import collections
import errno
import itertools
import json
import os
import random
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DistributedSampler

import distckpt
from distckpt.protocol import leases
from distckpt.storage import local as storage_mod


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.BatchNorm1d(8), nn.Linear(8, 1))


def trained_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        sched.step()
    return {"model": model, "optimizer": opt, "scheduler": sched, "config": {"lr": 1e-2}}


def fresh_state() -> dict:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optimizer": opt, "scheduler": torch.optim.lr_scheduler.StepLR(opt, 2),
            "config": {"lr": 1e-2}}


def same_params(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_fresh_start_returns_none(ckpt_dir):
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        assert mgr.load_latest(fresh_state()) is None


def test_save_then_load_restores_everything(ckpt_dir):
    state = trained_state()
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(7, state, epoch=2, metric=0.5)
    other = fresh_state()
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        progress = mgr.load_latest(other)
    assert (progress.step, progress.epoch, progress.metric) == (7, 2, 0.5)
    assert same_params(state["model"], other["model"])
    assert other["scheduler"].state_dict() == state["scheduler"].state_dict()
    a, b = state["optimizer"].state_dict(), other["optimizer"].state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])


def test_training_flag_travels_per_submodule(ckpt_dir):
    """Seed pitfall: `training` is not in state_dict; a fresh model reports True."""
    state = trained_state()
    state["model"].eval()
    state["model"][1].train()  # a mixed pattern: only the dropout in training mode
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, state)
    other = fresh_state()
    assert all(m.training for m in other["model"].modules())
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.load_latest(other)
    assert [m.training for m in other["model"].modules()] == [False, False, True, False, False]


def test_sampler_epoch_travels(ckpt_dir):
    """Seed pitfall: DistributedSampler's epoch only moves on set_epoch; a resume at epoch 0
    replays the first epoch's order."""
    data = list(range(16))
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=3)
    sampler.set_epoch(5)
    expected = list(sampler)
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, {"sampler": sampler}, epoch=5)
    resumed = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=3)
    assert list(resumed) != expected  # epoch 0's order: what a resume without it replays
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        assert mgr.load_latest({"sampler": resumed}).epoch == 5
    assert resumed.epoch == 5 and list(resumed) == expected


def test_sampler_of_another_rank_is_refused(ckpt_dir):
    data = list(range(16))
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, {"sampler": DistributedSampler(data, num_replicas=2, rank=0)})
    with distckpt.CheckpointManager(ckpt_dir) as mgr, pytest.raises(distckpt.IncompatibleCheckpointError, match="rank 0 of 2"):
        mgr.load_latest({"sampler": DistributedSampler(data, num_replicas=4, rank=0)})


def test_config_differences_are_reported_key_by_key(ckpt_dir, caplog):
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, {"config": {"lr": 0.1, "bs": 32, "sched": {"warmup": 10}}})
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        current = {"config": {"lr": 0.2, "bs": 32, "sched": {"warmup": 10, "decay": "cos"}}}
        progress = mgr.load_latest(current)
    assert progress.config_diff == (
        "state['config']['lr']: 0.1 in the checkpoint, 0.2 here",
        "state['config']['sched']['decay']: absent in the checkpoint, 'cos' here")
    assert current["config"]["lr"] == 0.2  # reported, never overwritten
    assert "state['config']['lr']" in caplog.text


def test_unstorable_value_is_refused_at_save_time_and_nothing_is_written(ckpt_dir):
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        with pytest.raises(distckpt.UnstorableValueError, match=r"state\['config'\]\['schedule'\] is a function"):
            mgr.save(1, {"config": {"schedule": lambda step: step}})
        assert mgr.committed_steps() == []
    assert not os.path.exists(os.path.join(ckpt_dir, "step-000000001"))


def test_a_refusal_names_the_users_key_path_only(ckpt_dir):
    """The error, and everything chained to it, names state['per_rank'][...], never the
    library's own tree (state['replicated']['entries'][...])."""
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        with pytest.raises(distckpt.UnstorableValueError) as info:
            mgr.save(1, {"per_rank": {"buffer": collections.deque([1, 2], maxlen=3)}})
    chain = []
    error: BaseException | None = info.value
    while error is not None:
        chain.append(str(error))
        error = error.__cause__ or error.__context__
    assert "state['per_rank']['buffer'] is a collections.deque" in chain[0]
    assert not any("entries" in message for message in chain), chain


def test_layout_and_manifest(ckpt_dir):
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(3, trained_state(), epoch=1, metric=2.0)
    base = os.path.join(ckpt_dir, "step-000000003")
    assert sorted(os.listdir(base)) == ["COMMITTED", "manifest.json", "ranks", "replicated"]
    manifest = json.load(open(os.path.join(base, "manifest.json")))
    assert set(manifest["files"]) == {"replicated/state.g000001.safetensors", "ranks/rank-00000.g000001.safetensors"}
    for rel, record in manifest["files"].items():
        assert os.path.getsize(os.path.join(base, rel)) == record["size"] and len(record["xxh3_64"]) == 16
    assert manifest["world_size"] == 1 and manifest["ranks"][0]["step"] == 3 and manifest["ranks"][0]["epoch"] == 1
    assert manifest["ranks"][0]["host"] and manifest["versions"]["torch"] == torch.__version__
    assert {"python", "cuda", "git_commit"} <= set(manifest["versions"])
    assert manifest["entries"]["model"] == {"scope": "replicated", "kind": "module"}
    marker = json.load(open(os.path.join(base, "COMMITTED")))
    assert marker["step"] == 3 and marker["run_id"] == manifest["run_id"]


def test_an_uncommitted_step_is_invisible(ckpt_dir):
    state = trained_state()
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
    os.remove(os.path.join(ckpt_dir, "step-000000002", "COMMITTED"))  # a save that never committed
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        assert mgr.load_latest(fresh_state()).step == 1


def test_saving_a_committed_step_again_is_refused(ckpt_dir):
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, {"x": 1})
        with pytest.raises(distckpt.CheckpointExistsError, match="already committed.*by this job itself"):
            mgr.save(1, {"x": 2})  # e.g. a pre-emption save after the step's periodic one: said so
        assert mgr.committed_steps() == [1]
    with distckpt.CheckpointManager(ckpt_dir) as mgr:  # another run into the same root, never loaded
        with pytest.raises(distckpt.DistCkptError, match="already"):
            mgr.save(1, {"x": 2})


def test_keep_last_and_keep_best(ckpt_dir):
    metrics = {1: 0.9, 2: 0.1, 3: 0.5, 4: 0.7, 5: 0.8}
    with distckpt.CheckpointManager(ckpt_dir, keep_last=2, keep_best=1, best_mode="min") as mgr:
        for step, metric in metrics.items():
            mgr.save(step, {"x": step}, metric=metric)
        assert mgr.committed_steps() == [5, 4, 2]
    assert sorted(os.listdir(ckpt_dir)) == ["fence", "step-000000002", "step-000000004", "step-000000005"]
    with distckpt.CheckpointManager(ckpt_dir, keep_last=1, keep_best=1, best_mode="max") as mgr:
        mgr.load_latest({"x": 0})  # continue the run (a manager that never loaded may not)
        mgr.save(6, {"x": 6}, metric=0.95)
        assert mgr.committed_steps() == [6]


def test_a_step_saved_below_the_newest_is_kept_and_said_once(ckpt_dir):
    """A branch after load(step=older): load_latest still resumes from the highest step, so the
    first such save warns; retention keeps the just-saved step beside keep_last and keep_best."""
    with distckpt.CheckpointManager(ckpt_dir, keep_last=1, keep_best=1, best_mode="min") as mgr:
        for step in (100, 200, 300):
            mgr.save(step, {"x": step}, metric=float(step))
        state = {"x": 0}
        mgr.load(state, step=100)  # kept: the best
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mgr.save(201, state, metric=1.0)
            mgr.save(202, state, metric=2.0)
        said = [str(w.message) for w in caught if issubclass(w.category, distckpt.CheckpointWarning)]
        assert len(said) == 1 and "step 201 was committed below the newest committed step 300" in said[0]
        assert mgr.committed_steps() == [300, 202, 201]  # newest, just saved, best
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mgr.save(301, state, metric=3.0)  # above the newest: no warning
        assert not [w for w in caught if issubclass(w.category, distckpt.CheckpointWarning)]
        assert mgr.committed_steps() == [301, 201]


def test_retention_deletes_the_marker_first(ckpt_dir, monkeypatch):
    with distckpt.CheckpointManager(ckpt_dir, keep_last=1) as mgr:
        mgr.save(1, {"x": 1})

        def tree_removal_fails(self, path):
            raise distckpt.StorageError(errno.EIO, "disk gone while deleting")

        monkeypatch.setattr(storage_mod.LocalStorage, "remove_tree", tree_removal_fails)
        mgr.save(2, {"x": 2})  # committed; retention of step 1 fails halfway
        assert mgr.committed_steps() == [2]
    assert os.path.isdir(os.path.join(ckpt_dir, "step-000000001"))
    assert not os.path.exists(os.path.join(ckpt_dir, "step-000000001", "COMMITTED"))


def test_a_retired_step_is_uncommitted_at_once_and_its_files_go_before_the_next_save_writes(ckpt_dir, monkeypatch):
    """Retention removes a doomed step's marker inside save(); its files go on a thread of their
    own (off the save's path), and are gone before the next save writes anything, so the disk
    never holds more than keep_last + 1 checkpoints; close() waits for the last of them."""
    import threading

    from distckpt.runtime import faults
    removing, release = threading.Event(), threading.Event()
    remove_tree = storage_mod.LocalStorage.remove_tree

    def held_removal(self, path):
        removing.set()
        assert release.wait(30)
        remove_tree(self, path)

    seen_at_write: list[list[str]] = []

    def at_write(name, context):
        if name == "save/rank-files-written" and context["step"] == 3:
            seen_at_write.append(sorted(os.listdir(ckpt_dir)))

    remove_hook = faults.on_point(at_write)
    try:
        with distckpt.CheckpointManager(ckpt_dir, keep_last=1) as mgr:
            mgr.save(1, {"w": torch.arange(3.0)})
            monkeypatch.setattr(storage_mod.LocalStorage, "remove_tree", held_removal)
            mgr.save(2, {"w": torch.arange(3.0)})  # returns while step 1's files are still being removed
            assert removing.wait(10)
            assert mgr.committed_steps() == [2]
            assert os.path.isdir(os.path.join(ckpt_dir, "step-000000001"))
            assert not os.path.exists(os.path.join(ckpt_dir, "step-000000001", "COMMITTED"))
            threading.Timer(0.2, release.set).start()
            mgr.save(3, {"w": torch.arange(3.0)})  # waits for step 1's removal before writing
        assert seen_at_write == [sorted(["fence", "step-000000002", "step-000000003"])], seen_at_write
    finally:
        remove_hook()
    assert sorted(d for d in os.listdir(ckpt_dir) if d.startswith("step-")) == ["step-000000003"]


def test_leftovers_of_uncommitted_saves_are_collected(ckpt_dir):
    leftover = os.path.join(ckpt_dir, "step-000000009", "replicated")
    os.makedirs(leftover)
    open(os.path.join(leftover, "state.g000001.safetensors"), "wb").write(b"partial")
    with distckpt.CheckpointManager(ckpt_dir, leftover_grace_s=3600) as mgr:
        mgr.save(1, {"x": 1})
    assert os.path.isdir(leftover)  # young: could be a save in progress
    with distckpt.CheckpointManager(ckpt_dir, leftover_grace_s=0) as mgr:
        mgr.load_latest({"x": 0})  # continue the run (a manager that never loaded may not)
        mgr.save(2, {"x": 1})
    assert not os.path.exists(os.path.dirname(leftover))


def test_complete_data_without_a_marker_is_neither_loaded_nor_deleted_while_young(ckpt_dir):
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, {"x": 1})
        mgr.save(2, {"x": 2})
    os.remove(os.path.join(ckpt_dir, "step-000000002", "COMMITTED"))  # every file there but the marker
    state = {"x": 0}
    with distckpt.CheckpointManager(ckpt_dir, leftover_grace_s=3600) as mgr:
        assert mgr.load_latest(state).step == 1 and state["x"] == 1
        mgr.save(3, {"x": 3})
    assert os.path.exists(os.path.join(ckpt_dir, "step-000000002", "manifest.json"))  # young: kept
    with distckpt.CheckpointManager(ckpt_dir, leftover_grace_s=0) as mgr:
        mgr.load_latest({"x": 0})  # continue the run (a manager that never loaded may not)
        mgr.save(4, {"x": 4})
        assert mgr.committed_steps() == [4, 3, 1]
    assert not os.path.exists(os.path.join(ckpt_dir, "step-000000002"))  # old enough: collected


class FullDisk:
    """A file object that raises ENOSPC on the Nth write across all files (N=None: counts)."""

    def __init__(self, fail_at: int | None):
        self.fail_at, self.writes = fail_at, 0

    def open(self, path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        if "w" not in mode:
            return f
        disk = self

        class Dying:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

            def write(self, chunk):
                disk.writes += 1
                if disk.writes == disk.fail_at:
                    f.write(bytes(memoryview(chunk)[: len(memoryview(chunk)) // 2]))  # a torn write
                    raise OSError(errno.ENOSPC, "No space left on device")
                return f.write(chunk)

            def fileno(self):
                return f.fileno()

        return Dying()


def tree_bytes(root: str) -> dict[str, bytes]:
    out = {}
    for d, _, files in os.walk(root):
        for name in files:
            out[os.path.relpath(os.path.join(d, name), root)] = open(os.path.join(d, name), "rb").read()
    return out


def test_a_full_disk_at_every_write_never_damages_the_previous_checkpoint(ckpt_dir, monkeypatch):
    """Seed pitfall: torch.save onto the old name tears the only checkpoint on a full disk."""
    state = trained_state()
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(10, state, epoch=0)
    before = tree_bytes(os.path.join(ckpt_dir, "step-000000010"))
    counter = FullDisk(None)
    monkeypatch.setattr(storage_mod, "open", counter.open, raising=False)
    probe = os.path.join(os.path.dirname(ckpt_dir), "probe")
    with distckpt.CheckpointManager(probe) as mgr:
        mgr.save(20, state)
    total = counter.writes
    assert total >= 4  # replicated, rank file, manifest, marker
    sized: list[bool] = []
    for n in range(1, total + 1):
        disk = FullDisk(n)
        monkeypatch.setattr(storage_mod, "open", disk.open, raising=False)
        with distckpt.CheckpointManager(ckpt_dir, keep_last=2) as mgr:  # a restarted job: load, then save
            mgr.load_latest(fresh_state())
            with pytest.raises(distckpt.StorageError) as info:
                mgr.save(20, state, epoch=1)
            assert info.value.errno == errno.ENOSPC
            sized.append("keep_last + 1 = 3 checkpoints" in str(info.value))
            assert str(info.value).count("[Errno") == 1, str(info.value)  # said once, not per wrapper
        monkeypatch.setattr(storage_mod, "open", open, raising=False)
        assert tree_bytes(os.path.join(ckpt_dir, "step-000000010")) == before
        other = fresh_state()
        with distckpt.CheckpointManager(ckpt_dir) as mgr:
            assert mgr.load_latest(other).step == 10
        assert same_params(other["model"], state["model"])
    assert any(sized)  # a data file's ENOSPC says how many checkpoints the disk must hold
    with distckpt.CheckpointManager(ckpt_dir) as mgr:  # the disk has room again: a restarted job
        assert mgr.load_latest(fresh_state()).step == 10
        mgr.save(20, state, epoch=1)
        assert mgr.committed_steps() == [20, 10]
    print(f"\n[full-disk] ENOSPC (torn half-write) at each of the {total} writes of a save: previous checkpoint byte-identical each time")


def test_a_damaged_newest_checkpoint_falls_back_with_a_warning(ckpt_dir):
    state = trained_state()
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, state)
        state["model"][0].weight.data.add_(1.0)
        mgr.save(2, state)
    payload = os.path.join(ckpt_dir, "step-000000002", "replicated", "state.g000001.safetensors")
    data = bytearray(open(payload, "rb").read())
    data[-3] ^= 0x01  # one flipped bit in a committed file
    open(payload, "wb").write(bytes(data))
    other = fresh_state()
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        with pytest.warns(distckpt.CheckpointFallbackWarning, match="state.g000001.safetensors: checksum"):
            assert mgr.load_latest(other).step == 1
        with pytest.raises(distckpt.CorruptCheckpointError, match="checksum"):
            mgr.load(fresh_state(), step=2)
    os.remove(os.path.join(ckpt_dir, "step-000000001", "ranks", "rank-00000.g000001.safetensors"))
    with distckpt.CheckpointManager(ckpt_dir) as mgr, pytest.warns(distckpt.CheckpointFallbackWarning):
        with pytest.raises(distckpt.CorruptCheckpointError, match="no committed checkpoint"):
            mgr.load_latest(fresh_state())


def test_a_failed_load_changes_nothing(ckpt_dir):
    state = trained_state()
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, state)
    wider = {"model": nn.Sequential(nn.Linear(4, 9)), "optimizer": state["optimizer"]}
    other = fresh_state()
    target = {"optimizer": other["optimizer"], "model": wider["model"]}
    before_opt = other["optimizer"].state_dict()
    before_rng = torch.get_rng_state()
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        with pytest.raises(distckpt.IncompatibleCheckpointError, match="missing keys"):
            mgr.load_latest(target)
    assert other["optimizer"].state_dict() == before_opt and torch.equal(torch.get_rng_state(), before_rng)


def test_plain_and_per_rank_entries_are_restored_in_place(ckpt_dir):
    counters = {"seen": 5}
    history = [1, 2]
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, {"counters": distckpt.per_rank(counters), "history": history, "best": 0.25,
                     "ema": torch.arange(3.0)})
    counters2, history2, ema = {"seen": 0}, [], torch.zeros(3)
    state = {"counters": distckpt.per_rank(counters2), "history": history2, "best": None, "ema": ema}
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.load_latest(state)
    assert counters2 == {"seen": 5} and history2 == [1, 2] and state["best"] == 0.25
    assert torch.equal(ema, torch.arange(3.0))


@pytest.mark.parametrize("async_save", [False, True])
def test_a_layer_frozen_mid_run_stays_frozen_after_a_resume_and_a_failed_load_changes_no_flag(ckpt_dir, async_save):
    """requires_grad_(False) mid-run is the run's state: a resumed job builds every parameter
    trainable, and trained the frozen layer from the first step after the resume."""
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    model[0].requires_grad_(False)
    with distckpt.CheckpointManager(ckpt_dir, async_save=async_save) as mgr:
        mgr.save(1, {"model": model, "extra": torch.zeros(2)})
    fresh = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.load_latest({"model": fresh, "extra": torch.zeros(2)})
    assert [p.requires_grad for p in fresh.parameters()] == [False, False, True, True]
    class Refusing:  # restored after the model, and its own load fails: the model is undone
        def state_dict(self):
            return {"x": 1}

        def load_state_dict(self, sd):
            raise ValueError("no")

    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.load_latest({"model": nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)), "extra": torch.zeros(2)})
        mgr.save(2, {"model": model, "z_owner": Refusing()})
    other = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    with distckpt.CheckpointManager(ckpt_dir) as mgr, pytest.raises(distckpt.DistCkptError, match="no"):
        mgr.load_latest({"model": other, "z_owner": Refusing()})
    assert all(p.requires_grad for p in other.parameters())


@pytest.mark.parametrize("async_save", [False, True])
def test_gradients_are_not_state_neither_saved_nor_touched_by_a_load(ckpt_dir, async_save):
    # As in state_dict(): a checkpoint holds values, not .grad. The README says so ("Round trip or
    # refusal"); a load into a live tensor leaves its gradient as it was, a fresh one has none.
    weight, other = nn.Parameter(torch.arange(3.0)), nn.Parameter(torch.arange(3.0))
    weight.grad, other.grad = torch.full((3,), 7.0), torch.full((3,), 7.0)
    with distckpt.CheckpointManager(ckpt_dir, async_save=async_save) as mgr:
        mgr.save(1, {"w": weight, "extra": {"w": other}})
    live = nn.Parameter(torch.zeros(3))
    live.grad = torch.full((3,), -1.0)
    state = {"w": live, "extra": {}}
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.load_latest(state)
    assert torch.equal(live.detach(), torch.arange(3.0)) and torch.equal(live.grad, torch.full((3,), -1.0))
    assert torch.equal(state["extra"]["w"].detach(), torch.arange(3.0)) and state["extra"]["w"].grad is None


def test_async_save_is_a_consistent_snapshot(ckpt_dir):
    state = trained_state()
    expected = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with distckpt.CheckpointManager(ckpt_dir, async_save=True) as mgr:
        mgr.save(1, state)
        with torch.no_grad():  # the next training step, while the write is in flight
            for p in state["model"].parameters():
                p.add_(100.0)
    other = fresh_state()
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.load_latest(other)
    assert all(torch.equal(other["model"].state_dict()[k], v) for k, v in expected.items())


def test_async_save_failure_surfaces_at_the_next_call(ckpt_dir, monkeypatch):
    disk = FullDisk(2)  # the first write is the lease, taken by save() itself; the second is in the background
    with distckpt.CheckpointManager(ckpt_dir, async_save=True) as mgr:
        monkeypatch.setattr(storage_mod, "open", disk.open, raising=False)
        mgr.save(1, {"x": torch.ones(3)})
        with pytest.raises(distckpt.AsyncSaveError, match="background save of step 1 failed.*No space"):
            mgr.wait()
        monkeypatch.setattr(storage_mod, "open", open, raising=False)
        mgr.save(2, {"x": torch.ones(3)})
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        assert mgr.committed_steps() == [2]


@pytest.mark.parametrize("kwargs,field", [
    ({"keep_last": 0}, "keep_last"), ({"keep_best": -1}, "keep_best"),
    ({"best_mode": "lowest"}, "best_mode"), ({"timeout": 0}, "timeout")])
def test_bad_settings_name_the_field(ckpt_dir, kwargs, field):
    with pytest.raises(distckpt.ConfigError, match=field):
        distckpt.CheckpointManager(ckpt_dir, **kwargs)


def test_memory_filesystem_url():
    url = f"memory://distckpt-test-{random.random()}"
    gen = torch.Generator().manual_seed(3)
    with distckpt.CheckpointManager(url, keep_last=1) as mgr:
        mgr.save(1, {"gen": gen, "np": np.random.default_rng(1)})
        mgr.save(2, {"gen": gen, "np": np.random.default_rng(1)})
        assert mgr.committed_steps() == [2]
    expected = torch.rand(2, generator=gen)
    with distckpt.CheckpointManager(url) as mgr:
        mgr.load_latest({"gen": gen, "np": np.random.default_rng(5)})
    assert torch.equal(torch.rand(2, generator=gen), expected)


def test_loaded_optimizer_state_does_not_pin_the_file_buffer(ckpt_dir, monkeypatch):
    """Loaded tensors are views into the file's buffer; what an owner keeps must be its own copy."""
    state = trained_state()
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, state)
    buffers, alive = [], []
    original = storage_mod.LocalStorage.read_buffer

    def recording(self, path):
        data = original(self, path)
        alive.append(data)  # held, so no later allocation can reuse its addresses
        start = np.frombuffer(data, dtype=np.uint8).ctypes.data if len(data) else 0
        buffers.append((start, start + len(data)))
        return data

    monkeypatch.setattr(storage_mod.LocalStorage, "read_buffer", recording)
    other = fresh_state()
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.load_latest(other)
    kept = [t for per_param in other["optimizer"].state.values() for t in per_param.values()
            if isinstance(t, torch.Tensor) and t.numel()]
    assert kept and buffers
    for t in kept:
        assert not any(lo <= t.data_ptr() < hi for lo, hi in buffers)


def test_async_saves_reuse_their_staging_buffers(ckpt_dir):
    state = trained_state()
    with distckpt.CheckpointManager(ckpt_dir, async_save=True) as mgr:
        mgr.save(1, state)
        first = {k: v.data_ptr() for k, v in mgr._session.staging.buffers.items()}
        mgr.save(2, state)
        assert {k: v.data_ptr() for k, v in mgr._session.staging.buffers.items()} == first and first
        saved = state["model"][0].weight.detach().clone()
        with torch.no_grad():
            state["model"][0].weight.add_(1.0)  # changed after save 2 returned
    other = fresh_state()
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.load_latest(other)
    assert torch.equal(other["model"][0].weight, saved)


@pytest.mark.parametrize("op", ["fsync", "replace", "link"])
def test_an_io_error_at_every_fsync_rename_and_link_keeps_the_previous_checkpoint(ckpt_dir, monkeypatch, op):
    """EIO from the Nth call of each durability step a save makes, for every N."""
    import os as os_module

    state = trained_state()
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(10, state)
    before = tree_bytes(os.path.join(ckpt_dir, "step-000000010"))
    real = getattr(os_module, op)
    calls = {"n": 0, "fail_at": None}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise OSError(errno.EIO, f"injected EIO in {op}")
        return real(*args, **kwargs)

    monkeypatch.setattr(os_module, op, flaky)
    # The record of an incarnation's first commit is written after the marker, best effort (a
    # failure there is logged; tests/protocol/test_fencing.py): not one of the save's durability steps
    monkeypatch.setattr(leases, "record_commit", lambda *args: None)
    total = _fail_each_call_in_turn(ckpt_dir, state, calls, before, op,
                                    lambda failed: "injected EIO" in str(failed))
    assert total >= 2
    with distckpt.CheckpointManager(ckpt_dir) as mgr:  # the save after the last failure committed
        assert mgr.committed_steps() == [20, 10]
    print(f"\n[io-error] EIO at each of the {total} {op} calls of a save: previous checkpoint byte-identical each time")


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_a_failed_early_writeback_fails_the_save_and_keeps_the_previous_checkpoint(ckpt_dir, monkeypatch, code):
    """The disk is started on each window of a file as it is written (sync_file_range); an error
    there is the write's error: the save fails with it, at every call, and nothing committed changes."""
    monkeypatch.setattr(storage_mod, "WRITEBACK_WINDOW_BYTES", 4096)  # many windows in a small state
    state = trained_state()
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(10, state)
    before = tree_bytes(os.path.join(ckpt_dir, "step-000000010"))
    real = storage_mod.sync_file_range
    calls = {"n": 0, "fail_at": None}

    def flaky(fd, offset, nbytes, flags):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise OSError(code, f"injected {errno.errorcode[code]} in sync_file_range")
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(storage_mod, "sync_file_range", flaky)
    monkeypatch.setattr(leases, "record_commit", lambda *args: None)  # as above
    total = _fail_each_call_in_turn(ckpt_dir, state, calls, before, "sync_file_range",
                                    lambda failed: failed.errno == code and "injected" in str(failed))
    assert total >= 4, "the small windows should have made several early writebacks"


def _fail_each_call_in_turn(ckpt_dir, state, calls, before, what, is_the_injected_error) -> int:
    """Fail the 1st, 2nd, ... call of `what` during a restarted job's save of step 20 until a save
    makes fewer calls than that; each failure leaves step 10 byte-identical and the only one
    committed. Returns how many calls a save made."""
    n = 0
    while True:
        n += 1
        calls.update(n=0, fail_at=n)
        with distckpt.CheckpointManager(ckpt_dir) as mgr:  # a restarted job: load, then save
            mgr.load_latest(fresh_state())
            try:
                mgr.save(20, state)
                failed = None
            except distckpt.StorageError as e:
                failed = e
        calls.update(fail_at=None)
        if failed is None:
            assert calls["n"] < n, f"the save succeeded although {what} call {n} failed"
            return n - 1
        assert is_the_injected_error(failed), failed
        assert tree_bytes(os.path.join(ckpt_dir, "step-000000010")) == before
        with distckpt.CheckpointManager(ckpt_dir) as mgr:
            assert mgr.committed_steps() == [10]
            assert mgr.load_latest(fresh_state()).step == 10


def test_a_file_system_without_early_writeback_still_saves_everything(ckpt_dir, monkeypatch):
    """ENOSYS/EINVAL (FUSE, a pipe, an old kernel) turn the early writeback off for that file;
    the fsync alone then makes it durable, and every value comes back."""
    monkeypatch.setattr(storage_mod, "WRITEBACK_WINDOW_BYTES", 4096)
    calls = []

    def unsupported(fd, offset, nbytes, flags):
        calls.append((offset, nbytes))
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(storage_mod, "sync_file_range", unsupported)
    state = trained_state()
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(10, state)
    other = fresh_state()
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        assert mgr.load_latest(other).step == 10
    assert same_params(other["model"], state["model"])
    assert calls, "the early writeback was never tried"


@settings(max_examples=40, deadline=None, derandomize=True)
@given(sizes=st.lists(st.integers(0, 40_000), max_size=12), window=st.sampled_from([4096, 5000, 65536]))
def test_a_file_written_in_windows_holds_exactly_its_chunks_and_every_window_went_to_the_disk(tmp_path_factory, sizes, window):
    """Chunks of any size, cut into windows for the early writeback: the file is their concatenation,
    and the disk was started on each full window, in order, without gaps or overlaps."""
    root = tmp_path_factory.mktemp("windows")
    chunks = [os.urandom(n) for n in sizes]
    started = []
    real = storage_mod.sync_file_range

    def recording(fd, offset, nbytes, flags):
        if flags == 2:  # SYNC_FILE_RANGE_WRITE alone: a window handed to the disk
            started.append((offset, nbytes))
        return real(fd, offset, nbytes, flags)

    old_window, old_call = storage_mod.WRITEBACK_WINDOW_BYTES, storage_mod.sync_file_range
    storage_mod.WRITEBACK_WINDOW_BYTES, storage_mod.sync_file_range = window, recording
    try:
        storage_mod.LocalStorage(str(root)).write_file("f.bin", iter(chunks))
    finally:
        storage_mod.WRITEBACK_WINDOW_BYTES, storage_mod.sync_file_range = old_window, old_call
    with open(root / "f.bin", "rb") as f:
        assert f.read() == b"".join(chunks)
    if storage_mod._SYNC_FILE_RANGE is None:
        return  # not Linux: nothing is started early
    offset = 0
    for start, nbytes in started:
        assert start == offset and nbytes >= window
        offset += nbytes
    assert sum(sizes) - offset < window, "a full window was never handed to the disk"


def test_directories_of_saves_that_never_committed_are_skipped_silently(tmp_path):
    """The loader takes step directories from a shallow listing and reads markers newest first:
    a newer directory without a marker is not a checkpoint (no fallback warning), and a root of
    nothing but such directories loads as empty."""
    import warnings

    from distckpt.io import manifest as mf
    from distckpt.storage import open_storage

    empty = open_storage(str(tmp_path / "only-leftovers"))
    empty.write_file(f"{mf.step_dir(5)}/{mf.MANIFEST}", [b"{}"])
    with distckpt.CheckpointManager(str(tmp_path / "only-leftovers")) as mgr:
        assert mgr.load_latest({"w": torch.zeros(2)}) is None
    root = str(tmp_path / "c")
    state = {"w": torch.arange(3.0)}
    with distckpt.CheckpointManager(root) as mgr:
        mgr.load_latest(state)
        mgr.save(1, state)
    open_storage(root).write_file(f"{mf.step_dir(2)}/replicated/state.g000009.safetensors", [b"partial"])
    target = {"w": torch.zeros(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warning would fail the load here
        with distckpt.CheckpointManager(root) as mgr:
            assert mgr.load_latest(target).step == 1
    assert torch.equal(target["w"], state["w"])


_INDEX_EXAMPLES = int(os.environ.get("DISTCKPT_HYPOTHESIS_EXAMPLES", "60"))


@settings(max_examples=_INDEX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keep_last=st.integers(1, 4), start=st.sampled_from([0, 99_999_997, 999_999_997, 9_999_999_997]),
       actions=st.lists(st.sampled_from(["save", "leftover", "skip", "far"]), min_size=1, max_size=12),
       full_every=st.sampled_from([64, 2, 3]))
def test_the_commit_index_agrees_with_a_full_listing_after_every_save(tmp_path_factory, keep_last, start, actions,
                                                                      full_every):
    """Rank 0's commit index lists only what sorts after the newest step between full listings,
    and makes each full listing ahead of time (the first when a save starts, the next one scan
    before it is due) while retention removes steps; after every save, what it believes is
    committed equals a fresh full listing, whatever mix of saves, skipped step numbers, leftover
    directories of unfinished saves and step numbers that gain digits (step-1000000000 sorts
    before step-999999999 by name) came before, with a full listing every 2, 3 or 64 scans."""
    from distckpt.protocol import pruning
    from distckpt.protocol.commit import CommitIndex, is_committed

    real_retire = pruning.retire

    def retire(storage, step):  # an index that kept a step already gone would retire it again
        assert is_committed(storage, step), f"retention retired step {step}, which is not committed"
        real_retire(storage, step)

    before = CommitIndex.FULL_SCAN_EVERY
    CommitIndex.FULL_SCAN_EVERY = full_every
    pruning.retire = retire
    try:
        _index_agrees_after_every_save(tmp_path_factory, keep_last, start, actions)
    finally:
        CommitIndex.FULL_SCAN_EVERY = before
        pruning.retire = real_retire


def _index_agrees_after_every_save(tmp_path_factory, keep_last, start, actions):
    from distckpt.io import manifest as mf
    from distckpt.protocol.commit import list_committed
    from distckpt.storage import open_storage

    root = str(tmp_path_factory.mktemp("index"))
    storage = open_storage(root)
    state = {"w": torch.arange(4.0)}
    step = start
    saved: list[int] = []
    with distckpt.CheckpointManager(root, keep_last=keep_last, leftover_grace_s=0) as mgr:
        mgr.load_latest(state)
        for action in actions:
            step = step * 10 + 3 if action == "far" else step + 1
            if action == "leftover":
                storage.write_file(f"{mf.step_dir(step)}/replicated/state.g000099.safetensors", [b"unfinished"])
            elif action in ("save", "far"):
                mgr.save(step, state)
                saved.insert(0, step)
                index = mgr._pruner.index(mgr.storage)
                # exactly the newest keep_last saves survive: an index that lost a step would
                # have had retention or gc remove a checkpoint it should keep
                assert list_committed(storage) == saved[:keep_last]
                assert index.listing.committed() == saved[:keep_last]


def test_retentions_listing_of_the_root_runs_once_and_off_the_save_path_after_a_resume(tmp_path, monkeypatch):
    """After load_latest, rank 0 lists the root for retention on a helper thread; the first save
    uses that listing (also when it was still running as the save committed, so it may list the
    new step itself) plus a short listing after it: one slow full listing in all, not two."""
    from distckpt.storage.local import LocalStorage

    root = str(tmp_path / "ckpt")
    state = {"w": torch.arange(4.0)}
    with distckpt.CheckpointManager(root) as mgr:
        for step in range(1, 4):
            mgr.save(step, state)
    real = LocalStorage.list_files
    full: list[str] = []

    def slow_full_listing(self, path="", start_after=None):
        if path == "" and start_after is None:
            full.append(threading.current_thread().name)
            time.sleep(0.5)  # an object store's pages: still running when the save commits
        return real(self, path, start_after)

    monkeypatch.setattr(LocalStorage, "list_files", slow_full_listing)
    with distckpt.CheckpointManager(root, keep_last=2) as mgr:
        assert mgr.load_latest(state).step == 3
        mgr.save(4, state)
        mgr.save(5, state)
        assert mgr.committed_steps() == [5, 4]  # retention saw every step
    assert full[:1] == ["distckpt-listing-0"] and full[1:] == ["MainThread"], full  # the last: committed_steps()


@pytest.mark.parametrize("mode", [{}, {"async_save": True}, {"async_save": True, "overlap_snapshot": True}])
def test_a_neg_bit_view_is_not_taken_for_the_tensor_it_views(ckpt_dir, mode):
    """z.imag and z.conj().imag share every byte and differ in value (the lazy neg bit): both
    come back with their own values, as two objects."""
    z = torch.tensor([1.0 + 2.0j, 3.0 - 4.0j])
    with distckpt.CheckpointManager(ckpt_dir, **mode) as mgr:
        mgr.load_latest({"v": {}})
        mgr.save(1, {"v": {"a": z.imag, "b": z.conj().imag}})
    loaded: dict = {"v": None}
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.load_latest(loaded)
    assert loaded["v"]["a"].tolist() == [2.0, -4.0]
    assert loaded["v"]["b"].tolist() == [-2.0, 4.0]
    assert loaded["v"]["a"] is not loaded["v"]["b"]


@pytest.mark.parametrize("make", [lambda: torch.zeros(3).unfold(0, 2, 1),
                                  lambda: torch.zeros(5).as_strided((2, 2), (2, 1)).t().as_strided((2, 2), (1, 1))])
def test_loading_into_a_tensor_whose_elements_overlap_is_refused_and_changes_nothing(ckpt_dir, make):
    """torch cannot always tell (its check answers "too hard" for unfold): the strides or the
    enumerated offsets decide, and an overlapping target is refused, not loaded wrong."""
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.load_latest({"w": torch.zeros(2, 2)})
        mgr.save(1, {"w": torch.tensor([[0.0, 1.0], [2.0, 3.0]])})
    live = make()
    before = live.clone()
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        with pytest.raises(distckpt.IncompatibleCheckpointError, match=r"state\['w'\]: its elements share memory"):
            mgr.load_latest({"w": live})
    assert torch.equal(live, before)
    apart = torch.zeros(2, 4)[:, ::2]  # gaps, no overlap: loads
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        assert mgr.load_latest({"w": apart}).step == 1
    assert apart.tolist() == [[0.0, 1.0], [2.0, 3.0]]


def test_a_torch_size_with_negative_entries_comes_back(ckpt_dir):
    """torch.Size takes any int64 (a view's target shape holds -1): saved, it loads."""
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.load_latest({"v": {}})
        mgr.save(1, {"v": {"target_shape": torch.Size([-1, 3]), "big": torch.Size([2**62, -2**63])}})
    loaded: dict = {"v": None}
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        assert mgr.load_latest(loaded).step == 1
    assert loaded["v"] == {"target_shape": torch.Size([-1, 3]), "big": torch.Size([2**62, -2**63])}
    assert type(loaded["v"]["target_shape"]) is torch.Size


@pytest.mark.parametrize("value, what", [(1 << (1 << 22), r"state\['v'\]\['n'\] is an int of"),
                                         ({10**5000: "x"}, r"state\['v'\]\['n'\] has an int key of")],
                         ids=["value", "key"])
def test_ints_no_load_could_read_are_refused_at_save(ckpt_dir, value, what):
    """Save and load share one set of limits, checked at save: a huge int value or int key is
    refused naming its path, not committed and then refused by every load."""
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.load_latest({"v": {}})
        with pytest.raises(distckpt.UnstorableValueError, match=what):
            mgr.save(1, {"v": {"n": value}})
        mgr.save(2, {"v": {"n": (1 << (1 << 20)) + 1, "k": {2**1000: 1}}})  # large, within the limits
    loaded: dict = {"v": None}
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        assert mgr.load_latest(loaded).step == 2
    assert loaded["v"] == {"n": (1 << (1 << 20)) + 1, "k": {2**1000: 1}}


@pytest.mark.parametrize("reference", ["detached", "detached-requires-grad", "parameter"])
def test_a_reference_tied_to_a_module_tensor_comes_back_as_it_was_saved(tmp_path, reference):
    # `{"w": lin.weight.detach()}` beside the model came back as the model's live Parameter
    # (requires_grad, type): the tie held, the reference's own flags did not.
    def referenced(lin):
        return {"detached": lambda: lin.weight.detach(),
                "detached-requires-grad": lambda: lin.weight.detach().requires_grad_(),
                "parameter": lambda: lin.weight}[reference]()

    lin = torch.nn.Linear(3, 2)
    saved = referenced(lin)
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"model": lin, "extra": {"w": saved, "again": [saved]}})
    lin2 = torch.nn.Linear(3, 2)
    back: dict = {"model": lin2, "extra": {}}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load_latest(back)
    w = back["extra"]["w"]
    assert type(w) is type(saved) and w.requires_grad == saved.requires_grad
    assert w.data_ptr() == lin2.weight.data_ptr() and torch.equal(w, lin.weight.detach())  # still tied
    assert (w is lin2.weight) == (reference == "parameter")
    assert back["extra"]["again"][0] is w  # one object, as saved


VIEW_PAIRS = {
    "reshaped": lambda x: (x, x.view(-1)),
    "transposed": lambda x: (x, x.t()),
    "row": lambda x: (x, x[1]),
    "overlapping-slices": lambda x: (x[:, :3], x[:, 1:]),
    "reinterpreted": lambda x: (x, x.view(torch.int32)),
}


@pytest.mark.parametrize("pair", sorted(VIEW_PAIRS))
def test_views_of_one_buffer_load_back_into_views_of_one_buffer(tmp_path, pair):
    # Saved as the run held them, they were refused on load into the same structure ("untie them").
    x = torch.arange(12.0).reshape(3, 4)
    a, b = VIEW_PAIRS[pair](x)
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"a": a, "b": b})
    x2 = torch.zeros(3, 4)
    a2, b2 = VIEW_PAIRS[pair](x2)
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.load_latest({"a": a2, "b": b2}).step == 1
    assert torch.equal(x2, x)


@pytest.mark.parametrize("pair", sorted(VIEW_PAIRS))
def test_different_tensors_into_views_of_one_buffer_are_still_refused(tmp_path, pair):
    x = torch.arange(12.0).reshape(3, 4)
    a, _ = VIEW_PAIRS[pair](x)
    _, b = VIEW_PAIRS[pair](-x - 1)  # b's values are not a's wherever the views overlap
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"a": a.clone(), "b": b.clone()})
    x2 = torch.zeros(3, 4)
    a2, b2 = VIEW_PAIRS[pair](x2)
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(distckpt.IncompatibleCheckpointError, match="share memory here"):
            mgr.load_latest({"a": a2, "b": b2})
    assert torch.equal(x2, torch.zeros(3, 4))


@settings(max_examples=int(os.environ.get("DISTCKPT_HYPOTHESIS_EXAMPLES", "60")) * 3, deadline=None, derandomize=True)
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=4), data=st.data())
def test_the_overlap_decision_matches_enumerated_offsets(shape, data):
    # Any shape, strides and offset a view can have (as_strided over a buffer large enough):
    # whether two elements share memory is decided exactly as enumerating their offsets says.
    from distckpt.state.validation import _has_internal_overlap

    strides = data.draw(st.lists(st.integers(0, 12), min_size=len(shape), max_size=len(shape)))
    offset = data.draw(st.integers(0, 3))
    reach = offset + sum((n - 1) * s for n, s in zip(shape, strides) if n > 0) + 1
    t = torch.zeros(reach).as_strided(shape, strides, offset)
    offsets = [offset + sum(i * s for i, s in zip(index, strides)) for index in itertools.product(*map(range, shape))]
    assert _has_internal_overlap(t) == (len(set(offsets)) < len(offsets)), (shape, strides)


@pytest.mark.parametrize("cudnn, cuda", [(91002, "13.0"), (8902, "12.1"), (None, None)])
def test_a_gpu_build_s_environment_goes_into_the_manifest(ckpt_dir, monkeypatch, cudnn, cuda):
    """GPU builds report cuDNN's version as an int: every save on a GPU machine once failed the
    manifest's schema check ("versions must be an object of version strings")."""
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: cudnn is not None)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: cudnn)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    state = trained_state()
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, state)
    with open(os.path.join(ckpt_dir, "step-000000001", "manifest.json")) as f:
        versions = json.load(f)["versions"]
    assert versions["cudnn"] == (None if cudnn is None else str(cudnn)) and versions["cuda"] == cuda
    assert all(v is None or isinstance(v, str) for v in versions.values())
    fresh = fresh_state()
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        assert mgr.load_latest(fresh).step == 1
    assert same_params(fresh["model"], state["model"])


def test_a_per_rank_wrapper_s_object_may_be_reassigned_between_saves(ckpt_dir):
    """nanoGPT keeps `best_val_loss` as a plain float that only rank 0 updates: the natural
    `state["best"].obj = loss` raised FrozenInstanceError."""
    state = {"iter_num": 0, "best": distckpt.per_rank(float("inf"))}
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        for iter_num, loss in enumerate([3.5, 2.25, 2.75]):
            state["iter_num"], state["best"].obj = iter_num + 1, min(state["best"].obj, loss)
            mgr.save(iter_num, state)
    fresh = {"iter_num": 0, "best": distckpt.per_rank(float("inf"))}
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        assert mgr.load_latest(fresh).step == 2
    assert fresh["iter_num"] == 3 and fresh["best"].obj == 2.25


@pytest.mark.parametrize("flags", ["parameter-and-detach", "requires-grad-and-plain"])
def test_a_tensor_and_a_flag_differing_reference_to_it_stay_on_one_memory(ckpt_dir, flags):
    """A Parameter and its .detach() inside a value entry are stored once; they came back on two
    separate copies, so an update of one no longer showed in the other."""
    if flags == "parameter-and-detach":
        first = nn.Parameter(torch.arange(4.0))
    else:
        first = torch.arange(4.0).requires_grad_(True)
    saved = {"v": {"first": first, "ref": first.detach(), "again": first}}
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(0, saved)
    state = {"v": None}
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.load_latest(state)
    back = state["v"]
    assert type(back["first"]) is type(first) and back["first"].requires_grad and not back["ref"].requires_grad
    assert back["again"] is back["first"] and torch.equal(back["ref"], torch.arange(4.0))
    with torch.no_grad():
        back["first"].add_(1)
    assert torch.equal(back["ref"], torch.arange(4.0) + 1)  # one memory, as at the save


class _BrokenStateDict:
    """A user's object whose state_dict() raises (a bug in their code, or a resource gone)."""

    def __init__(self) -> None:
        self.broken = False

    def state_dict(self) -> dict:
        if self.broken:
            raise ValueError("the user's own failure")
        return {"n": 1}

    def load_state_dict(self, state: dict) -> None:
        pass


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_users_state_dict_raising_keeps_its_type_names_the_entry_and_writes_nothing(ckpt_dir, async_save):
    broken = _BrokenStateDict()
    state = {"t": torch.arange(3.0), "counter": broken}
    with distckpt.CheckpointManager(ckpt_dir, async_save=async_save) as mgr:
        mgr.save(1, state)
        mgr.wait()
        before = sorted(os.listdir(ckpt_dir))
        broken.broken = True
        with pytest.raises(ValueError, match="the user's own failure") as info:
            mgr.save(2, state)
        notes = getattr(info.value, "__notes__", [])
        assert any("state['counter']" in note for note in notes), notes
        assert sorted(os.listdir(ckpt_dir)) == before and mgr.committed_steps() == [1]
        broken.broken = False
        mgr.save(3, state)  # the manager goes on
        mgr.wait()
        assert sorted(mgr.committed_steps()) == [1, 3]


@pytest.mark.parametrize("where", ["root", "parent"])
def test_a_root_through_a_link_to_nothing_is_an_error_not_a_fresh_start(tmp_path, where):
    """A volume not mounted on this node (the root a symbolic link to a missing directory) read as
    "nothing committed": the job trained from step 0 until its first save failed."""
    link = tmp_path / "mnt"
    os.symlink(tmp_path / "not-mounted", link)
    url = str(link if where == "root" else link / "runs" / "exp1")
    with distckpt.CheckpointManager(url) as mgr:
        with pytest.raises(distckpt.StorageError, match="symbolic link to .*not-mounted.* which does not exist"):
            mgr.load_latest({"x": torch.zeros(2)})
    os.mkdir(tmp_path / "not-mounted")  # mounted: a fresh start, then saves land in the target
    with distckpt.CheckpointManager(url) as mgr:
        assert mgr.load_latest({"x": torch.zeros(2)}) is None
        mgr.save(1, {"x": torch.ones(2)})
    assert os.path.exists(os.path.join(url, "step-000000001", "COMMITTED"))


@pytest.mark.parametrize("best_mode, expected", [("min", 3), ("max", 4)])
def test_best_step_names_the_step_keep_best_keeps_newest_of_equal_metrics(tmp_path, best_mode, expected):
    metrics = {1: 2.0, 2: 1.0, 3: 1.0, 4: 5.0, 5: None, 6: 5.0 - 1e-9}
    state = {"w": torch.zeros(2)}
    with distckpt.CheckpointManager(str(tmp_path), keep_last=1, keep_best=1, best_mode=best_mode) as mgr:
        assert mgr.best_step() is None  # nothing committed
        mgr.load_latest(state)
        for step, metric in metrics.items():
            mgr.save(step, state, metric=metric)
        assert mgr.best_step() == expected
        assert mgr.committed_steps() == sorted({6, expected}, reverse=True)  # what retention kept
        progress = mgr.load(state, step=mgr.best_step())
        assert progress.step == expected and progress.metric == metrics[expected]
    assert mgr.best_step() == expected and mgr.committed_steps()[0] == 6  # after close(): they only read storage


def test_best_step_is_none_without_metrics(tmp_path):
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load_latest({"w": torch.zeros(2)})
        mgr.save(1, {"w": torch.zeros(2)})
        assert mgr.best_step() is None
