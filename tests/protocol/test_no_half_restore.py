"""After any failed load, every tensor, optimizer state, scheduler, sampler, loader, RNG stream
and plain value of `state` is what it was: a matrix where entry k of n fails, before and after
its owner applied part of it, and the incompatibilities found by trying (each refused before
anything changed)."""

from __future__ import annotations

import collections
import copy
import random
import re

import numpy as np
import pytest
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

import distckpt
from distckpt.runtime import faults
from distckpt.state import kinds


def build(seed: int = 0, **changes):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    # Load logic of the model's own (as many real models have): it could fail after applying.
    model.register_load_state_dict_post_hook(lambda module, keys: None)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, 0.5, total_iters=2),
              torch.optim.lr_scheduler.StepLR(opt, 3)], milestones=[2])
    sampler_gen = torch.Generator().manual_seed(3)
    data = list(range(16))
    sampler = torch.utils.data.RandomSampler(data, generator=sampler_gen)
    loader = StatefulDataLoader(data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(4))
    state = {
        "model": model, "optimizer": opt, "scheduler": sched,
        "scaler": torch.amp.GradScaler("cpu", init_scale=8.0),
        "gen": torch.Generator().manual_seed(5), "np_gen": np.random.default_rng(6),
        "py_random": random.Random(7), "np_rs": np.random.RandomState(8),
        "sampler": sampler, "loader": loader, "values": {"seen": [1, 2], "best": 0.5},
        "config": {"lr": 0.01},
    }
    state.update(changes)
    return state


def train(state, steps: int = 2) -> None:
    model, opt, sched = state["model"], state["optimizer"], state["scheduler"]
    for _ in range(steps):
        loss = model(torch.randn(6, 4)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    state["gen"].random_() if hasattr(state["gen"], "random_") else torch.rand(1, generator=state["gen"])
    state["np_gen"].random()
    state["py_random"].random()
    state["np_rs"].rand()
    it = iter(state["loader"])
    next(it)
    state["values"]["seen"].append(len(state["values"]["seen"]))
    random.random(), np.random.rand(), torch.rand(1)


def fingerprint(state) -> list:
    out = []
    out += [t.clone() for t in state["model"].state_dict().values()]
    out += [(m, m.training) for m in state["model"].modules()]
    out.append(copy.deepcopy(state["optimizer"].state_dict()))
    out.append(copy.deepcopy(state["scheduler"].state_dict()))
    out.append(state["scaler"].state_dict())
    out.append(state["gen"].get_state())
    out.append(copy.deepcopy(state["np_gen"].bit_generator.state))
    out.append(state["py_random"].getstate())
    out.append(state["np_rs"].get_state(legacy=False))
    gen = state["sampler"].generator
    out.append(gen.get_state() if gen is not None else None)
    out.append((state["loader"]._iterator is not None, state["loader"].next_iter_state,
                "_distckpt_resume_plan" in vars(state["loader"])))  # a restore's replay for the next iter()
    out.append(copy.deepcopy(state["values"]))
    out.append((random.getstate(), np.random.get_state(legacy=False), torch.get_rng_state()))
    return out


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture
def saved_root(tmp_path):
    state = build()
    train(state)
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, state)
    return str(tmp_path)


KEYS = list(build())


@pytest.mark.parametrize("when", ["before-applying", "after-applying"])
@pytest.mark.parametrize("failing", [k for k in KEYS if k != "config"])
def test_an_entry_failing_while_restored_leaves_every_entry_as_it_was(saved_root, monkeypatch, failing, when):
    state = build(seed=1)
    train(state, steps=3)  # the live state differs from the checkpoint's everywhere
    before = fingerprint(state)
    real = kinds.restore_entry

    def failing_restore(entry, saved, st, memo=None, release=None):
        if entry.key == failing and when == "before-applying":
            raise RuntimeError(f"injected failure restoring {failing}")
        notes = real(entry, saved, st, memo, release)
        if entry.key == failing:
            raise RuntimeError(f"injected failure after restoring {failing}")
        return notes

    monkeypatch.setattr("distckpt.protocol.loading.restore_entry", failing_restore)
    with distckpt.CheckpointManager(saved_root) as mgr:
        with pytest.raises(distckpt.IncompatibleCheckpointError, match=f"state\\['{failing}'\\].*injected"):
            mgr.load_latest(state)
    after = fingerprint(state)
    for i, (a, b) in enumerate(zip(before, after)):
        assert same(a, b), f"item {i} of the fingerprint changed after the failed load of {failing!r}"


