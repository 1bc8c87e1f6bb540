"""overlap_snapshot: save() returns before the copy of parameters and optimizer state into host
memory is done; the copy runs on the writer thread while the next forward and backward run.

The promise: the checkpoint holds the values at save() time, whatever the loop does next —
an optimizer step waits for the copy, buffers a forward changes (BatchNorm) are copied before
save() returns, and any other in-place change of a tensor still being copied fails the save
loudly (SnapshotChangedError inside AsyncSaveError), never commits torn values.

The writer thread is held at the copy's start (a fault point) so each mutation surely lands
while the copy is outstanding.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import distckpt
from distckpt.runtime import faults

HOLD_S = 0.3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 8, generator=g)
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()


def _values(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, state in enumerate(opt.state_dict()["state"].values()):
        out.update({f"opt.{i}.{k}": v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)})
    return out


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


class _Hold:
    """Holds the writer thread at the snapshot copy of `step` until released."""

    def __init__(self, step: int) -> None:
        self.release = threading.Event()
        self.reached = threading.Event()
        self._step = step
        self._off = faults.on_point(self._hook)

    def _hook(self, name: str, context: dict) -> None:
        if name == "save/snapshot-copy" and context["step"] == self._step:
            self.reached.set()
            assert self.release.wait(30)

    def release_later(self, seconds: float) -> None:
        threading.Timer(seconds, self.release.set).start()

    def close(self) -> None:
        self.release.set()
        self._off()


@pytest.fixture
def setup(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train_step(model, opt, 1)  # the optimizer has state
    mgr = distckpt.CheckpointManager(str(tmp_path / "ckpt"), async_save=True, overlap_snapshot=True)
    holds: list[_Hold] = []
    yield model, opt, mgr, holds
    for h in holds:
        h.close()
    mgr.close()


def _load(root, step: int | None = None) -> dict[str, torch.Tensor]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train_step(model, opt, 99)  # different values and state, overwritten by the load
    with distckpt.CheckpointManager(root) as mgr:
        progress = mgr.load({"model": model, "optimizer": opt}, step) if step is not None else \
            mgr.load_latest({"model": model, "optimizer": opt})
        assert progress is not None
    return _values(model, opt)


def _save_held(model, opt, mgr, holds) -> tuple[dict[str, torch.Tensor], _Hold]:
    """Step 0 committed; step 1 saved with its copy held outstanding. Returns the values at
    save(1) and the hold."""
    mgr.save(0, {"model": model, "optimizer": opt})
    mgr.wait()
    values = _values(model, opt)
    holds.append(hold := _Hold(1))
    mgr.save(1, {"model": model, "optimizer": opt})
    assert hold.reached.wait(10)  # the copy is outstanding
    return values, hold


def test_a_step_forward_and_backward_right_after_save_leave_the_checkpoint_as_it_was(setup, tmp_path):
    model, opt, mgr, holds = setup
    want, hold = _save_held(model, opt, mgr, holds)
    hold.release_later(HOLD_S)
    t0 = time.perf_counter()
    _train_step(model, opt, 2)  # forward (BatchNorm statistics change), backward, step (waits)
    waited = time.perf_counter() - t0
    mgr.wait()
    assert waited >= HOLD_S * 0.8, f"the optimizer step did not wait for the copy ({waited:.3f}s)"
    now = _values(model, opt)
    assert not torch.equal(now["model.1.running_mean"], want["model.1.running_mean"])  # they did change
    assert not torch.equal(now["model.0.weight"], want["model.0.weight"])
    _assert_same(_load(str(tmp_path / "ckpt"), 1), want)


def _add_one(model, opt):
    with torch.no_grad():
        model[0].weight.add_(1)


def _copy_into(model, opt):
    with torch.no_grad():
        model[3].bias.copy_(torch.full_like(model[3].bias, 7.0))


def _load_state_dict(model, opt):
    fresh = _model()
    for p in fresh.parameters():
        p.data.mul_(3)
    model.load_state_dict(fresh.state_dict())


def _zero_optimizer_state(model, opt):
    next(iter(opt.state.values()))["exp_avg"].zero_()


@pytest.mark.parametrize("mutate", [_add_one, _copy_into, _load_state_dict, _zero_optimizer_state],
                         ids=["add_", "copy_", "load_state_dict", "optimizer state zero_"])
def test_an_in_place_change_by_another_path_fails_the_save_loudly(setup, tmp_path, mutate):
    model, opt, mgr, holds = setup
    before, hold = _save_held(model, opt, mgr, holds)
    mutate(model, opt)
    hold.release.set()
    with pytest.raises(distckpt.AsyncSaveError, match="changed in place") as info:
        mgr.wait()
    assert isinstance(info.value.__cause__, distckpt.SnapshotChangedError)
    assert mgr.committed_steps() == [0]
    _assert_same(_load(str(tmp_path / "ckpt")), before)  # the previous checkpoint is untouched
    mgr.save(2, {"model": model, "optimizer": opt})  # and the manager goes on
    mgr.wait()
    assert mgr.committed_steps() == [2, 0]


def test_without_an_optimizer_in_state_everything_is_copied_before_save_returns(tmp_path):
    model = _model()
    with distckpt.CheckpointManager(str(tmp_path), async_save=True, overlap_snapshot=True) as mgr:
        want = {k: v.clone() for k, v in model.state_dict().items()}
        hold = _Hold(3)
        try:
            mgr.save(3, {"model": model})
            assert hold.reached.wait(10)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1)  # nothing is deferred: no error, and the checkpoint holds `want`
        finally:
            hold.close()
        mgr.wait()
    fresh = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load({"model": fresh}, 3)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_close_removes_the_step_hooks(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = distckpt.CheckpointManager(str(tmp_path), async_save=True, overlap_snapshot=True)
    mgr.save(1, {"model": model, "optimizer": opt})
    assert len(opt._optimizer_step_pre_hooks) == 1
    mgr.save(2, {"model": model, "optimizer": opt})
    assert len(opt._optimizer_step_pre_hooks) == 1  # one hook per optimizer, not per save
    mgr.close()
    assert len(opt._optimizer_step_pre_hooks) == 0


def test_overlap_snapshot_needs_async_save(tmp_path):
    with pytest.raises(distckpt.ConfigError, match="overlap_snapshot=True needs async_save=True"):
        distckpt.CheckpointManager(str(tmp_path), overlap_snapshot=True)


def test_every_step_saves_resume_bitwise(tmp_path):
    """A loop saving every step with overlap: resuming from any step continues exactly as the
    uninterrupted run did."""
    def run(steps: range, root: str, resume: bool) -> list[str]:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        losses = []
        with distckpt.CheckpointManager(root, async_save=True, overlap_snapshot=True) as mgr:
            if resume:
                assert mgr.load_latest({"model": model, "optimizer": opt}) is not None
            for step in steps:
                g = torch.Generator().manual_seed(step)
                opt.zero_grad(set_to_none=True)
                loss = model(torch.randn(32, 8, generator=g)).square().mean()
                loss.backward()
                opt.step()
                losses.append(loss.item().hex())
                mgr.save(step, {"model": model, "optimizer": opt})
        return losses

    whole = run(range(12), str(tmp_path / "a"), resume=False)
    first = run(range(7), str(tmp_path / "b"), resume=False)
    rest = run(range(7, 12), str(tmp_path / "b"), resume=True)
    assert first + rest == whole


def test_an_in_place_operation_still_running_when_the_copy_ends_fails_the_save(setup, tmp_path):
    """torch bumps a version counter when the in-place operation ends: the writer's copy can end
    while one is still running on the training thread. The check runs on the training thread
    (here at wait()), after the operation, so it sees the change."""
    model, opt, mgr, holds = setup
    big = nn.Linear(1000, 2000, dtype=torch.float64)  # slow enough in place to outlast the copy
    big_opt = torch.optim.SGD(big.parameters(), lr=0.1)
    state = {"model": big, "optimizer": big_opt}
    mgr.save(0, state)
    mgr.wait()
    holds.append(hold := _Hold(1))
    mgr.save(1, state)
    assert hold.reached.wait(10)
    hold.release_later(0.02)  # the writer copies while the operation below runs
    with torch.no_grad():
        big.weight.lgamma_()  # ~0.1-1 s here; caught however its end and the copy's fall
    with pytest.raises(distckpt.AsyncSaveError, match="changed in place") as info:
        mgr.wait()
    assert isinstance(info.value.__cause__, distckpt.SnapshotChangedError)
    assert mgr.committed_steps() == [0]


def test_an_interrupted_wait_leaves_the_save_pending_and_the_next_step_does_not_hang(tmp_path):
    """Ctrl-C in wait(): the save stays in flight; the next save()/wait() waits for it and raises
    its failure; an optimizer step right after never blocks for good."""
    import signal

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train_step(model, opt, 1)

    def slow_then_fail(name: str, context: dict) -> None:
        if name == "save/manifest-written" and context["step"] == 1:
            time.sleep(1.0)
            raise OSError(5, "Input/output error")

    off = faults.on_point(slow_then_fail)

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        mgr = distckpt.CheckpointManager(str(tmp_path), async_save=True, overlap_snapshot=True, timeout=30)
        mgr.save(1, {"model": model, "optimizer": opt})
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            mgr.wait()
        t0 = time.perf_counter()
        _train_step(model, opt, 2)  # must not hang
        assert time.perf_counter() - t0 < 10
        with pytest.raises(distckpt.AsyncSaveError, match="Input/output error"):
            mgr.save(2, {"model": model, "optimizer": opt})
        mgr.save(2, {"model": model, "optimizer": opt})
        _train_step(model, opt, 3)
        mgr.close()
        assert mgr.committed_steps() == [2]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        off()


def test_a_forward_that_renormalises_an_embedding_does_not_fail_the_save(tmp_path):
    """Embedding(max_norm=...) changes its weight in place in the forward (its version counter
    moves even when no row does): that weight is copied before save() returns."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8, max_norm=1.0), nn.Flatten(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    tokens = torch.randint(0, 50, (16, 4))

    def step() -> None:
        opt.zero_grad()
        model(tokens).square().mean().backward()
        opt.step()

    step()
    with distckpt.CheckpointManager(str(tmp_path), async_save=True, overlap_snapshot=True) as mgr:
        hold = _Hold(1)
        try:
            want = {k: v.clone() for k, v in model.state_dict().items()}
            mgr.save(1, {"model": model, "optimizer": opt})
            assert hold.reached.wait(10)
            hold.release_later(HOLD_S)
            step()  # the forward renormalises rows in place, then the step waits for the copy
        finally:
            hold.close()
        mgr.wait()
    fresh = nn.Sequential(nn.Embedding(50, 8, max_norm=1.0), nn.Flatten(), nn.Linear(32, 1))
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load({"model": fresh, "optimizer": torch.optim.Adam(fresh.parameters(), lr=0.01)}, 1)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k


