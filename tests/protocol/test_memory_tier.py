"""The memory tier in a world of one and of two ranks on one node: its commits, retention, the
free-memory refusal, resume from it, fallbacks, fencing, and the settings it refuses."""

from __future__ import annotations

import os
import subprocess
import warnings

import pytest
import torch

import distckpt
from distckpt.io import manifest as mf
from distckpt.protocol.commit import list_committed
from distckpt.storage import open_storage


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """This node's memory root for the test (a directory; /dev/shm is the default)."""
    root = str(tmp_path / "shm")
    monkeypatch.setenv("DISTCKPT_MEMORY_DIR", root)
    return root


def make_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optimizer": opt, "data": torch.Generator().manual_seed(7)}


def train(state: dict, steps) -> list[str]:
    out = []
    for _ in steps:
        loss = state["model"](torch.randn(4, 8, generator=state["data"])).pow(2).mean()
        state["optimizer"].zero_grad()
        loss.backward()
        state["optimizer"].step()
        out.append(loss.item().hex())
    return out


def run(url: str, saves, state: dict | None = None, **kw) -> dict:
    state = state or make_state()
    with distckpt.CheckpointManager(url, memory_tier=True, **kw) as mgr:
        for step in saves:
            train(state, [step])
            mgr.save(step, state)
    return state


def own_steps(shm: str) -> list[int]:
    return list_committed(open_storage(os.path.join(shm, "own")))


def resume(url: str, **kw):
    state = make_state(seed=1)  # other values than the run's: a resume must replace them all
    with distckpt.CheckpointManager(url, memory_tier=True, **kw) as mgr:
        return mgr.load_latest(state), state


@pytest.mark.parametrize("async_save", [False, True])
def test_every_save_commits_to_memory_and_the_resume_reads_it_bitwise(shm, ckpt_dir, async_save):
    state = run(ckpt_dir, range(4), keep_memory=2, async_save=async_save)
    assert own_steps(shm) == [3, 2]  # keep_memory=2: pruned like keep_local
    progress, resumed = resume(ckpt_dir)
    assert (progress.step, progress.tier) == (3, "memory")
    assert progress.url.startswith(os.path.join(shm, "own"))
    for key in ("model", "optimizer"):
        assert str(resumed[key].state_dict()) == str(state[key].state_dict())
    assert train(resumed, range(3)) == train(state, range(3))  # the data stream too: bitwise


def test_memory_every_commits_every_nth_save(shm, ckpt_dir):
    run(ckpt_dir, range(6), memory_every=3, keep_memory=5)
    assert own_steps(shm) == [5, 2]  # the 3rd and 6th saves
    progress, _ = resume(ckpt_dir)
    assert (progress.step, progress.tier) == (5, "memory")


def test_an_older_memory_step_never_wins_over_a_newer_disk_step(shm, ckpt_dir):
    run(ckpt_dir, range(5), memory_every=3)  # memory: step 2; disk: 0..4
    with pytest.warns(distckpt.CheckpointFallbackWarning, match=r"disk tiers hold a newer step \(4\)"):
        progress, _ = resume(ckpt_dir)
    assert (progress.step, progress.tier) == (4, "durable")


def test_the_memory_copy_is_the_committed_step_byte_for_byte(shm, ckpt_dir):
    run(ckpt_dir, range(2))
    base = mf.step_dir(1)
    for name in os.listdir(os.path.join(ckpt_dir, base)):
        path = os.path.join(ckpt_dir, base, name)
        if os.path.isfile(path):
            assert open(path, "rb").read() == open(os.path.join(shm, "own", base, name), "rb").read(), name


def test_a_damaged_memory_copy_falls_back_to_the_disk_tier_with_a_warning(shm, ckpt_dir):
    state = run(ckpt_dir, range(3), keep_memory=3)
    for step in (2,):  # the newest memory copy damaged: one byte of its replicated file
        replicated = os.path.join(shm, "own", mf.step_dir(step), "replicated")
        path = os.path.join(replicated, os.listdir(replicated)[0])
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 1
        open(path, "wb").write(bytes(data))
    with pytest.warns(distckpt.CheckpointFallbackWarning, match=r"step 2 on the memory tier cannot be loaded .*the disk tiers are read instead"):
        progress, resumed = resume(ckpt_dir)
    assert (progress.step, progress.tier) == (2, "durable")  # the newest, from the disk tier
    assert str(resumed["model"].state_dict()) == str(state["model"].state_dict())


