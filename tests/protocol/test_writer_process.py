"""writer='process': payload files written by a process of the rank's own, from shared memory.

Round trip bitwise (the same payload bytes as the writer thread), a SIGKILLed writer process
is an AsyncSaveError on every rank with the previous checkpoint intact and the next save
committing with a new process, no writer left behind when the trainer is SIGKILLed, and the
settings refused by name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import distckpt
from distckpt.errors import ConfigError
from distckpt.testing import run_world

W = "writer_workers"


def _state() -> dict:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    base = torch.randn(16, 12)
    return {"model": model, "optimizer": opt,
            "tensors": {"bf16": torch.randn(7, 5).to(torch.bfloat16), "bool": torch.rand(9) > 0.5,
                        "empty": torch.empty(0, 3),
                        "scalar": torch.tensor(2.5, dtype=torch.float64), "strided": base.t()[::2],
                        "neg": torch.randn(6)._neg_view(),
                        "int": torch.arange(300, dtype=torch.int16),
                        "big": torch.randn(300_000)}}


def _payload_records(root: str, step: int) -> dict:
    manifest = json.load(open(os.path.join(root, f"step-{step:09d}", "manifest.json")))
    return {name: rec for name, rec in manifest["files"].items() if name.startswith("replicated")}


@pytest.mark.parametrize("bound", [None, 1, 50_000, 1 << 30])
def test_round_trip_is_bitwise_and_the_payload_bytes_match_the_writer_thread(tmp_path, bound):
    """With staging_bytes too: the staged tail in shared memory, the live part over the socket."""
    state = _state()
    records = {}
    for writer in ("thread", "process"):
        root = str(tmp_path / writer)
        with distckpt.CheckpointManager(root, async_save=True, writer=writer,
                                        staging_bytes=bound if writer == "process" else None) as mgr:
            for step in (1, 2):
                mgr.save(step, state)
            if writer == "process":
                assert mgr._session.process_writer.pid is not None
        records[writer] = _payload_records(root, 2)
        fresh = {"model": torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 4)),
                 "tensors": {}}
        fresh["optimizer"] = torch.optim.AdamW(fresh["model"].parameters())
        with distckpt.CheckpointManager(root) as mgr:
            assert mgr.load_latest(fresh).step == 2
        for key, value in state["model"].state_dict().items():
            assert torch.equal(value, fresh["model"].state_dict()[key]), key
        for key, value in state["tensors"].items():
            got = fresh["tensors"][key]
            assert got.dtype == value.dtype and got.shape == value.shape, key
            assert torch.equal(got.resolve_neg().resolve_conj(), value.resolve_neg().resolve_conj()), key
    assert list(records["thread"].values()) == list(records["process"].values())  # same sizes and checksums


@pytest.mark.parametrize("kill_on,split_writes", [(0, False), pytest.param(1, True, marks=pytest.mark.faults)])
def test_a_killed_writer_process_is_an_async_save_error_on_every_rank(tmp_path, kill_on, split_writes):
    results = run_world(f"{W}:killed_writer", 2, timeout=240, url=str(tmp_path / "ckpt"), kill_on=kill_on,
                        split_writes=split_writes)
    for r in results:
        assert r.error is None, r.error
        assert r.value["error"] is not None and "background save of step 2 failed" in r.value["error"], r.value
        assert sorted(r.value["steps"]) == [1, 3], r.value  # step 1 intact, step 2 never committed, step 3 with a new writer
    killed = results[kill_on].value
    assert "killed by SIGKILL" in killed["error"] and killed["restarted"]
    fresh = _state_like()
    with distckpt.CheckpointManager(str(tmp_path / "ckpt"), world_size_policy="reshard") as mgr:
        assert mgr.load_latest(fresh).step == 3  # loadable: the replicated state of the save after the kill


def _state_like() -> dict:
    torch.manual_seed(99)
    return {"model": torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)),
            "extra": torch.zeros(1000, dtype=torch.float64)}


def test_the_writer_process_does_not_outlive_a_sigkilled_trainer(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time, torch, distckpt
        mgr = distckpt.CheckpointManager({str(tmp_path / 'ckpt')!r}, async_save=True, writer="process")
        mgr.save(1, {{"w": torch.randn(1000)}})
        mgr.wait()
        print(mgr._session.process_writer.pid, flush=True)
        time.sleep(600)
    """)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        writer_pid = int(trainer.stdout.readline())
        assert _alive(writer_pid)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(30)
        deadline = time.monotonic() + 20
        while _alive(writer_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(writer_pid), f"writer process {writer_pid} outlived its trainer"
    finally:
        if trainer.poll() is None:
            trainer.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("kwargs,named", [
    ({"async_save": True, "writer": "processes"}, "writer='processes'"),
    ({"async_save": True, "writer": None}, "writer=None"),
    ({"async_save": True, "staging_bytes": 0}, "staging_bytes=0"),
    ({"async_save": True, "staging_bytes": -5}, "staging_bytes=-5"),
    ({"async_save": True, "staging_bytes": True}, "staging_bytes=True"),
    ({"async_save": True, "staging_bytes": 1.5}, "staging_bytes=1.5"),
    ({"async_save": True, "staging_bytes": "2G"}, "staging_bytes='2G'"),
    ({"writer": "process"}, "writer='process' needs async_save=True"),
    ({"staging_bytes": 1 << 20}, "staging_bytes needs async_save=True"),
    ({"async_save": True, "overlap_snapshot": True, "staging_bytes": 1 << 20}, "overlap_snapshot"),
])
def test_settings_refused_by_name(tmp_path, kwargs, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)").replace("'", ".")):
        distckpt.CheckpointManager(str(tmp_path), **kwargs)


def test_a_memory_root_is_refused_for_the_writer_process():
    with pytest.raises(ConfigError, match="memory://"):
        distckpt.CheckpointManager("memory://writer-proc", async_save=True, writer="process")


@pytest.mark.parametrize("kwargs", [
    {},  # sync
    {"async_save": True},
    {"async_save": True, "overlap_snapshot": True},
    {"async_save": True, "writer": "process"},
    {"async_save": True, "writer": "process", "overlap_snapshot": True},
    {"async_save": True, "staging_bytes": 4096},
    {"async_save": True, "writer": "process", "staging_bytes": 4096},
])
def test_supported_combinations_round_trip(tmp_path, kwargs):
    state = _state()
    with distckpt.CheckpointManager(str(tmp_path), **kwargs) as mgr:
        mgr.save(1, state)
        opt = state["optimizer"]
        state["model"](torch.randn(2, 32)).sum().backward()
        opt.step()  # waits for an overlapped copy
        expected = {k: v.clone() for k, v in state["model"].state_dict().items()}
        mgr.save(2, state)
    fresh = {"model": torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 4))}
    with distckpt.CheckpointManager(str(tmp_path), missing_entries="keep") as mgr:
        assert mgr.load_latest(fresh).step == 2
    for key, value in expected.items():
        assert torch.equal(value, fresh["model"].state_dict()[key]), key


def test_round_trip_on_s3_matches_the_writer_thread(s3_server, s3_url):
    """The writer process opens the object store itself (the storage handed over as its settings)."""
    state = _state()
    options = s3_server.storage_options()
    records = {}
    for writer in ("thread", "process"):
        url = f"{s3_url}-{writer}"
        with distckpt.CheckpointManager(url, storage_options=options, async_save=True, writer=writer) as mgr:
            mgr.save(1, state)
        with distckpt.CheckpointManager(url, storage_options=options) as mgr:
            fresh = {"model": torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 4)), "tensors": {}}
            fresh["optimizer"] = torch.optim.AdamW(fresh["model"].parameters())
            assert mgr.load_latest(fresh).step == 1
            manifest = mgr.storage.read_bytes(f"step-{1:09d}/manifest.json")
        records[writer] = {n: r for n, r in json.loads(manifest)["files"].items() if n.startswith("replicated")}
        for key, value in state["model"].state_dict().items():
            assert torch.equal(value, fresh["model"].state_dict()[key]), key
    assert list(records["thread"].values()) == list(records["process"].values())
