from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import distckpt


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "distckpt", *args], capture_output=True, text=True, timeout=60)


def test_ls_inspect_verify(ckpt_dir):
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, {"w": torch.ones(3), "config": {"lr": 1}}, epoch=0, metric=0.5)
        mgr.save(2, {"w": torch.ones(3), "config": {"lr": 1}}, epoch=0, metric=0.4)
    os.makedirs(os.path.join(ckpt_dir, "step-000000003"))
    rows = json.loads(run_cli("ls", ckpt_dir, "--json").stdout)
    assert [(r["step"], r["status"]) for r in rows] == [(1, "committed"), (2, "committed"), (3, "uncommitted")]
    out = json.loads(run_cli("inspect", ckpt_dir, "--json").stdout)
    assert out["manifest"]["step"] == 2 and any(t["shape"] == [3] for t in out["tensors"])
    assert run_cli("verify", ckpt_dir, "--all").returncode == 0
    payload = os.path.join(ckpt_dir, "step-000000001", "ranks", "rank-00000.safetensors")
    data = bytearray(open(payload, "rb").read())
    data[100] ^= 0xFF
    open(payload, "wb").write(bytes(data))
    bad = run_cli("verify", ckpt_dir, "--all")
    assert bad.returncode == 1 and "step 1: BAD" in bad.stdout and "rank-00000.safetensors" in bad.stdout
    assert "step 2: ok" in bad.stdout