def test_a_plain_torch_module_is_checked_completely_instead_of_copied(saved_root):
    from distckpt.state.capture import has_own_load_logic as _has_own_load_logic

    plain = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    assert not _has_own_load_logic(plain)
    plain.register_load_state_dict_post_hook(lambda module, keys: None)
    assert _has_own_load_logic(plain)


def test_a_failure_after_everything_was_restored_puts_everything_back(saved_root):
    state = build(seed=1)
    train(state, steps=3)
    before_opt = copy.deepcopy(state["optimizer"].state_dict())
    before_rng = torch.get_rng_state()

    def fail(name, ctx):
        if name == "load/applied":
            raise RuntimeError("injected after the RNG restore")

    remove = faults.on_point(fail)
    try:
        with distckpt.CheckpointManager(saved_root) as mgr:
            with pytest.raises(distckpt.DistCkptError, match="injected"):
                mgr.load_latest(state)
    finally:
        remove()
    assert same(before_opt, state["optimizer"].state_dict())
    assert torch.equal(before_rng, torch.get_rng_state())


@pytest.mark.parametrize("saved, live", [
    (collections.OrderedDict(a=1), {"stale": 0}), ({"a": 1}, collections.OrderedDict(stale=0)),
    ((1, 2), [0]), ([1, 2], (0,)), ({"a": 1}, None)])
def test_a_placeholder_replaced_by_a_value_of_another_type_is_put_back_after_a_failed_load(tmp_path, saved, live):
    """A live container of another type than the saved value is replaced, not refilled; after
    a failure later in the load the very same object is back under its key, contents unchanged."""
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"v": saved})
    state = {"v": live}
    contents = copy.deepcopy(live)

    def fail(name, ctx):
        if name == "load/applied":
            raise RuntimeError("injected after every entry was restored")

    remove = faults.on_point(fail)
    try:
        with distckpt.CheckpointManager(str(tmp_path)) as mgr:
            with pytest.raises(distckpt.DistCkptError, match="injected"):
                mgr.load_latest(state)
    finally:
        remove()
    assert state["v"] is live and type(state["v"]) is type(contents) and state["v"] == contents


def _refused_before_anything_changed(saved_root, state, match):
    before = fingerprint(state) if {"model", "gen"} <= set(state) and len(state) == len(KEYS) else None
    with distckpt.CheckpointManager(saved_root) as mgr:
        with pytest.raises(distckpt.IncompatibleCheckpointError, match=match):
            mgr.load_latest(state)
    if before is not None:
        assert all(same(a, b) for a, b in zip(before, fingerprint(state)))


def test_a_numpy_generator_of_another_bit_generator_is_refused(saved_root):
    state = build(np_gen=np.random.Generator(np.random.MT19937(1)))
    _refused_before_anything_changed(saved_root, state, "PCG64 was saved")


def test_a_sampler_saved_with_a_generator_loaded_without_one_is_refused(saved_root):
    sampler = torch.utils.data.RandomSampler(list(range(16)))
    sampler.generator = None
    _refused_before_anything_changed(saved_root, build(sampler=sampler), "has no generator here")


def test_a_grad_scaler_saved_enabled_loaded_disabled_is_refused(saved_root):
    _refused_before_anything_changed(saved_root, build(scaler=torch.amp.GradScaler("cpu", enabled=False)),
                                     "GradScaler is disabled here")


def test_an_optimizer_over_the_parameters_in_another_order_is_refused(saved_root):
    state = build()
    params = list(state["model"].parameters())
    state["optimizer"] = torch.optim.AdamW(params[::-1], lr=0.01)
    state["scheduler"] = torch.optim.lr_scheduler.SequentialLR(
        state["optimizer"], [torch.optim.lr_scheduler.LinearLR(state["optimizer"], 0.5, total_iters=2),
                             torch.optim.lr_scheduler.StepLR(state["optimizer"], 3)], milestones=[2])
    _refused_before_anything_changed(saved_root, state, "another order")


