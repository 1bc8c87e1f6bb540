"""GPU checks: run on a machine with CUDA (`pytest tests/gpu -v`); skipped without it.

They cover what the CPU suite cannot: every CUDA device's generator is captured and restored,
private CUDA generators travel, model/optimizer state on the GPU round-trips, and a CPU-written
checkpoint loaded where CUDA exists warns that the CUDA streams cannot be restored.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import distckpt
from distckpt.rng import capture_process_rng, restore_process_rng

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no CUDA device on this machine")]


def cuda_draws() -> list[float]:
    return [torch.rand(1, device=f"cuda:{i}").item() for i in range(torch.cuda.device_count())]


def test_every_cuda_device_stream_is_restored():
    torch.manual_seed(0)
    saved = capture_process_rng()
    assert len(saved["cuda"]) == torch.cuda.device_count()
    first = cuda_draws()
    restore_process_rng(saved, "gpu test")
    assert cuda_draws() == first


def test_gpu_state_and_private_cuda_generator_roundtrip(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2), nn.Linear(16, 1)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    gen = torch.Generator(device="cuda").manual_seed(5)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 16, device="cuda", generator=gen)).sum().backward()
        opt.step()
    state = {"model": model, "optimizer": opt, "gen": gen}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, state)
    expected = (model(torch.randn(4, 16, device="cuda", generator=gen)).detach().cpu(), cuda_draws())
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load_latest(state)
    got = (model(torch.randn(4, 16, device="cuda", generator=gen)).detach().cpu(), cuda_draws())
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1]
    assert next(model.parameters()).is_cuda


def test_cpu_written_rng_on_a_gpu_host_warns():
    state = capture_process_rng()
    state["cuda"] = []
    with pytest.warns(distckpt.RngRestoreWarning, match="0 CUDA RNG state"):
        restore_process_rng(state, "gpu test")


def test_async_save_stages_gpu_tensors_in_pinned_reused_buffers(tmp_path):
    model = nn.Linear(64, 64).cuda()
    with distckpt.CheckpointManager(str(tmp_path), async_save=True) as mgr:
        mgr.save(1, {"model": model})
        buffers = dict(mgr._staging.buffers)
        assert buffers and all(b.is_pinned() for b in buffers.values())
        saved = model.weight.detach().cpu().clone()
        with torch.no_grad():
            model.weight.add_(1.0)
        mgr.save(2, {"model": model})
        assert all(mgr._staging.buffers[k].data_ptr() == b.data_ptr() for k, b in buffers.items())
    fresh = nn.Linear(64, 64).cuda()
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load(fresh_state := {"model": fresh}, step=1)
    assert torch.equal(fresh_state["model"].weight.cpu(), saved)
