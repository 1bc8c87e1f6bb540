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
from distckpt.state.rng import capture_process_rng, restore_process_rng

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
        buffers = dict(mgr._session.staging.buffers)
        assert buffers and all(b.is_pinned() for b in buffers.values())
        saved = model.weight.detach().cpu().clone()
        with torch.no_grad():
            model.weight.add_(1.0)
        mgr.save(2, {"model": model})
        assert all(mgr._session.staging.buffers[k].data_ptr() == b.data_ptr() for k, b in buffers.items())
    fresh = nn.Linear(64, 64).cuda()
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load(fresh_state := {"model": fresh}, step=1)
    assert torch.equal(fresh_state["model"].weight.cpu(), saved)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def test_overlapped_async_save_of_gpu_state_keeps_the_values_of_the_save(tmp_path):
    """The optimizer step right after save() changes every parameter on the GPU; the checkpoint
    must hold the values of the save, whatever the copy to the host was doing meanwhile."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 1024, device="cuda")

    _train_step(model, opt, x)
    state = {"model": model, "optimizer": opt}
    with distckpt.CheckpointManager(str(tmp_path), async_save=True, overlap_snapshot=True) as mgr:
        for n in range(3):
            expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            mgr.save(n, state)
            _train_step(model, opt, x)  # mutates every parameter and moment at once
    fresh = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load({"model": fresh}, step=2)
    got = fresh.state_dict()
    assert all(torch.equal(got[k].cpu(), v) for k, v in expected.items())
    assert all(t.is_cuda for t in got.values())


def test_overlapped_save_of_gpu_state_returns_before_the_side_stream_copy_ran(tmp_path):
    """save() with overlap_snapshot must not wait for the GPU: the current stream is kept busy
    (torch.cuda._sleep) so the side stream's copy, queued behind it, cannot have run when save()
    returns; the optimizer step then waits for it, and the checkpoint holds the pre-step values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512)).cuda()  # no buffers: all deferrable
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(32, 512, device="cuda")

    _train_step(model, opt, x)
    state = {"model": model, "optimizer": opt}
    with distckpt.CheckpointManager(str(tmp_path), async_save=True, overlap_snapshot=True) as mgr:
        torch.cuda.synchronize()
        expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time on the current stream
        mgr.save(1, state)
        current_busy = not torch.cuda.current_stream().query()
        side = mgr._session.staging._side_streams[torch.device("cuda", 0)]
        side_busy = not side.query()
        _train_step(model, opt, x)  # its pre-hook waits for the copy
        mgr.wait()
    assert current_busy and side_busy, "save() waited for the GPU"
    fresh = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512)).cuda()
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load({"model": fresh}, step=1)
    assert all(torch.equal(fresh.state_dict()[k].cpu(), v) for k, v in expected.items())


def test_overlapped_gpu_save_mutated_by_each_path_a_loop_uses(tmp_path):
    """Right after save(): a BN forward (buffers, copied before save() returns) keeps the saved
    statistics; an in-place copy_ into a parameter while its side-stream copy may be pending is
    refused (SnapshotChangedError), never stored torn."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256)).cuda()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 256, device="cuda")
    model(x).square().mean().backward()
    opt.step()
    state = {"model": model, "optimizer": opt}
    with distckpt.CheckpointManager(str(tmp_path), async_save=True, overlap_snapshot=True) as mgr:
        torch.cuda.synchronize()
        expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        torch.cuda._sleep(500_000_000)
        mgr.save(1, state)
        model(x)  # BN running statistics change in this forward
        mgr.wait()
        torch.cuda._sleep(500_000_000)
        mgr.save(2, state)
        with torch.no_grad():
            model[0].weight.copy_(torch.zeros_like(model[0].weight))
        with pytest.raises(distckpt.AsyncSaveError) as info:
            mgr.wait()
        assert isinstance(info.value.__cause__, distckpt.SnapshotChangedError)
    fresh = nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256)).cuda()
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.committed_steps() == [1]
        mgr.load({"model": fresh}, step=1)
    assert all(torch.equal(fresh.state_dict()[k].cpu(), v) for k, v in expected.items())


def test_gpu_written_loads_into_cpu_and_cpu_written_into_gpu(tmp_path):
    torch.manual_seed(0)
    gpu_model = nn.Linear(32, 8).cuda()
    with distckpt.CheckpointManager(str(tmp_path / "g")) as mgr:
        mgr.save(1, {"model": gpu_model})
    cpu_model = nn.Linear(32, 8)
    with distckpt.CheckpointManager(str(tmp_path / "g")) as mgr:
        mgr.load({"model": cpu_model}, step=1)
    assert torch.equal(cpu_model.weight, gpu_model.weight.cpu()) and not cpu_model.weight.is_cuda
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        mgr.save(1, {"model": cpu_model})
    back = nn.Linear(32, 8).cuda()
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        mgr.load({"model": back}, step=1)
    assert back.weight.is_cuda and torch.equal(back.weight.cpu(), cpu_model.weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8, torch.bool])
def test_gpu_tensors_of_every_width_come_back_bitwise(tmp_path, dtype):
    raw = torch.randint(0, 256, (4099,), dtype=torch.uint8, device="cuda")
    if dtype == torch.bool:
        value = (raw % 2).bool()
    elif dtype.itemsize == 1:
        value = raw.view(dtype)  # every byte pattern, NaN encodings of float8 included
    else:
        value = torch.randn(4099, device="cuda").to(dtype)
    state = {"t": value}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, state)
    target = {"t": torch.zeros_like(value)}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load(target, step=1)
    assert target["t"].is_cuda and target["t"].dtype == dtype
    assert torch.equal(target["t"].view(torch.uint8) if dtype.itemsize == 1 else target["t"].view(torch.int16),
                       value.view(torch.uint8) if dtype.itemsize == 1 else value.view(torch.int16))


def _gpu_job(tmp_path, extra: list[str], kill_at: str = "step:27", nproc: int = 1) -> None:
    """launch/train.py on this GPU under a real torchrun (one rank, NCCL), SIGKILLed and resumed
    by torchrun's restart, compared step by step with the uninterrupted run."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "launch"))
    from demo import run_pair

    result, resumes = run_pair(str(tmp_path), nproc=nproc, steps=50, kill_at=kill_at, workers=2, extra=extra)
    assert resumes, "the killed run did not resume"
    assert result.identical, result.table