def test_a_sequential_schedule_of_three_is_refused_for_a_checkpoint_of_two(saved_root):
    state = build()
    opt = state["optimizer"]
    lr = torch.optim.lr_scheduler
    state["scheduler"] = lr.SequentialLR(opt, [lr.LinearLR(opt, 0.5, total_iters=2), lr.StepLR(opt, 3),
                                               lr.ConstantLR(opt)], milestones=[2, 4])
    _refused_before_anything_changed(saved_root, state, "3 inner schedulers here, 2 in the checkpoint")


def test_an_fp32_checkpoint_into_a_bf16_model_is_refused_unless_a_cast_is_allowed(saved_root):
    state = build()
    state["model"].to(torch.bfloat16)
    _refused_before_anything_changed(saved_root, state, "would be cast on load.*allow_dtype_cast=True")
    state = build()
    state["model"].to(torch.bfloat16)
    with distckpt.CheckpointManager(saved_root, allow_dtype_cast=True) as mgr:
        assert mgr.load_latest(state).step == 1
    assert state["model"][0].weight.dtype == torch.bfloat16


def test_an_entry_the_checkpoint_lacks_is_refused_or_kept_by_choice(saved_root):
    state = build(extra={"added": "later"})
    with distckpt.CheckpointManager(saved_root) as mgr:
        with pytest.raises(distckpt.IncompatibleCheckpointError, match="missing_entries='keep'"):
            mgr.load_latest(state)
    with distckpt.CheckpointManager(saved_root, missing_entries="keep") as mgr:
        with pytest.warns(distckpt.CheckpointWarning, match="extra"):
            assert mgr.load_latest(state).step == 1
    assert state["extra"] == {"added": "later"}


def test_private_python_and_numpy_streams_resume_exactly(tmp_path):
    state = {"r": random.Random(1), "rs": np.random.RandomState(2)}
    state["r"].random(), state["rs"].rand()
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(0, state)
    expected = (state["r"].random(), state["rs"].rand())
    fresh = {"r": random.Random(99), "rs": np.random.RandomState(99)}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load_latest(fresh)
    assert (fresh["r"].random(), fresh["rs"].rand()) == expected


def test_system_random_is_refused_at_save(tmp_path):
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(distckpt.UnstorableValueError, match="SystemRandom"):
            mgr.save(0, {"r": random.SystemRandom()})


@pytest.mark.parametrize("world, refuse_on", [(1, [0]), (2, [1]), (2, [0, 1])])
def test_a_module_with_its_own_load_logic_refusing_leaves_every_module_and_tensor_unchanged(tmp_path, world, refuse_on):
    """Plain modules and tensor entries are restored after every rank restored the rest; a module
    whose own _load_from_state_dict refuses is restored before them, so its failure (on any rank)
    leaves them, and its own parameters, untouched on every rank."""
    from distckpt.testing import run_world

    results = run_world("dist_workers:a_module_refusing_on_one_rank_leaves_every_rank_unchanged", world,
                        url=str(tmp_path), refuse_on=refuse_on)
    for r in results:
        assert r.error is None, r.error
        assert r.value == {"error": "IncompatibleCheckpointError", "unchanged": True, "eval_kept": True}, r.value


def _unwritable(kind: str, like: torch.Tensor) -> torch.Tensor:
    if kind == "expanded":
        return torch.zeros(1, dtype=like.dtype).expand(like.shape)
    if kind == "inference":
        with torch.inference_mode():
            return torch.zeros(like.shape, dtype=like.dtype)
    if kind == "read-only-mapping":  # np.load(mmap_mode="r"): a copy into it was a SIGSEGV
        import tempfile
        import warnings

        import numpy as np

        path = tempfile.NamedTemporaryFile(suffix=".npy", delete=False).name
        np.save(path, np.zeros(tuple(like.shape), dtype=np.float32))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch: "The given NumPy array is not writable"
            return torch.from_numpy(np.load(path, mmap_mode="r"))
    return torch.empty(like.shape, dtype=like.dtype, device="meta")


class _Buffered(nn.Module):
    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mask", mask)


