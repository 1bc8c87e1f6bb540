"""Async saves: the staging buffers allocated at the load and faulted in off the training
thread, so the first save copies into ready memory (StagingPool.warm, Session._warm_staging)."""

from __future__ import annotations

import resource
import time

import pytest
import torch

import distckpt
from distckpt.io.staging import WARM_MIN_BYTES, StagingPool

PAGE = resource.getpagesize()


def test_a_warmed_pool_hands_its_spares_to_the_first_save_by_shape():
    big, other, small = torch.randn(64, 1024), torch.randn(2, 1024, 16), torch.randn(8)
    pool = StagingPool()
    made = pool.warm([big, other, small])
    assert len(made) == 2  # the small tensor is left to the save
    staged = pool.stage("a", big)
    assert any(staged is m for m in made) and torch.equal(staged, big)
    assert torch.equal(pool.stage("b", other), other) and any(pool.buffers["b"] is m for m in made)
    assert torch.equal(pool.stage("c", small), small) and not any(pool.buffers["c"] is m for m in made)
    pool.drop_spares()
    assert pool.warm([big]) == []  # a pool that staged once keeps its buffers: nothing more allocated


def test_spares_the_save_did_not_take_are_let_go():
    pool = StagingPool()
    made = pool.warm([torch.randn(WARM_MIN_BYTES // 4), torch.randn(WARM_MIN_BYTES // 4 + 1)])
    assert len(made) == 2
    pool.stage("x", torch.randn(WARM_MIN_BYTES // 4))
    pool.drop_spares()
    assert sum(len(v) for v in pool._spares.values()) == 0


def _thread_minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _model_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    return {"model": model, "opt": opt, "extra": torch.randn(1 << 20)}


def _kernel_faults_in_ahead() -> bool:
    """Whether madvise(MADV_POPULATE_WRITE) works here (Linux 5.14 and later)."""
    from distckpt.io import copying
    madvise = copying._libc_madvise()
    if madvise is None:
        return False
    buf = torch.empty(4 * PAGE, dtype=torch.uint8)
    start = -(-buf.data_ptr() // PAGE) * PAGE
    return madvise(start, PAGE, copying._MADV_POPULATE_WRITE) == 0


@pytest.mark.skipif(not hasattr(resource, "RUSAGE_THREAD") or not _kernel_faults_in_ahead(),
                    reason="per-thread fault counts and MADV_POPULATE_WRITE are Linux's (5.14 and later)")
@pytest.mark.parametrize("resumed", [False, True])
def test_the_first_async_save_after_load_latest_faults_in_no_staging_pages(tmp_path, resumed):
    state = _model_state()
    nbytes = sum(t.numel() * t.element_size() for t in [*state["model"].state_dict().values(), state["extra"]])
    nbytes += sum(t.numel() * t.element_size() for s in state["opt"].state.values() for t in s.values())
    if resumed:
        with distckpt.CheckpointManager(str(tmp_path)) as mgr:
            mgr.save(1, state)
    with distckpt.CheckpointManager(str(tmp_path), async_save=True) as mgr:
        progress = mgr.load_latest(state)
        assert (progress is not None) == resumed
        warming = mgr._session.warming
        assert warming is not None and warming._thread is not None
        warming._thread.join(timeout=60)  # the training between the resume and the first save
        before = _thread_minor_faults()
        mgr.save(2, state)
        faults = _thread_minor_faults() - before
        # without the warm-up the copy faulted in every page of every buffer (~nbytes / PAGE)
        assert faults < 0.1 * nbytes / PAGE, (faults, nbytes // PAGE)
        assert mgr._session.warming is None and not any(mgr._session.staging._spares.values())
        mgr.wait()
    expected = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with torch.no_grad():
        for p in state["model"].parameters():
            p.zero_()
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.load_latest(state).step == 2
    assert all(torch.equal(state["model"].state_dict()[k], v) for k, v in expected.items())


def test_a_save_right_after_the_load_stops_the_warm_up_and_saves_the_values(tmp_path):
    state = {"t": torch.randn(4 << 20)}  # 16 MiB: the warm-up is still running at the save
    with distckpt.CheckpointManager(str(tmp_path), async_save=True) as mgr:
        mgr.load_latest(state)
        start = time.process_time()
        mgr.save(1, state)
        mgr.wait()
        assert time.process_time() - start < 30
    saved = state["t"].clone()
    state["t"].zero_()
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load_latest(state)
    assert torch.equal(state["t"], saved)


def test_sync_managers_allocate_nothing_at_the_load(tmp_path):
    state = {"t": torch.randn(1 << 20)}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load_latest(state)
        assert mgr._session.warming is None and not mgr._session.staging._spares


def test_a_tied_weight_is_allocated_ahead_once():
    from distckpt.state.kinds import classify, staged_tensors

    emb = torch.nn.Embedding(1000, 64)
    head = torch.nn.Linear(64, 1000, bias=False)
    head.weight = emb.weight  # tied, as language models tie input and output embeddings
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    tensors = staged_tensors(classify({"model": model}))
    assert len(tensors) == 1 and tensors[0].data_ptr() == emb.weight.data_ptr()
