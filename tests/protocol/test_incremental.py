"""Incremental checkpoints: bytes already committed are referenced, not written again, and every
committed checkpoint stays whole: it loads, verifies and exports on its own, and retention never
deletes a file another committed checkpoint references."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distckpt
from distckpt.io import manifest as mf
from distckpt.protocol.commit import list_committed
from distckpt.storage import open_storage
from distckpt.tools import cli

EXAMPLES = int(os.environ.get("DISTCKPT_HYPOTHESIS_EXAMPLES", "8"))
HERE = os.path.dirname(os.path.abspath(__file__))  # this test's folder: its child imports it


def lora_state(seed: int = 0, base_width: int = 256) -> dict:
    """A frozen base and a small trainable adapter with its AdamW moments."""
    torch.manual_seed(seed)
    base = torch.nn.Linear(base_width, base_width)
    base.requires_grad_(False)
    adapter = torch.nn.Linear(base_width, 4)
    opt = torch.optim.AdamW(adapter.parameters(), lr=1e-2)
    return {"base": base, "adapter": adapter, "optimizer": opt, "gen": torch.Generator().manual_seed(seed)}


def train_step(state: dict) -> None:
    x = torch.randn(2, state["base"].in_features, generator=state["gen"])
    state["adapter"](state["base"](x)).sum().backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad()


def snapshot(state: dict) -> dict[str, torch.Tensor]:
    out = {f"base.{k}": v.clone() for k, v in state["base"].state_dict().items()}
    out.update({f"adapter.{k}": v.clone() for k, v in state["adapter"].state_dict().items()})
    for i, s in enumerate(state["optimizer"].state.values()):
        out.update({f"opt.{i}.{k}": v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def loaded(root: str, step: int | None = None, base_width: int = 256) -> tuple[distckpt.Progress, dict[str, torch.Tensor]]:
    state = lora_state(seed=99, base_width=base_width)
    train_step(state)  # moments exist, so the optimizer's state has the shapes to load into
    with distckpt.CheckpointManager(root) as mgr:
        progress = mgr.load(state, step) if step is not None else mgr.load_latest(state)
    return progress, snapshot(state)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def damage_replicated(root: str, step: int, how: str = "flip") -> None:
    """Truncate the step's replicated file to half, or flip one bit in its middle (same size)."""
    shared = os.path.join(root, mf.step_dir(step), "replicated")
    path = os.path.join(shared, os.listdir(shared)[0])
    data = bytearray(open(path, "rb").read())
    if how == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x10
    open(path, "wb").write(data)


def step_bytes(root: str, step: int) -> int:
    base = os.path.join(root, mf.step_dir(step))
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(base) for f in fs)


def test_a_frozen_base_is_written_once_and_every_step_loads_whole(tmp_path):
    root = str(tmp_path / "ckpt")
    state = lora_state(base_width=1024)
    saved = {}
    with distckpt.CheckpointManager(root, incremental=True) as mgr:
        mgr.load_latest(state)
        for step in range(6):
            train_step(state)
            mgr.save(step, state)
            saved[step] = snapshot(state)
    full, later = step_bytes(root, 0), [step_bytes(root, s) for s in range(1, 6)]
    assert max(later) < 0.05 * full, (full, later)  # the 4 MiB base is written once
    for step in range(6):
        progress, got = loaded(root, step, base_width=1024)
        assert progress.step == step and same(got, saved[step]), step
    assert cli.main(["verify", root, "--all"]) == 0