@pytest.mark.parametrize("kind", ["expanded", "inference", "meta", "read-only-mapping"])
@pytest.mark.parametrize("where", ["tensor entry", "module buffer"])
def test_a_tensor_that_cannot_take_the_copy_is_refused_before_anything_changes(tmp_path, kind, where):
    """The copies into tensors run together at the phase's end (on several threads): what would
    make one fail — elements sharing memory, an inference tensor outside inference_mode, the
    meta device, memory mapped read-only (the process died of SIGSEGV) — is refused by the
    checks, naming it, and every entry is as it was (also the
    large one after it, which a copy on another thread would otherwise have filled)."""
    big = 3 * (8 << 20) // 4 + 17  # over three 8 MiB pieces
    torch.manual_seed(0)
    saved = {"z": torch.randn(10), "model": _Buffered(torch.randn(10)), "a": torch.randn(big)}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load_latest(saved)
        mgr.save(1, saved)
    target = {"z": torch.zeros(10), "model": _Buffered(torch.zeros(10)), "a": torch.zeros(big)}
    if where == "tensor entry":
        target["z"] = _unwritable(kind, target["z"])
        named = "state['z']"
    else:
        target["model"].mask = _unwritable(kind, target["model"].mask)
        named = "state['model'].mask"
    before = {"a": target["a"].clone(), "lin": copy.deepcopy(target["model"].lin.state_dict())}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(distckpt.IncompatibleCheckpointError, match=re.escape(named)):
            mgr.load_latest(target)
    assert torch.equal(target["a"], before["a"])
    assert all(torch.equal(v, before["lin"][k]) for k, v in target["model"].lin.state_dict().items())
    if kind != "meta":
        assert not target["z"].any() and not target["model"].mask.any()


def test_a_queued_copy_that_fails_is_raised_naming_what_it_restores():
    """A copy that fails for a reason no check sees stops the others before their next piece
    and is raised as CopyFailed, naming the entry."""
    from distckpt.io import copying
    release = copying.PageRelease([], threads=2)
    release.copy(torch.zeros(3 << 20), torch.ones(3 << 20), "state['before']")
    release.copy(torch.zeros(1).expand(8), torch.arange(8.0), "state['bad']")  # bypasses the checks
    release.copy(torch.zeros(3 << 20), torch.ones(3 << 20), "state['after']")
    with pytest.raises(copying.CopyFailed, match=re.escape("state['bad']")):
        release.finish()


class _TwoLinears(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2, bias=False)
        self.b = nn.Linear(2, 2, bias=False)
        if tie:
            self.b.weight = self.a.weight


def _live(layout: str) -> dict:
    x = torch.zeros(8)
    return {
        "same-tensor": {"a": x, "b": x},
        "overlapping-slices": {"a": x[:5], "b": x[3:]},
        "a-view-of-the-other": {"a": x, "b": x.view(2, 4)[1]},
        "interleaved": {"a": x[::2], "b": x[1::2]},
        "apart": {"a": torch.zeros(4), "b": torch.zeros(4)},
    }[layout]


@pytest.mark.parametrize("layout, refused", [("same-tensor", True), ("overlapping-slices", True),
                                             ("a-view-of-the-other", True), ("interleaved", False),
                                             ("apart", False)])
def test_two_saved_tensors_copied_into_shared_live_memory_are_refused_before_anything_changes(tmp_path, layout, refused):
    """One copy would overwrite the other: one entry would silently hold the other's values."""
    live = _live(layout)
    saved = {k: torch.arange(v.numel(), dtype=torch.float32).reshape(v.shape) + (10 if k == "b" else 0)
             for k, v in live.items()}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, saved)
    before = {k: v.clone() for k, v in live.items()}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        if refused:
            with pytest.raises(distckpt.IncompatibleCheckpointError, match=r"state\['a'\] and state\['b'\] share memory"):
                mgr.load_latest(live)
            assert all(torch.equal(live[k], before[k]) for k in live), "a refused load changed a tensor"
        else:
            mgr.load_latest(live)
            assert all(torch.equal(live[k], saved[k]) for k in live)