@pytest.mark.parametrize("extra", [[], ["--async-save"], ["--async-save", "--overlap-snapshot"], ["--fsdp"]],
                         ids=["sync", "async", "async-overlap", "fsdp2"])
def test_training_on_the_gpu_killed_and_resumed_is_bit_for_bit(tmp_path, extra):
    _gpu_job(tmp_path, ["--ckpt-every", "10", *extra])


class _ShadowWeights:
    """An EMA helper as people write it: keeps the tensors load_state_dict is given."""

    def __init__(self, model: nn.Module) -> None:
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def state_dict(self) -> dict:
        return {"shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.shadow = state["shadow"]


def test_values_and_stateful_tensors_come_back_on_the_gpu_they_were_saved_from(tmp_path):
    """A dict of GPU tensors (an EMA copy, a running statistic) came back on the CPU: the next
    `ema[k].mul_(d).add_(p)` then failed with a device mismatch."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64).cuda()
    state = {"model": model, "ema": {k: v.detach().clone() for k, v in model.state_dict().items()},
             "shadow": _ShadowWeights(model), "stats": [torch.zeros(3, device="cuda"), 5, torch.ones(2)]}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, state)
    fresh_model = nn.Linear(64, 64).cuda()
    fresh = {"model": fresh_model, "ema": {}, "shadow": _ShadowWeights(fresh_model), "stats": []}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load_latest(fresh)
    for k, v in state["ema"].items():
        assert fresh["ema"][k].device == v.device and torch.equal(fresh["ema"][k], v)
        assert fresh["shadow"].shadow[k].device == v.device and torch.equal(fresh["shadow"].shadow[k], v)
        fresh["ema"][k].mul_(0.9).add_(fresh_model.state_dict()[k], alpha=0.1)  # the loop's next EMA update
    assert fresh["stats"][0].is_cuda and fresh["stats"][1] == 5 and fresh["stats"][2].device.type == "cpu"


def test_loading_a_gpu_model_adds_no_second_copy_on_the_gpu(tmp_path):
    """Module tensors are copied into the live ones: the load must not place a whole second
    copy of the model on the GPU first."""
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(16)]).cuda()  # 256 MiB
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"model": model})
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load_latest({"model": model})
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert extra <= 0.1 * model_bytes, f"the load took {extra / 2**20:.0f} MiB more on the GPU"


def test_two_ranks_sharing_one_gpu_over_gloo_killed_and_resumed_is_bit_for_bit(tmp_path):
    """Several ranks with GPU tensors (DDP over gloo: NCCL wants a GPU per rank): the ranks' digests
    of replicated GPU values, rank 1's GPU state and the replicated values placed on each rank's
    device. Written for a one-GPU machine."""
    _gpu_job(tmp_path, ["--ckpt-every", "10", "--backend", "gloo", "--async-save"], kill_at="step:27:1", nproc=2)