def load_step(url: str, step: int, **kw):
    state = make_state(seed=1)
    with distckpt.CheckpointManager(url, memory_tier=True, **kw) as mgr:
        return mgr.load(state, step=step), state


def states_by_step(url: str, steps) -> dict:
    """The state after each save of a run (the reference a load of that step must restore)."""
    state, out = make_state(), {}
    with distckpt.CheckpointManager(url, memory_tier=True, keep_memory=2) as mgr:
        for step in steps:
            train(state, [step])
            mgr.save(step, state)
            out[step] = {k: str(state[k].state_dict()) for k in ("model", "optimizer")}
    return out


def test_load_of_a_step_held_in_memory_reads_the_memory_copy(shm, ckpt_dir):
    saved = states_by_step(ckpt_dir, range(4))  # memory: steps 3 and 2; disk: 0..3
    progress, state = load_step(ckpt_dir, 2)
    assert (progress.step, progress.tier) == (2, "memory")
    assert progress.url.startswith(os.path.join(shm, "own"))
    assert {k: str(state[k].state_dict()) for k in ("model", "optimizer")} == saved[2]


def test_load_of_a_step_only_on_disk_reads_the_disk_tier_without_a_warning(shm, ckpt_dir):
    saved = states_by_step(ckpt_dir, range(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", distckpt.CheckpointFallbackWarning)  # nothing to warn of
        progress, state = load_step(ckpt_dir, 1)
    assert (progress.step, progress.tier) == (1, "durable")
    assert {k: str(state[k].state_dict()) for k in ("model", "optimizer")} == saved[1]


def test_load_of_a_step_whose_memory_copy_is_damaged_falls_back_with_a_warning(shm, ckpt_dir):
    saved = states_by_step(ckpt_dir, range(4))
    replicated = os.path.join(shm, "own", mf.step_dir(2), "replicated")
    path = os.path.join(replicated, os.listdir(replicated)[0])
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 1
    open(path, "wb").write(bytes(data))
    with pytest.warns(distckpt.CheckpointFallbackWarning, match="memory copy of step 2"):
        progress, state = load_step(ckpt_dir, 2)
    assert (progress.step, progress.tier) == (2, "durable")
    assert {k: str(state[k].state_dict()) for k in ("model", "optimizer")} == saved[2]


def test_an_empty_memory_tier_loads_the_disk_tier_saying_why(shm, ckpt_dir, tmp_path):
    run(ckpt_dir, range(2))
    os.rename(shm, str(tmp_path / "gone"))  # the node's memory lost (a reboot)
    with pytest.warns(distckpt.CheckpointFallbackWarning, match="no node holds a committed step in memory"):
        progress, _ = resume(ckpt_dir)
    assert (progress.step, progress.tier) == (1, "durable")


def test_a_fresh_start_with_a_memory_tier_is_none_and_warns_of_nothing(shm, ckpt_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error", distckpt.CheckpointFallbackWarning)  # nothing was lost: no warning
        progress, _ = resume(ckpt_dir)
    assert progress is None


def test_a_superseded_incarnations_memory_step_never_wins(shm, ckpt_dir):
    run(ckpt_dir, range(4), keep_memory=3)  # incarnation 1: steps 0..3, memory holds 1, 2, 3
    state = make_state()
    with distckpt.CheckpointManager(ckpt_dir, memory_tier=True, keep_memory=3) as mgr:
        mgr.load(state, 1)  # incarnation 2 resumes from step 1: steps 2 and 3 of incarnation 1 are its past
        train(state, [2])
        mgr.save(2, state)  # replaces the old step 2 in memory too; the old step 3 is now zombie output
    assert own_steps(shm) == [3, 2, 1]
    progress, resumed = resume(ckpt_dir)
    assert (progress.step, progress.tier) == (2, "memory")
    assert str(resumed["model"].state_dict()) == str(state["model"].state_dict())


def test_a_step_that_does_not_fit_in_shared_memory_is_refused_naming_the_sizes(shm, ckpt_dir, monkeypatch):
    run(ckpt_dir, range(1))
    monkeypatch.setenv("DISTCKPT_MEMORY_FREE_BYTES", str(1 << 20))
    state = make_state()
    with distckpt.CheckpointManager(ckpt_dir, memory_tier=True) as mgr:
        mgr.load_latest(state)
        with pytest.raises(distckpt.MemoryTierFullError, match=r"1\.0 MiB free.*step 1 needs .*MiB.*this node's copy"):
            mgr.save(1, state)
    assert own_steps(shm) == [0]  # nothing of step 1 written to memory
    assert 1 in list_committed(open_storage(ckpt_dir))  # it stays committed where it was saved


@pytest.mark.faults
def test_a_real_small_tmpfs_refuses_instead_of_a_bus_error(tmp_path, ckpt_dir, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    root = tmp_path / "small-shm"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=80m", "tmpfs", str(root)], check=True)
    try:
        monkeypatch.setenv("DISTCKPT_MEMORY_DIR", str(root / "node"))
        state = {"big": torch.zeros(8 << 20)}  # 32 MiB: fits the 80 MiB tmpfs once, not with 64 MiB headroom
        with distckpt.CheckpointManager(ckpt_dir, memory_tier=True) as mgr:
            with pytest.raises(distckpt.MemoryTierFullError, match="free"):
                mgr.save(0, state)
    finally:
        subprocess.run(["umount", str(root)], check=True)


@pytest.mark.parametrize("kw, match", [
    ({"memory_every": 2}, "memory_every=2 needs memory_tier=True"),
    ({"keep_memory": 1}, "keep_memory=1 needs memory_tier=True"),
    ({"memory_tier": True, "memory_every": 0}, "memory_every=0: must be an int >= 1"),
    ({"memory_tier": True, "keep_memory": True}, "keep_memory=True: must be an int >= 1"),
    ({"memory_tier": "yes"}, "memory_tier='yes': must be True or False"),
    ({"memory_tier": True, "incremental": True}, "memory_tier=True with incremental=True is not supported"),
    ({"memory_tier": True, "split_writes": True}, "memory_tier=True with split_writes=True is not supported"),
    ({"memory_tier": True, "async_save": True, "staging_bytes": 1 << 20},
     "memory_tier=True with staging_bytes= is not supported"),
])
def test_settings_are_refused_by_name(shm, ckpt_dir, kw, match):
    with pytest.raises(distckpt.ConfigError, match=match):
        distckpt.CheckpointManager(ckpt_dir, **kw)


def test_a_relative_memory_dir_is_refused(ckpt_dir, monkeypatch):
    monkeypatch.setenv("DISTCKPT_MEMORY_DIR", "relative/dir")
    with pytest.raises(distckpt.ConfigError, match="DISTCKPT_MEMORY_DIR='relative/dir': must be an absolute"):
        distckpt.CheckpointManager(ckpt_dir, memory_tier=True)


def test_without_an_override_each_job_and_node_has_its_own_root_in_dev_shm(monkeypatch):
    from distckpt.protocol.memory_tier import memory_root

    monkeypatch.delenv("DISTCKPT_MEMORY_DIR", raising=False)
    roots = {memory_root(url, node) for url in ("s3://b/exp1", "s3://b/exp2") for node in (0, 1)}
    assert len(roots) == 4 and all(r.startswith("/dev/shm/distckpt/") for r in roots)


def test_composes_with_two_tiers(shm, ckpt_dir, tmp_path):
    local = str(tmp_path / "local")
    state = run(ckpt_dir, range(5), local_dir=local, durable_every=2, keep_memory=2)
    assert own_steps(shm) == [4, 3]
    progress, resumed = resume(ckpt_dir, local_dir=local, durable_every=2)
    assert (progress.step, progress.tier) == (4, "memory")
    assert train(resumed, range(2)) == train(state, range(2))


def test_two_ranks_on_one_node_share_its_memory_root(shm, ckpt_dir):
    from distckpt.testing import run_world

    results = run_world("test_memory_tier:two_ranks", 2, url=ckpt_dir)
    assert all(r.error is None for r in results), results
    assert own_steps(shm) == [2, 1]
    names = os.listdir(os.path.join(shm, "own", mf.step_dir(2), "ranks"))
    assert len(names) == 2  # both ranks' files in the node's one copy


def two_ranks(rank: int, world: int, url: str) -> None:
    state = {"w": torch.arange(4.0), "g": torch.Generator().manual_seed(rank)}
    with distckpt.CheckpointManager(url, memory_tier=True, timeout=60) as mgr:
        for step in range(3):
            torch.randn(2, generator=state["g"])
            mgr.save(step, state)
    expected = torch.Generator().manual_seed(rank)
    for _ in range(3):
        torch.randn(2, generator=expected)
    state = {"w": torch.zeros(4), "g": torch.Generator().manual_seed(99)}
    with distckpt.CheckpointManager(url, memory_tier=True, timeout=60) as mgr:
        progress = mgr.load_latest(state)
    assert (progress.step, progress.tier) == (2, "memory")
    assert torch.equal(state["g"].get_state(), expected.get_state())
    assert torch.equal(state["w"], torch.arange(4.0))


def test_fsdp2_shards_resume_from_memory_bitwise(shm, ckpt_dir):
    from distckpt.testing import run_world

    saved = run_world("test_memory_tier:fsdp_save", 2, url=ckpt_dir)
    assert all(r.error is None for r in saved), saved
    shards = [n for n in os.listdir(os.path.join(shm, "own", mf.step_dir(3))) if n.startswith("shard")]
    assert shards, os.listdir(os.path.join(shm, "own", mf.step_dir(3)))
    loaded = run_world("test_memory_tier:fsdp_load", 2, url=ckpt_dir)
    assert all(r.error is None for r in loaded), loaded
    for s, r in zip(saved, loaded):
        assert r.value["tier"] == "memory"
        assert r.value["values"] == s.value["values"]
        assert r.value["more"] == s.value["more"]  # training goes on bitwise


def fsdp_save(rank: int, world: int, url: str) -> dict:
    import sharded_workers as w

    state = w.build(0)
    w.train(state, 3)
    with distckpt.CheckpointManager(url, memory_tier=True, timeout=60) as mgr:
        mgr.save(3, state)
        values = w.full_values(state)
    return {"values": values, "more": w.train(state, 2, 3)}


def fsdp_load(rank: int, world: int, url: str) -> dict:
    import sharded_workers as w

    state = w.build(123)
    with distckpt.CheckpointManager(url, memory_tier=True, timeout=60) as mgr:
        progress = mgr.load_latest(state)
    return {"tier": progress.tier, "values": w.full_values(state), "more": w.train(state, 2, 3)}


def test_ranks_built_with_different_memory_settings_are_refused_on_every_rank(shm, ckpt_dir):
    from distckpt.testing import run_world

    results = run_world("test_memory_tier:differing", 2, url=ckpt_dir)
    assert [r.error_type for r in results] == ["ConfigError", "ConfigError"], results
    assert all("memory_tier" in r.error for r in results)


def differing(rank: int, world: int, url: str) -> None:
    distckpt.CheckpointManager(url, memory_tier=rank == 0, timeout=30)


def test_the_pre_emption_save_reaches_memory_and_the_resume_reads_it(shm, ckpt_dir, tmp_path):
    import signal

    local = str(tmp_path / "local")
    state = make_state()
    with distckpt.CheckpointManager(ckpt_dir, memory_tier=True, local_dir=local, durable_every=100,
                                    preemption_signals=(signal.SIGUSR1,)) as mgr:
        for step in range(10):
            train(state, [step])
            if step == 6:
                os.kill(os.getpid(), signal.SIGUSR1)  # the notice, mid-run
            if mgr.preemption_requested():
                mgr.save(step, state)
                break
    assert own_steps(shm) == [6]
    assert 6 in list_committed(open_storage(ckpt_dir))  # made durable too, as every pre-emption save
    progress, resumed = resume(ckpt_dir, local_dir=local)
    assert (progress.step, progress.tier) == (6, "memory")
    assert train(resumed, range(2)) == train(state, range(2))
