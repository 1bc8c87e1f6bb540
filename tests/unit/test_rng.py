"""Seed pitfall: one RNG entry claims the loop has one stream. Every stream must travel."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import distckpt
from distckpt.state.rng import capture_process_rng, restore_process_rng


def draws(gen: torch.Generator, np_gen: np.random.Generator) -> tuple[float, ...]:
    return (torch.randn(1).item(), torch.randn(1, generator=gen).item(), random.random(),
            float(np.random.rand()), float(np_gen.random()))


def seeded():
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    return torch.Generator().manual_seed(0), np.random.default_rng(0)


def test_torch_get_rng_state_alone_restores_one_stream_of_five():
    """The seed's measurement: restoring torch's CPU state leaves the other streams moved on."""
    gen, np_gen = seeded()
    saved = torch.get_rng_state()
    first = draws(gen, np_gen)
    torch.set_rng_state(saved)
    again = draws(gen, np_gen)
    assert [a == b for a, b in zip(first, again)] == [True, False, False, False, False]


def test_manager_restores_every_stream(ckpt_dir):
    gen, np_gen = seeded()
    state = {"gen": gen, "np_gen": np_gen}
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, state)
    first = draws(gen, np_gen)
    draws(gen, np_gen)  # move every stream further
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        assert mgr.load_latest(state).step == 1
    assert draws(gen, np_gen) == first


def test_saving_does_not_advance_any_stream(ckpt_dir):
    gen, np_gen = seeded()
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, {"gen": gen, "np_gen": np_gen})
    after_save = draws(gen, np_gen)
    gen2, np_gen2 = seeded()
    assert draws(gen2, np_gen2) == after_save


def test_missing_cuda_streams_are_a_loud_warning():
    state = capture_process_rng()
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(here)] + [torch.zeros(16, dtype=torch.uint8)]
    with pytest.warns(distckpt.RngRestoreWarning, match=f"{here + 1} CUDA RNG state.*{here} CUDA device"):
        restore_process_rng(state, "test")


def test_numpy_bit_generators_of_every_kind_roundtrip(ckpt_dir):
    gens = {name: np.random.Generator(getattr(np.random, name)(7)) for name in ("PCG64", "MT19937", "Philox", "SFC64")}
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(0, dict(gens))
    expected = {k: g.random(3).tolist() for k, g in gens.items()}
    fresh = {name: np.random.Generator(getattr(np.random, name)(99)) for name in gens}
    with distckpt.CheckpointManager(ckpt_dir) as mgr:
        mgr.load_latest(fresh)
    assert {k: g.random(3).tolist() for k, g in fresh.items()} == expected


class _NoisyMap(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(2) + i


class _NoisyStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (info.id, info.num_workers) if info else (0, 1)
        order = np.random.permutation(24)[start::step]  # a shuffle drawn when the pass starts
        for i in order:
            yield torch.rand(2) + float(i)


@pytest.fixture
def gpu_host_with_forked_workers(monkeypatch):
    """This process looks like a GPU host; a loader worker touching CUDA fails as a worker forked
    after CUDA was used does ("Cannot re-initialize CUDA in forked subprocess")."""
    import distckpt.state.streams as streams

    device_state = [torch.zeros(16, dtype=torch.uint8)]

    def in_worker_fails(what):
        def guarded(*args):
            if torch.utils.data.get_worker_info() is not None:
                raise RuntimeError("Cannot re-initialize CUDA in forked subprocess")
            return what(*args)
        return guarded

    monkeypatch.setattr(streams, "_cuda_states", in_worker_fails(lambda: [t.clone() for t in device_state]))
    monkeypatch.setattr(streams, "_cuda_count", in_worker_fails(lambda: 1))
    monkeypatch.setattr(streams, "_set_cuda_state", in_worker_fails(lambda i, s: device_state[i].copy_(s)))


@pytest.mark.parametrize("dataset", [_NoisyMap, _NoisyStream])
def test_loader_workers_on_a_gpu_host_save_and_resume_their_cpu_streams(ckpt_dir, gpu_host_with_forked_workers,
                                                                         dataset):
    """with_worker_rng captured every stream in each worker, CUDA's too: on a GPU machine every
    save of a job with loader workers failed in the worker."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make() -> StatefulDataLoader:
        return StatefulDataLoader(distckpt.with_worker_rng(dataset()), batch_size=2, num_workers=2,
                                  multiprocessing_context="fork")

    def run(resume: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        loader = make()
        state = {"loader": loader}
        with distckpt.CheckpointManager(ckpt_dir) as mgr:
            if resume:
                assert mgr.load_latest(state).step == 3
            out = []
            for n, batch in enumerate(loader):
                out.append(batch)
                if not resume and n == 3:
                    mgr.save(3, state)
        return out

    whole = run(resume=False)
    resumed = run(resume=True)
    assert len(resumed) == len(whole) - 4
    assert all(torch.equal(a, b) for a, b in zip(whole[4:], resumed))
