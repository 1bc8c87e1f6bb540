"""disk_every: a memory tier that saves more often than the disks (memory every step, disk every
Nth): the saves in between are committed to memory only, with a manifest, marker and fencing of
their own, and resume bit for bit."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_memory_tier import make_state, own_steps, train

import distckpt
from distckpt.io import manifest as mf
from distckpt.protocol.commit import list_committed, read_marker, read_verified_manifest
from distckpt.storage import open_storage


@pytest.fixture
def shm(tmp_path, monkeypatch):
    root = str(tmp_path / "shm")
    monkeypatch.setenv("DISTCKPT_MEMORY_DIR", root)
    return root


def run(url: str, saves, state: dict | None = None, **kw) -> tuple[dict, list[str]]:
    """Train and save at every step of `saves`; the state and the losses."""
    state = state or make_state()
    losses = []
    with distckpt.CheckpointManager(url, memory_tier=True, **kw) as mgr:
        for step in saves:
            losses += train(state, [step])
            mgr.save(step, state)
    return state, losses


def resume(url: str, **kw):
    state = make_state(seed=1)
    with distckpt.CheckpointManager(url, memory_tier=True, **kw) as mgr:
        return mgr.load_latest(state), state


@pytest.mark.parametrize("async_save", [False, True])
def test_saves_between_disk_saves_go_to_memory_only_and_resume_bitwise(shm, ckpt_dir, async_save):
    state = make_state()
    with distckpt.CheckpointManager(ckpt_dir, memory_tier=True, disk_every=3, keep_memory=2,
                                    async_save=async_save) as mgr:
        for step in range(6):
            train(state, [step])
            mgr.save(step, state)
        mgr.wait()
        assert list_committed(open_storage(ckpt_dir)) == [3, 0]  # a manager's first save, then every 3rd
    assert list_committed(open_storage(ckpt_dir)) == [5, 3, 0]  # close(): the newest, memory only, to disk
    assert own_steps(shm) == [5, 4]  # every save in memory, keep_memory=2
    progress, resumed = resume(ckpt_dir, disk_every=3)
    assert (progress.step, progress.tier) == (5, "memory")
    for key in ("model", "optimizer"):
        assert str(resumed[key].state_dict()) == str(state[key].state_dict())
    expected = train(state, range(3))
    assert train(resumed, range(3)) == expected
    shutil.rmtree(shm)  # the node's memory gone: the copy close() wrote is the same step
    progress, resumed = resume(ckpt_dir, disk_every=3)
    assert (progress.step, progress.tier) == (5, "durable")
    assert train(resumed, range(3)) == expected


def test_a_memory_only_step_is_a_whole_committed_step_of_its_own(shm, ckpt_dir):
    state = make_state()
    with distckpt.CheckpointManager(ckpt_dir, memory_tier=True, disk_every=2) as mgr:
        mgr.save(0, state)  # the first save: disk and memory
        mgr.save(1, state)  # memory only
        assert not os.path.exists(os.path.join(ckpt_dir, mf.step_dir(1)))  # nothing of it on disk
        memory = open_storage(os.path.join(shm, "own"))
        marker = read_marker(memory, 1)
        manifest = read_verified_manifest(memory, 1, marker)  # the marker names this manifest's checksum
        assert (manifest.step, manifest.world_size, marker.generation) == (1, 1, manifest.generation)
        base = os.path.join(shm, "own", mf.step_dir(1))
        for name, record in manifest.files.items():
            mf.verify_file(open(os.path.join(base, name), "rb").read(), record, name)
    for name in [*manifest.files, mf.MANIFEST, mf.MARKER]:  # close() wrote it to disk byte for byte
        on_disk = open(os.path.join(ckpt_dir, mf.step_dir(1), name), "rb").read()
        assert on_disk == open(os.path.join(base, name), "rb").read(), name


KILLED_RUN = """
import os, signal, sys, torch, distckpt
sys.path.insert(0, sys.argv[2])
from test_memory_tier import make_state, train
state = make_state()
mgr = distckpt.CheckpointManager(sys.argv[1], memory_tier=True, disk_every=2)
for step in range(4):
    train(state, [step])
    mgr.save(step, state)
