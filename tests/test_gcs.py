"""Checkpoints on Google Cloud Storage (gcsfs) against fake-gcs-server on loopback: the manager's
save and exact resume, a resume in a new process, damage after commit, and the commit marker's
exclusive create through ifGenerationMatch=0."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
import torch
from torch import nn

import distckpt


def state_with(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Linear(256, 8)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters()),
            "big": torch.randn(2**20), "gen": torch.Generator().manual_seed(seed), "config": {"seed": seed}}


def same(a: dict, b: dict) -> bool:
    return (torch.equal(a["model"].weight, b["model"].weight) and torch.equal(a["big"], b["big"])
            and torch.equal(a["gen"].get_state(), b["gen"].get_state()))


@pytest.fixture
def gs_url(gcs_server):
    return f"gs://ckpt/run-{uuid.uuid4().hex[:8]}"


def test_save_and_resume_exactly_on_gcs(gcs_server, gs_url):
    saved = state_with(1)
    with distckpt.CheckpointManager(gs_url, storage_options=gcs_server.storage_options(), keep_last=2) as mgr:
        assert mgr.load_latest(state_with(5)) is None
        for step in (1, 2, 3):
            mgr.save(step, saved)
        assert sorted(mgr.committed_steps()) == [2, 3]
    back = state_with(9)
    with distckpt.CheckpointManager(gs_url, storage_options=gcs_server.storage_options()) as mgr:
        assert mgr.load_latest(back).step == 3
    assert same(back, saved)


def test_a_resume_in_a_new_process_reads_what_was_committed(gcs_server, gs_url):
    with distckpt.CheckpointManager(gs_url, storage_options=gcs_server.storage_options()) as mgr:
        mgr.load_latest({})
        mgr.save(7, {"w": torch.arange(1000.0)})
    code = ("import sys, torch, distckpt\n"
            f"state = {{'w': torch.zeros(1000)}}\n"
            f"with distckpt.CheckpointManager({gs_url!r}, storage_options={gcs_server.storage_options()!r}) as m:\n"
            "    assert m.load_latest(state).step == 7\n"
            "assert torch.equal(state['w'], torch.arange(1000.0))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_flipped_byte_on_gcs_falls_back_to_the_previous_step(gcs_server, gs_url):
    from gcsfs.core import GCSFileSystem

    first, second = state_with(1), state_with(2)
    with distckpt.CheckpointManager(gs_url, storage_options=gcs_server.storage_options()) as mgr:
        mgr.save(1, first)
        mgr.save(2, second)
    fs = GCSFileSystem(skip_instance_cache=True, **gcs_server.storage_options())
    payload = next(k for k in fs.find(gs_url.split("://")[1])
                   if "step-000000002/replicated" in k and k.endswith(".safetensors"))
    data = bytearray(fs.cat_file(payload))
    data[len(data) // 2] ^= 0x10
    fs.pipe_file(payload, bytes(data))
    back = state_with(9)
    with distckpt.CheckpointManager(gs_url, storage_options=gcs_server.storage_options()) as mgr:
        with pytest.warns(distckpt.CheckpointFallbackWarning, match="step 2"):
            assert mgr.load_latest(back).step == 1
    assert same(back, first)


def test_two_writers_of_one_step_exactly_one_commits_on_gcs(gcs_server, gs_url):
    from distckpt.storage import open_storage

    a = open_storage(gs_url, gcs_server.storage_options())
    b = open_storage(gs_url, gcs_server.storage_options())
    a.create_exclusive("step-000000001/COMMITTED", b"writer a")
    with pytest.raises(distckpt.CheckpointExistsError, match="another writer committed"):
        b.create_exclusive("step-000000001/COMMITTED", b"writer b")
    assert b.read_bytes("step-000000001/COMMITTED") == b"writer a"


def test_no_non_atomic_warning_for_gcs(gcs_server, gs_url, recwarn):
    from distckpt.storage import NonAtomicStorageWarning, open_storage

    open_storage(gs_url, gcs_server.storage_options())
    assert not [w for w in recwarn if issubclass(w.category, NonAtomicStorageWarning)]