def test_inspect_shows_reused_tensors_and_shared_bytes_as_text_and_json(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    state = lora_state(base_width=256)
    with distckpt.CheckpointManager(root, incremental=True) as mgr:
        mgr.load_latest(state)
        for step in range(2):
            train_step(state)
            mgr.save(step, state)
    capsys.readouterr()
    assert cli.main(["inspect", root, "--step", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    reused = [t for t in d["tensors"] if "shared_from" in t]
    shared_files = d["manifest"]["shared_files"]
    assert reused and d["bytes_shared"] == sum(r["size"] for r in shared_files.values()) and d["bytes_owned"] > 0
    assert {t["shared_from"] for t in reused} <= set(shared_files)
    capsys.readouterr()
    assert cli.main(["ls", root, "--json"]) == 0  # ls and inspect count the same shared bytes
    assert {r["step"]: r["shared_bytes"] for r in json.loads(capsys.readouterr().out)}[1] == d["bytes_shared"]
    assert cli.main(["inspect", root, "--step", "1"]) == 0
    text = capsys.readouterr().out
    assert f"{d['bytes_shared']:,} in files of older steps" in text
    assert f"({len(reused)} in older steps' files)" in text  # on the entries' lines; each tensor with --tensors
    assert cli.main(["inspect", root, "--step", "1", "--tensors"]) == 0
    text = capsys.readouterr().out
    assert all(f"from {t['shared_from']}" in text for t in reused)


def test_retention_keeps_what_newer_checkpoints_reference_and_collects_it_after(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    state = lora_state()
    saved = {}
    with distckpt.CheckpointManager(root, incremental=True, keep_last=5, leftover_grace_s=0) as mgr:
        mgr.load_latest(state)
        for step in range(8):
            train_step(state)
            mgr.save(step, state)
            saved[step] = snapshot(state)
        assert mgr.committed_steps() == [7, 6, 5, 4, 3]
        # steps 0-2 were deleted; step 0's replicated file holds the base every kept step references
        assert os.listdir(os.path.join(root, mf.step_dir(0))) == ["replicated"]
        assert not os.path.exists(os.path.join(root, mf.step_dir(1)))
        for step in range(3, 8):
            assert same(loaded(root, step)[1], saved[step])
        assert cli.main(["ls", root, "--json"]) == 0
        rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
        assert rows[0]["status"].startswith("retired") and rows[7]["shared_bytes"] > 0
        with torch.no_grad():
            for p in state["base"].parameters():
                p.add_(1.0)  # the base changes: written again, step 0's file is free
        for step in range(8, 14):
            train_step(state)
            mgr.save(step, state)
            saved[step] = snapshot(state)
    assert not os.path.exists(os.path.join(root, mf.step_dir(0)))  # nothing references it any more
    for step in range(9, 14):
        assert same(loaded(root, step)[1], saved[step])


def test_a_damaged_shared_file_makes_every_checkpoint_referencing_it_fall_back(tmp_path):
    root = str(tmp_path / "ckpt")
    state = lora_state()
    saved = {}
    with distckpt.CheckpointManager(root, incremental=True) as mgr:
        mgr.load_latest(state)
        for step in range(6):
            if step == 3:
                with torch.no_grad():
                    state["base"].bias.add_(1.0)  # step 3 writes the base again; 4 and 5 reference it
            train_step(state)
            mgr.save(step, state)
            saved[step] = snapshot(state)
    damage_replicated(root, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        progress, got = loaded(root)
    skipped = [str(w.message) for w in caught if issubclass(w.category, distckpt.CheckpointFallbackWarning)]
    assert len(skipped) == 3 and all("step-000000003" in m for m in skipped), skipped  # 5, 4 and 3
    assert progress.step == 2 and same(got, saved[2])
    assert cli.main(["verify", root, "--all"]) == 1


def test_a_fully_trained_state_is_written_whole_every_time(tmp_path):
    root = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with distckpt.CheckpointManager(root, incremental=True) as mgr:
        for step in range(3):
            model(torch.randn(2, 64)).sum().backward()
            opt.step()
            mgr.save(step, {"model": model, "optimizer": opt})
    manifests = [json.load(open(os.path.join(root, mf.step_dir(s), mf.MANIFEST))) for s in range(3)]
    assert all("reused" not in m for m in manifests)  # every tensor changed: nothing referenced


def test_a_file_removed_from_outside_is_written_again_not_referenced(tmp_path):
    import shutil

    root = str(tmp_path / "ckpt")
    state = lora_state()
    with distckpt.CheckpointManager(root, incremental=True) as mgr:
        for step in range(2):
            train_step(state)
            mgr.save(step, state)
        shutil.rmtree(os.path.join(root, mf.step_dir(0)))  # another process removes the file the base is in
        train_step(state)
        expected = snapshot(state)
        mgr.save(2, state)
    manifest = json.load(open(os.path.join(root, mf.step_dir(2), mf.MANIFEST)))
    assert not any(p.startswith(mf.step_dir(0)) for p in manifest.get("shared_files", {}))
    assert same(loaded(root, 2)[1], expected)


def test_export_and_load_weights_read_an_incremental_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    with distckpt.CheckpointManager(root, incremental=True) as mgr:
        for step in range(3):
            model(torch.randn(2, 32)).sum().backward()
            opt.step()
            mgr.save(step, {"model": model, "optimizer": opt})
    assert "reused" in json.load(open(os.path.join(root, mf.step_dir(2), mf.MANIFEST)))
    fresh = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    distckpt.load_weights(root, fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    distckpt.export_weights(root, str(tmp_path / "hf"))
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())


def test_incremental_on_s3(s3_server, s3_url):
    from test_s3 import fast_options

    options = fast_options(s3_server.storage_options())
    state = lora_state()
    saved = {}
    with distckpt.CheckpointManager(s3_url, incremental=True, keep_last=2, storage_options=options) as mgr:
        for step in range(4):
            train_step(state)
            mgr.save(step, state)
            saved[step] = snapshot(state)
    fresh = lora_state(seed=99)
    train_step(fresh)
    with distckpt.CheckpointManager(s3_url, storage_options=options) as mgr:
        assert mgr.committed_steps() == [3, 2]
        assert mgr.load_latest(fresh).step == 3
    assert same(snapshot(fresh), saved[3])


def test_incremental_is_checked_and_refused_with_two_tiers_and_split_writes(tmp_path):
    with pytest.raises(distckpt.ConfigError, match="incremental"):
        distckpt.CheckpointManager(str(tmp_path / "a"), incremental="yes")
    with pytest.raises(distckpt.ConfigError, match="incremental"):
        distckpt.CheckpointManager(str(tmp_path / "a"), incremental=True, local_dir=str(tmp_path / "l"))
    # split writes move the replicated tensors to shard files written whole: refused, not silently full
    with pytest.raises(distckpt.ConfigError, match="incremental=True with split_writes=True"):
        distckpt.CheckpointManager(str(tmp_path / "a"), incremental=True, split_writes=True)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(plan=st.lists(st.sets(st.integers(0, 3), max_size=4), min_size=1, max_size=8),
       keep_last=st.one_of(st.none(), st.integers(1, 3)), async_save=st.booleans(),
       restart_at=st.integers(0, 8))
def test_every_committed_step_loads_what_was_saved_whatever_changes(tmp_path_factory, plan, keep_last, async_save,
                                                                    restart_at):
    """Random sequences of which of 4 tensors change before each save, with and without
    retention, async or not, the job restarted once: every step still committed loads exactly
    what it saved, and every one verifies."""
    root = str(tmp_path_factory.mktemp("prop") / "ckpt")
    tensors = {f"t{i}": torch.full((1000 + i,), float(i)) for i in range(4)}
    saved = {}

    def manager() -> distckpt.CheckpointManager:
        mgr = distckpt.CheckpointManager(root, incremental=True, keep_last=keep_last, async_save=async_save,
                                         leftover_grace_s=0)
        mgr.load_latest({k: torch.empty_like(v) for k, v in tensors.items()})
        return mgr

    mgr = manager()
    for step, changed in enumerate(plan):
        if step == restart_at:
            mgr.close()
            mgr = manager()  # a new incarnation: its first save is whole again
        for i in changed:
            tensors[f"t{i}"].add_(step + 1)
        mgr.save(step, tensors)
        saved[step] = {k: v.clone() for k, v in tensors.items()}
    mgr.close()
    committed = _every_committed_step_loads_what_it_saved(root, saved)
    assert committed[0] == len(plan) - 1
    assert keep_last is None or len(committed) == min(keep_last, len(plan))


def _every_committed_step_loads_what_it_saved(root: str, saved: dict[int, dict[str, torch.Tensor]]) -> list[int]:
    """Loads every committed step into fresh tensors, compares with `saved`, verifies the root;
    returns the committed steps, newest first."""
    committed = list_committed(open_storage(root))
    assert committed
    for step in committed:
        target = {k: torch.empty_like(v) for k, v in saved[step].items()}
        with distckpt.CheckpointManager(root) as reader:
            reader.load(target, step)
        assert all(torch.equal(target[k], saved[step][k]) for k in target), step
    assert cli.main(["verify", root, "--all"]) == 0
    return committed


@settings(max_examples=max(10, EXAMPLES // 2), deadline=None, derandomize=True)
@given(steps=st.lists(st.integers(0, 20), min_size=2, max_size=6, unique=True),
       changed=st.lists(st.sets(st.integers(0, 2), max_size=3), min_size=6, max_size=6),
       keep_last=st.one_of(st.none(), st.integers(1, 3)))
def test_saving_a_lower_step_than_the_last_references_no_newer_steps_file(tmp_path_factory, steps, changed, keep_last):
    """One run saving steps in any order (a counter reset, a re-save after `load(state, step)`):
    a step references only older steps' files (retention relies on it), so every save commits,
    every step still committed loads what it saved, and every one verifies."""
    root = str(tmp_path_factory.mktemp("order") / "ckpt")
    tensors = {f"t{i}": torch.full((500 + i,), float(i)) for i in range(3)}
    saved = {}
    with distckpt.CheckpointManager(root, incremental=True, keep_last=keep_last, leftover_grace_s=0) as mgr:
        mgr.load_latest({k: torch.empty_like(v) for k, v in tensors.items()})
        for step, change in zip(steps, changed):
            for i in change:
                tensors[f"t{i}"].add_(step + 1)
            mgr.save(step, tensors)
            saved[step] = {k: v.clone() for k, v in tensors.items()}
    assert _every_committed_step_loads_what_it_saved(root, saved)[0] == max(steps)


CRASHING_SAVE = r"""
import os, signal, sys, torch, distckpt
from distckpt.runtime import faults
root, point, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, sys.argv[4])
from test_incremental import lora_state, train_step
def kill(name, context):
    if name == point and context.get("step") == at:
        os.kill(os.getpid(), signal.SIGKILL)
faults.on_point(kill)
state = lora_state()
with distckpt.CheckpointManager(root, incremental=True, keep_last=2, leftover_grace_s=0) as mgr:
    progress = mgr.load_latest(state)
    start = progress.step + 1 if progress else 0
    for step in range(start, 6):
        train_step(state)
        mgr.save(step, state)
"""


@pytest.mark.parametrize("point", [pytest.param("save/replicated-written", marks=pytest.mark.faults),
                                   "save/manifest-written",
                                   pytest.param("save/committed", marks=pytest.mark.faults),
                                   "retention/marker-removed",
                                   pytest.param("save/retained", marks=pytest.mark.faults)])
def test_sigkill_at_every_point_of_an_incremental_save_leaves_every_committed_step_whole(tmp_path, point):
    root = str(tmp_path / "ckpt")
    run = [sys.executable, "-c", CRASHING_SAVE, root, point, "3", HERE]
    killed = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert cli.main(["verify", root, "--all"]) == 0  # every committed step whole, shared files included
    again = subprocess.run([sys.executable, "-c", CRASHING_SAVE, root, "none", "-1", HERE],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert list_committed(open_storage(root)) == [5, 4]
    assert cli.main(["verify", root, "--all"]) == 0


def test_tensors_that_only_hold_equal_bytes_come_back_as_separate_objects(tmp_path):
    root = str(tmp_path / "ckpt")
    state = {"a": torch.zeros(100), "b": torch.zeros(100), "plain": {"c": torch.zeros(100), "d": torch.zeros(100)}}
    with distckpt.CheckpointManager(root, incremental=True) as mgr:
        mgr.save(0, state)
        mgr.save(1, state)  # all three are referenced from step 0's file, two to the same bytes
    manifest = json.load(open(os.path.join(root, mf.step_dir(1), mf.MANIFEST)))
    assert len(manifest["reused"]) == 4
    got = {"a": torch.ones(100), "b": torch.ones(100), "plain": {}}
    with distckpt.CheckpointManager(root) as mgr:
        mgr.load_latest(got)
    assert all(torch.equal(t, torch.zeros(100)) for t in (got["a"], got["b"], *got["plain"].values()))
    assert got["plain"]["c"] is not got["plain"]["d"]  # equal bytes, two tensors: not tied
    got["plain"]["c"].add_(1)
    assert torch.equal(got["plain"]["d"], torch.zeros(100)) and torch.equal(got["a"], torch.zeros(100))


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_shared_file_damaged_after_it_was_written_is_not_referenced_again(tmp_path, damage):
    from distckpt.protocol import incremental
    root = str(tmp_path / "ckpt")
    state = lora_state()
    saved = {}
    with distckpt.CheckpointManager(root, incremental=True, keep_last=3) as mgr:
        for step in range(2):
            train_step(state)
            mgr.save(step, state)
            saved[step] = snapshot(state)
        damage_replicated(root, 0, damage)  # a flip keeps the size: found by the checksum every VERIFY_EVERY saves
        for step in range(2, 2 + incremental.VERIFY_EVERY):
            train_step(state)
            mgr.save(step, state)
            saved[step] = snapshot(state)
    last = 1 + incremental.VERIFY_EVERY
    manifest = json.load(open(os.path.join(root, mf.step_dir(last), mf.MANIFEST)))
    assert not any(p.startswith(mf.step_dir(0)) for p in manifest.get("shared_files", {}))
    progress, got = loaded(root)  # the newest step is whole: the base was written again
    assert progress.step == last and same(got, saved[last])


def test_saving_a_step_again_never_overwrites_a_file_newer_steps_reference(tmp_path):
    root = str(tmp_path / "ckpt")
    state = lora_state()
    with distckpt.CheckpointManager(root, incremental=True, keep_last=1) as mgr:
        for step in range(3):
            train_step(state)
            mgr.save(step, state)  # steps 1 and 2 reference step 0's file; keep_last=1 retires 0 and 1
        assert mgr.committed_steps() == [2]
        with pytest.raises(distckpt.CheckpointExistsError, match="referenced by newer committed checkpoints"):
            mgr.save(0, state)  # same generation, same file name: it would replace what step 2 needs
    assert cli.main(["verify", root, "--all"]) == 0