_EXAMPLES = int(os.environ.get("DISTCKPT_HYPOTHESIS_EXAMPLES", "6"))
_OPS = ["step", "forward", "mutate", "save", "held save", "wait"]


@settings(max_examples=_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.sampled_from(_OPS), min_size=1, max_size=14))
def test_generated_loops_commit_exactly_the_values_at_save_or_fail_loudly(tmp_path_factory, ops):
    """Generated sequences of optimizer steps, forwards (BatchNorm statistics change), in-place
    changes by another path, saves (some with the copy held outstanding while the next operation
    runs) and waits: every step that commits holds exactly the values at its save(); a save fails
    only with SnapshotChangedError, and only when something changed a tensor in place after it."""
    root = str(tmp_path_factory.mktemp("generated"))
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train_step(model, opt, 0)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    mutated_after: dict[int, bool] = {}
    failed: dict[int, BaseException] = {}
    pending: int | None = None
    holds: list[_Hold] = []

    def collect(call: Any) -> bool:
        """Run a manager call; a failure it raises is the pending save's (that call did nothing else)."""
        nonlocal pending
        try:
            call()
            return True
        except distckpt.AsyncSaveError as e:
            assert pending is not None
            failed[pending], pending = e, None
            return False

    with distckpt.CheckpointManager(root, async_save=True, overlap_snapshot=True, timeout=60) as mgr:
        for i, op in enumerate(ops):
            if op == "step":
                _train_step(model, opt, i + 1)
            elif op == "forward":
                model(torch.randn(8, 8))
            elif op == "mutate":
                with torch.no_grad():
                    model[3].weight.mul_(1.5)
                if pending is not None:
                    mutated_after[pending] = True
            elif op in ("save", "held save"):
                step = i + 1
                if op == "held save":
                    holds.append(hold := _Hold(step))
                    hold.release_later(0.05)
                values = _values(model, opt)
                if collect(lambda step=step: mgr.save(step, {"model": model, "optimizer": opt})):
                    expected[step], mutated_after[step], pending = values, False, step
            elif collect(mgr.wait):
                pending = None
        collect(mgr.wait)
        committed = mgr.committed_steps()
    for h in holds:
        h.close()
    for step, error in failed.items():
        assert isinstance(error.__cause__, distckpt.SnapshotChangedError), error
        assert mutated_after[step], f"step {step} failed with nothing changed after its save: {error}"
    for step in expected:
        assert (step in committed) != (step in failed), (step, committed, sorted(failed))
        if not mutated_after[step]:
            assert step in committed
    for step in committed:
        _assert_same(_load(root, step), expected[step])