print(" ".join(train(state, range(2))), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no close(): the job dies with step 3 in memory only
"""


def test_a_memory_only_step_lost_with_the_node_falls_back_to_the_last_disk_step(shm, ckpt_dir, tmp_path):
    out = subprocess.run([sys.executable, "-c", KILLED_RUN, ckpt_dir, os.path.dirname(__file__)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "DISTCKPT_MEMORY_DIR": shm})
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    assert list_committed(open_storage(ckpt_dir)) == [2, 0] and own_steps(shm) == [3, 2]
    progress, _ = resume(ckpt_dir, disk_every=2)
    assert (progress.step, progress.tier) == (3, "memory")
    os.rename(shm, str(tmp_path / "gone"))
    with pytest.warns(distckpt.CheckpointFallbackWarning, match="no node holds a committed step in memory"):
        progress, _ = resume(ckpt_dir, disk_every=2)
    assert (progress.step, progress.tier) == (2, "durable")


def test_saving_a_step_again_is_refused_before_anything_is_written(shm, ckpt_dir):
    first, second = {"w": torch.ones(4)}, {"w": torch.full((4,), 11.0)}
    with distckpt.CheckpointManager(ckpt_dir, memory_tier=True, disk_every=2) as mgr:
        mgr.save(0, first)
        mgr.save(1, first)  # memory only
        with pytest.raises(distckpt.CheckpointExistsError, match="step 1 is already committed"):
            mgr.save(1, second)  # the disk's turn: refused all the same, nothing written
        assert list_committed(open_storage(ckpt_dir)) == [0]
    target = {"w": torch.zeros(4)}
    with distckpt.CheckpointManager(ckpt_dir, memory_tier=True, disk_every=2) as mgr:
        mgr.load(target, 1)
    assert torch.equal(target["w"], first["w"])  # the step holds what was saved, in memory and on disk


def test_a_job_restarted_more_often_than_disk_every_still_reaches_disk(shm, ckpt_dir):
    state = make_state()
    for _incarnation in range(3):  # each saves 2 steps with disk_every=5, then ends without close()
        with distckpt.CheckpointManager(ckpt_dir, memory_tier=True, disk_every=5) as mgr:
            progress = mgr.load_latest(state)
            start = progress.step + 1 if progress else 0
            for step in range(start, start + 2):
                mgr.save(step, state)
            mgr._session.newest_memory_only = None  # as a killed job: close() writes nothing more
    assert list_committed(open_storage(ckpt_dir)) == [4, 2, 0]  # every incarnation's first save


def test_composes_with_two_tiers_memory_every_step_local_every_2nd_url_every_4th(shm, ckpt_dir, tmp_path):
    local = str(tmp_path / "local")
    state, _ = run(ckpt_dir, range(8), disk_every=2, local_dir=local, durable_every=2, keep_memory=3,
                   keep_local=10)
    assert list_committed(open_storage(local)) == [6, 4, 2, 0]  # every 2nd save on the local tier
    # durable_every counts the disk saves (the 2nd and 4th: steps 2, 6); close() wrote step 7, memory only
    assert list_committed(open_storage(ckpt_dir)) == [7, 6, 2]
    assert own_steps(shm) == [7, 6, 5]
    progress, resumed = resume(ckpt_dir, disk_every=2, local_dir=local, durable_every=2)
    assert (progress.step, progress.tier) == (7, "memory")
    assert train(resumed, range(2)) == train(state, range(2))


def test_the_pre_emption_save_goes_to_disk_whatever_disk_every_says(shm, ckpt_dir):
    state = make_state()
    with distckpt.CheckpointManager(ckpt_dir, memory_tier=True, disk_every=100,
                                    preemption_signals=(signal.SIGUSR1,)) as mgr:
        for step in range(10):
            train(state, [step])
            if step == 4:
                os.kill(os.getpid(), signal.SIGUSR1)
            if mgr.preemption_requested():
                mgr.save(step, state)
                break
            mgr.save(step, state)
    assert list_committed(open_storage(ckpt_dir)) == [4, 0]  # the first save, and the node's memory goes with the node
    assert own_steps(shm)[0] == 4


def test_signed_memory_only_steps_verify_and_resume(shm, ckpt_dir, tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    state, _ = run(ckpt_dir, range(4), disk_every=2, signing_key=private)  # step 3: memory only
    assert os.path.exists(os.path.join(shm, "own", mf.step_dir(3), "SIGNATURE"))
    assert os.path.exists(os.path.join(ckpt_dir, mf.step_dir(3), "SIGNATURE"))  # written at close() with it
    progress, resumed = resume(ckpt_dir, disk_every=2, verify_key=public)
    assert (progress.step, progress.tier) == (3, "memory")
    assert train(resumed, range(2)) == train(state, range(2))
    other = ed25519.Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    with pytest.warns(distckpt.CheckpointFallbackWarning, match="step 3 on the memory tier cannot be loaded"):
        with pytest.raises(distckpt.CorruptCheckpointError, match="Only steps signed by the verify key"):
            resume(ckpt_dir, disk_every=2, verify_key=other)  # another key's copy never loads, from memory either


def test_a_superseded_writers_memory_only_save_is_fenced(shm, ckpt_dir):
    zombie_state = make_state()
    with distckpt.CheckpointManager(ckpt_dir, memory_tier=True, disk_every=3) as zombie:
        for step in range(2):
            train(zombie_state, [step])
            zombie.save(step, zombie_state)  # step 0 on disk (the zombie holds the lease), step 1 in memory
        state = make_state()
        with distckpt.CheckpointManager(ckpt_dir, memory_tier=True, disk_every=3) as newer:
            assert newer.load_latest(state).step == 1
            newer.save(2, state)  # takes the newer lease
        with pytest.raises(distckpt.FencedError):
            zombie.save(3, zombie_state)  # a memory-only save: fenced before anything is committed
    assert own_steps(shm)[0] == 2
    assert list_committed(open_storage(ckpt_dir)) == [2, 0]  # the zombie's close() wrote nothing


@pytest.mark.parametrize("kw, match", [
    ({"disk_every": 2}, "disk_every=2 needs memory_tier=True"),
    ({"memory_tier": True, "disk_every": 0}, "disk_every=0: must be an int >= 1"),
    ({"memory_tier": True, "disk_every": 2.0}, r"disk_every=2\.0: must be an int >= 1"),
    ({"memory_tier": True, "disk_every": 2, "memory_every": 2}, "a save that is neither a memory save nor a disk save"),
])
def test_disk_every_is_refused_by_name(shm, ckpt_dir, kw, match):
    with pytest.raises(distckpt.ConfigError, match=match):
        distckpt.CheckpointManager(ckpt_dir, **kw)


def test_two_ranks_memory_only_steps_resume_bitwise(shm, ckpt_dir):
    from distckpt.testing import run_world

    results = run_world("test_memory_only_saves:two_ranks", 2, url=ckpt_dir)
    assert all(r.error is None for r in results), results
    assert list_committed(open_storage(ckpt_dir)) == [3, 2, 0]  # step 3 written by close()
    assert own_steps(shm) == [3, 2]
    assert len(os.listdir(os.path.join(shm, "own", mf.step_dir(3), "ranks"))) == 2


def two_ranks(rank: int, world: int, url: str) -> None:
    def fresh(seed: int) -> dict:
        return {"w": torch.arange(4.0) * seed, "g": torch.Generator().manual_seed(rank + seed)}

    state = fresh(1)
    with distckpt.CheckpointManager(url, memory_tier=True, disk_every=2, async_save=True, timeout=60) as mgr:
        for step in range(4):
            torch.randn(2, generator=state["g"])
            state["w"] += 1
            mgr.save(step, state)
    saved = {"w": state["w"].clone(), "g": state["g"].get_state()}
    state = fresh(7)
    with distckpt.CheckpointManager(url, memory_tier=True, disk_every=2, timeout=60) as mgr:
        progress = mgr.load_latest(state)
    assert (progress.step, progress.tier) == (3, "memory")
    assert torch.equal(state["w"], saved["w"]) and torch.equal(state["g"].get_state(), saved["g"])


def test_a_rank_failing_in_a_memory_only_save_fails_it_on_every_rank(shm, ckpt_dir):
    from distckpt.testing import run_world

    results = run_world("test_memory_only_saves:failing_rank", 2, url=ckpt_dir)
    assert [r.error for r in results] == [None, None], results
    assert all(r.value == "memory save of step 2" for r in results), results
    assert own_steps(shm) == [1, 0]  # nothing of step 2 committed in memory
    assert list_committed(open_storage(ckpt_dir)) == [1, 0]  # nor on disk; close() wrote step 1


def failing_rank(rank: int, world: int, url: str) -> str:
    from distckpt.runtime import faults

    state = {"w": torch.arange(4.0), "g": torch.Generator().manual_seed(rank)}

    def fail(name: str, context: dict) -> None:
        if name == "memory/files-writing" and rank == 0 and context.get("step") == 2:
            raise OSError("injected: rank 0 cannot write its node's copy")

    with distckpt.CheckpointManager(url, memory_tier=True, disk_every=3, timeout=60) as mgr:
        mgr.save(0, state)
        mgr.save(1, state)
        remove = faults.on_point(fail)
        try:
            mgr.save(2, state)
        except distckpt.DistCkptError as e:
            assert "injected: rank 0 cannot write" in str(e), e
            return "memory save of step 2" if "memory copy of step 2" in str(e) else str(e)
        finally:
            remove()
    return "no error"


def test_fsdp2_shards_saved_to_memory_only_resume_bitwise(shm, ckpt_dir):
    from distckpt.testing import run_world

    saved = run_world("test_memory_only_saves:fsdp_save", 2, url=ckpt_dir)
    assert all(r.error is None for r in saved), saved
    assert list_committed(open_storage(ckpt_dir)) == [2, 1]  # step 2: memory only, written by close()
    assert any(n.startswith("shard") for n in os.listdir(os.path.join(shm, "own", mf.step_dir(2))))
    loaded = run_world("test_memory_only_saves:fsdp_load", 2, url=ckpt_dir)
    assert all(r.error is None for r in loaded), loaded
    for s, r in zip(saved, loaded):
        assert (r.value["step"], r.value["tier"]) == (2, "memory")
        assert r.value["values"] == s.value["values"]
        assert r.value["more"] == s.value["more"]


def fsdp_save(rank: int, world: int, url: str) -> dict:
    import sharded_workers as w

    state = w.build(0)
    with distckpt.CheckpointManager(url, memory_tier=True, disk_every=2, timeout=60) as mgr:
        for step in (1, 2):  # the first save to disk, the 2nd to memory only
            w.train(state, 1)
            mgr.save(step, state)
        values = w.full_values(state)
    return {"values": values, "more": w.train(state, 2, 3)}


def fsdp_load(rank: int, world: int, url: str) -> dict:
    import sharded_workers as w

    state = w.build(123)
    with distckpt.CheckpointManager(url, memory_tier=True, disk_every=2, timeout=60) as mgr:
        progress = mgr.load_latest(state)
    return {"step": progress.step, "tier": progress.tier, "values": w.full_values(state), "more": w.train(state, 2, 3)}


def test_load_of_a_memory_only_step_that_is_gone_says_the_memory_tier_lacks_it(shm, ckpt_dir, tmp_path):
    out = subprocess.run([sys.executable, "-c", KILLED_RUN, ckpt_dir, os.path.dirname(__file__)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "DISTCKPT_MEMORY_DIR": shm})
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    os.rename(shm, str(tmp_path / "gone"))  # step 3 was in memory only
    with distckpt.CheckpointManager(ckpt_dir, memory_tier=True, disk_every=2) as mgr:
        with pytest.raises(distckpt.IncompatibleCheckpointError,
                           match=r"step 3 is not committed at .*\(committed: \[2, 0\]\); nor does the memory tier hold it"):
            mgr.load(make_state(), 3)


def test_a_memory_root_holding_another_jobs_copies_or_not_a_directory_is_refused(shm, ckpt_dir, tmp_path, monkeypatch):
    run(ckpt_dir, range(2))
    with pytest.raises(distckpt.ConfigError, match=r"memory root .* holds the copies of another job \(.*ckpt\)"):
        distckpt.CheckpointManager(str(tmp_path / "another-job"), memory_tier=True)
    assert own_steps(shm) == [1, 0]  # the first job's copies untouched
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    monkeypatch.setenv("DISTCKPT_MEMORY_DIR", str(a_file))
    with pytest.raises(distckpt.ConfigError, match="is not a directory"):
        distckpt.CheckpointManager(ckpt_dir, memory_tier=True)


def test_a_damaged_newest_memory_step_falls_back_to_the_next_memory_step_above_the_disk(shm, ckpt_dir):
    state = make_state()
    with distckpt.CheckpointManager(ckpt_dir, memory_tier=True, disk_every=3, keep_memory=3) as mgr:
        for step in range(6):  # disk: 0, 3; memory: 3, 4, 5
            train(state, [step])
            mgr.save(step, state)
            if step == 4:
                expected = {k: str(state[k].state_dict()) for k in ("model", "optimizer")}
        mgr._session.newest_memory_only = None  # as a killed job: close() writes nothing more
    ranks = os.path.join(shm, "own", mf.step_dir(5), "ranks")
    damaged = os.path.join(ranks, os.listdir(ranks)[0])
    data = bytearray(open(damaged, "rb").read())
    data[-1] ^= 0xFF
    open(damaged, "wb").write(bytes(data))
    with pytest.warns(distckpt.CheckpointFallbackWarning, match="step 5 on the memory tier cannot be loaded"):
        progress, resumed = resume(ckpt_dir, disk_every=3)
    assert (progress.step, progress.tier) == (4, "memory")  # not the disk's step 3
    assert {k: str(resumed[k].state_dict()) for k in ("model", "optimizer")} == expected


EXAMPLES = int(os.environ.get("DISTCKPT_HYPOTHESIS_EXAMPLES", "12"))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(disk_every=st.integers(1, 4),
       incarnations=st.lists(st.tuples(st.integers(1, 5), st.booleans()), min_size=1, max_size=3))
def test_generated_runs_keep_the_disk_schedule_and_resume_the_newest_step(tmp_path_factory, monkeypatch, disk_every,
                                                                         incarnations):
    """Incarnations of generated lengths, each closed or killed (close() not reached): the disk holds
    each manager's first save, every disk_every-th after it and a closed one's last save; a resume
    reads the newest save from memory, and with the memory gone the newest disk step, bit for bit."""
    root = tmp_path_factory.mktemp("gen")
    url, shm = str(root / "ckpt"), str(root / "shm")
    monkeypatch.setenv("DISTCKPT_MEMORY_DIR", shm)
    expected_disk, step = set(), -1
    for saves, closed in incarnations:
        state = {"w": torch.zeros(3)}
        with distckpt.CheckpointManager(url, memory_tier=True, disk_every=disk_every, keep_memory=20) as mgr:
            progress = mgr.load_latest(state)
            assert (progress.step if progress else -1) == step
            assert torch.equal(state["w"], torch.full((3,), float(step)) if progress else torch.zeros(3))
            for i in range(saves):
                step += 1
                state["w"].fill_(step)
                mgr.save(step, state)
                if i % disk_every == 0:
                    expected_disk.add(step)
            if closed:
                expected_disk.add(step)
            else:
                mgr._session.newest_memory_only = None  # killed: close() never writes the last one
    assert list_committed(open_storage(url)) == sorted(expected_disk, reverse=True)
    shutil.rmtree(shm)
    state = {"w": torch.zeros(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", distckpt.CheckpointFallbackWarning)
        with distckpt.CheckpointManager(url, memory_tier=True, disk_every=disk_every) as mgr:
            progress = mgr.load_latest(state)
    newest_disk = max(expected_disk)
    assert (progress.step, progress.tier) == (newest_disk, "durable")
    assert torch.equal(state["w"], torch.full((3,), float(newest_disk)))