@pytest.mark.parametrize("saved_tied, live_tied, same_values, refused", [
    (True, True, True, False),     # tied as saved: the tie holds
    (False, True, False, True),    # an untied checkpoint into a tied model: refused
    (False, True, True, False),    # untied but equal: the tied weight gets exactly that value
    (True, False, True, False),    # a tied checkpoint into an untied model: each gets the value
])
def test_a_checkpoint_loaded_into_a_model_tied_otherwise_is_refused_unless_the_values_agree(
        tmp_path, saved_tied, live_tied, same_values, refused):
    torch.manual_seed(0)
    src = _TwoLinears(saved_tied)
    if not saved_tied and same_values:
        with torch.no_grad():
            src.b.weight.copy_(src.a.weight)
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"model": src})
    torch.manual_seed(1)
    dst = _TwoLinears(live_tied)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        if refused:
            with pytest.raises(distckpt.IncompatibleCheckpointError, match=r"a\.weight and .*b\.weight share memory"):
                mgr.load_latest({"model": dst})
            assert all(torch.equal(v, before[k]) for k, v in dst.state_dict().items())
        else:
            mgr.load_latest({"model": dst})
            assert all(torch.equal(v, src.state_dict()[k]) for k, v in dst.state_dict().items())
            assert (dst.a.weight is dst.b.weight) == live_tied


class _Owner:
    """A user's stateful object whose load_state_dict raises `exc` (every time, its undo too)."""

    def __init__(self, exc=None):
        self.x, self.exc = 0, exc

    def state_dict(self):
        return {"x": self.x}

    def load_state_dict(self, sd):
        if self.exc is not None:
            raise self.exc
        self.x = sd["x"]


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(3)], ids=["KeyboardInterrupt", "SystemExit"])
def test_a_base_exception_from_an_owners_load_state_dict_is_raised_after_everything_is_put_back(tmp_path, exc):
    """Entries restored before it kept the checkpoint's values (only Exceptions were undone), and
    the owner's undo raising it again stopped the other undos."""
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(2)
    opt.step()
    gen = torch.Generator().manual_seed(1)
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(0, {"opt": opt, "gen": gen, "a": _Owner(), "b": _Owner()})
    opt.step()
    torch.randn(3, generator=gen)
    momentum, stream = opt.state[p]["momentum_buffer"].clone(), gen.get_state().clone()
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(type(exc)):
            mgr.load_latest({"opt": opt, "gen": gen, "a": _Owner(), "b": _Owner(exc)})
    assert torch.equal(opt.state[p]["momentum_buffer"], momentum) and torch.equal(gen.get_state(), stream)


class _Counting(nn.Module):
    """Keeps a count in its extra state; `fail` makes set_extra_state refuse once applied."""

    def __init__(self, fail: bool = False):
        super().__init__()
        self.lin, self.seen, self.fail = nn.Linear(2, 2), 0, fail

    def get_extra_state(self):
        return {"seen": self.seen}

    def set_extra_state(self, state):
        self.seen = state["seen"]
        if self.fail:
            self.fail = False
            raise RuntimeError("refused once")


@pytest.mark.parametrize("failing", ["own", "another"])
def test_a_modules_extra_state_is_put_back_after_a_failed_load(tmp_path, failing):
    saved = _Counting()
    saved.seen = 1000
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(0, {"model": saved, "other": _Owner()})
    live = _Counting(fail=failing == "own")
    live.seen = 7
    weights = {k: v.clone() for k, v in live.state_dict().items() if isinstance(v, torch.Tensor)}
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(distckpt.IncompatibleCheckpointError):
            mgr.load_latest({"model": live, "other": _Owner(RuntimeError("no") if failing == "another" else None)})
    assert live.seen == 7
    assert all(torch.equal(live.state_dict()[k], v) for k, v in weights.items())


@pytest.mark.parametrize("source", ["numpy-copy-on-write", "numpy-read-write", "torch-load-mmap"])
def test_tensors_on_writable_mappings_still_load(tmp_path, source):
    """The read-only check looks at the mapping's permission, not at who allocated the memory:
    a model opened with torch.load(mmap=True) or an np.load(mmap_mode='c') array is loaded into."""
    import numpy as np

    with distckpt.CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        mgr.save(1, {"w": torch.arange(4.0)})
    if source == "torch-load-mmap":
        torch.save({"w": torch.zeros(4)}, tmp_path / "w.pt")
        live = torch.load(tmp_path / "w.pt", mmap=True)["w"]
    else:
        np.save(tmp_path / "w.npy", np.zeros(4, dtype=np.float32))
        live = torch.from_numpy(np.load(tmp_path / "w.npy", mmap_mode="c" if source == "numpy-copy-on-write" else "r+"))
    with distckpt.CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        mgr.load_latest({"w": live})
    assert live.tolist() == [0.0, 1.0, 2.0, 3.0]
