"""Functions run on every rank by distckpt.testing.run_world (real gloo process groups)."""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import signal
import time
import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

import distckpt
from distckpt.runtime import faults


def _state(rank: int) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
            "gen": torch.Generator().manual_seed(100 + rank)}


def _draws(state: dict) -> list[float]:
    return [random.random(), float(np.random.rand()), torch.rand(1).item(),
            torch.rand(1, generator=state["gen"]).item()]


def save_and_resume(rank: int, world: int, url: str) -> dict:
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(rank)
    state = _state(rank)
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        mgr.save(5, state, epoch=1)
        expected = _draws(state)
        _draws(state)
        progress = mgr.load_latest(state)
    return {"progress": (progress.step, progress.epoch), "expected": expected, "got": _draws(state)}


def save_with_disagreement(rank: int, world: int, url: str, async_save: bool = False) -> None:
    with distckpt.CheckpointManager(url, timeout=30, async_save=async_save) as mgr:
        mgr.save(5, _state(rank), epoch=1 if rank == 0 else 2)


def one_rank_refused_at_construction(rank: int, world: int, url: str, bad_local_dir: str | None = None,
                                     bad_url: str | None = None) -> dict:
    """Rank 1's local_dir is a file (a node whose disk differs), or its URL unreachable from it: it
    raised at once while rank 0 waited for it in the group's creation for the whole timeout."""
    start = time.monotonic()
    try:
        distckpt.CheckpointManager(bad_url if rank == 1 and bad_url else url, timeout=60,
                                   local_dir=bad_local_dir if rank == 1 and bad_local_dir else f"{url}-local")
        first = "constructed"
    except distckpt.DistCkptError as e:
        first = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    with distckpt.CheckpointManager(url, timeout=60, local_dir=f"{url}-local") as mgr:
        mgr.save(5, _state(rank))
    return {"first": first, "seconds": seconds}


def mixed_settings(rank: int, world: int, url: str, setting: str, values: list) -> str:
    """Ranks building their managers with different settings; then a manager built alike works."""
    try:
        distckpt.CheckpointManager(url, timeout=30, **{setting: values[rank]})
        return "constructed"
    except distckpt.ConfigError as e:
        first = f"{type(e).__name__}: {e}"
    with distckpt.CheckpointManager(url, timeout=30, **{setting: values[0]}) as mgr:
        mgr.save(5, _state(rank))
    return first


class _RaisingStateDict:
    def state_dict(self) -> dict:
        raise ValueError("the user's own failure")

    def load_state_dict(self, state: dict) -> None:
        pass


class _UserObject:
    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def state_dict(self) -> dict:
        if self.fail:
            raise ValueError("the user's own failure")
        return {"v": 1}

    def load_state_dict(self, state: dict) -> None:
        pass


def users_state_dict_raising(rank: int, world: int, url: str, scope: str) -> dict:
    """Rank 1's own state_dict() raises, in a replicated or a per-rank entry."""
    user = _UserObject(fail=rank == 1)
    state = {"user": user if scope == "replicated" else distckpt.per_rank(user)}
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        try:
            mgr.save(5, state)
            return {"raised": None}
        except distckpt.DistCkptError as e:
            return {"raised": type(e).__name__, "message": str(e), "cause": type(e.__cause__).__name__}


def raise_during_save(rank: int, world: int, url: str, async_save: bool = False, users_error: bool = False) -> None:
    state = _state(rank)
    if rank == 1:
        state["gen"] = distckpt.per_rank(_RaisingStateDict()) if users_error else distckpt.per_rank({"bad": object()})
    with distckpt.CheckpointManager(url, timeout=30, async_save=async_save) as mgr:
        mgr.save(5, state)


def count_exchanges_of_saves(rank: int, world: int, url: str, async_save: bool = True) -> dict:
    """Which thread ran each of the manager's exchanges, per save (every save after the first)."""
    import threading

    from distckpt.protocol import coord
    seen: list[tuple[str, str]] = []
    run = coord.GlooCoordinator._run

    def counting(self, phase, fn):  # type: ignore[no-untyped-def]
        seen.append((threading.current_thread().name, phase))
        return run(self, phase, fn)

    coord.GlooCoordinator._run = counting  # type: ignore[method-assign]
    state = _state(rank)
    with distckpt.CheckpointManager(url, timeout=30, async_save=async_save, keep_last=2) as mgr:
        del seen[:]  # the manager's set-up
        for step in range(1, 7):
            mgr.save(step, state)
            if step == 4:
                mgr.wait()  # a wait() between saves exchanges nothing either
        mgr.wait()
        phases = list(seen)
        steps = mgr.committed_steps()
    return {"phases": phases, "committed": steps}


def raise_during_write(rank: int, world: int, url: str, on_rank: int = 0, async_save: bool = False) -> dict:
    """Rank `on_rank` cannot write its rank file of step 5 (each rank writes its own); then a
    save of step 6 with nothing injected. Returns what the save of step 5 raised."""
    def fail(name: str, context: dict) -> None:
        if name == "save/rank-files-written" and context["step"] == 5 and context["rank"] == on_rank:
            raise OSError(28, "No space left on device")

    faults.on_point(fail)
    out: dict = {}
    with distckpt.CheckpointManager(url, timeout=30, async_save=async_save) as mgr:
        try:
            mgr.save(5, _state(rank))
            mgr.wait()
        except distckpt.DistCkptError as e:
            out["error_type"], out["error"] = type(e).__name__, str(e)
        mgr.save(6, _state(rank))
        mgr.wait()
        out["committed"] = mgr.committed_steps()
    return out


def raise_during_load(rank: int, world: int, url: str) -> str:
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        mgr.save(5, _state(rank))
        if rank == 1:
            def fail(name: str, context: dict) -> None:
                if name == "load/read":
                    raise RuntimeError("injected read failure on rank 1")
            faults.on_point(fail)
        mgr.load_latest(_state(rank))
    return "loaded"


def die_during_save(rank: int, world: int, url: str, point: str, timeout_s: float) -> None:
    if rank == 1:
        faults.on_point(lambda name, ctx: os.kill(os.getpid(), signal.SIGKILL) if name == point else None)
    with distckpt.CheckpointManager(url, timeout=timeout_s) as mgr:
        mgr.save(5, _state(rank))


def stop_during_save(rank: int, world: int, url: str, timeout_s: float) -> None:
    if rank == 1:
        faults.on_point(lambda name, ctx: time.sleep(timeout_s + 8) if name == "save/captured" else None)
    with distckpt.CheckpointManager(url, timeout=timeout_s) as mgr:
        mgr.save(5, _state(rank))


def save_only(rank: int, world: int, url: str) -> None:
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        mgr.save(5, _state(rank), epoch=0)


def load_only(rank: int, world: int, url: str) -> tuple[int, int | None]:
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        p = mgr.load_latest(_state(rank))
    return (p.step, p.epoch)


def async_failure_everywhere(rank: int, world: int, url: str) -> str:
    def fail(name: str, context: dict) -> None:
        if name == "save/manifest-written":
            raise OSError(5, "Input/output error")

    faults.on_point(fail)
    with distckpt.CheckpointManager(url, timeout=30, async_save=True) as mgr:
        mgr.save(5, _state(rank))
        try:
            mgr.wait()
        except distckpt.AsyncSaveError as e:
            return f"AsyncSaveError: {e}"
    return "no error"


def load_replicated_only(rank: int, world: int, url: str) -> dict:
    import warnings as w

    state = _state(rank)
    with torch.no_grad():
        state["model"].weight.zero_()
    with w.catch_warnings(record=True) as caught:
        w.simplefilter("always")
        with distckpt.CheckpointManager(url, timeout=30, world_size_policy="replicated_only") as mgr:
            p = mgr.load_latest(state)
    torch.manual_seed(0)
    expected = nn.Linear(4, 2).weight
    return {"progress": (p.step, p.epoch), "weights_restored": torch.equal(state["model"].weight, expected),
            "warning": " ".join(str(c.message) for c in caught if "world_size_policy" in str(c.message))}


def split_save_and_load(rank: int, world: int, url: str, async_save: bool = False) -> dict:
    """Replicated state written by all ranks (split_writes), then loaded by a fresh manager."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 20), nn.Linear(20, 10))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 40)).sum().backward()
    opt.step()
    state = {"model": model, "optimizer": opt, "gen": torch.Generator().manual_seed(rank),
             "table": torch.arange(7.0)}
    with distckpt.CheckpointManager(url, timeout=30, split_writes=True, async_save=async_save) as mgr:
        mgr.save(3, state, epoch=0)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        if async_save:  # changed right after save() returned: must not reach the files
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
    expected_opt = [s["exp_avg"].clone() for s in opt.state.values()]
    torch.manual_seed(99)
    fresh = nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 20), nn.Linear(20, 10))
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    new_state = {"model": fresh, "optimizer": fresh_opt, "gen": torch.Generator(), "table": torch.zeros(7)}
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        progress = mgr.load_latest(new_state)
    return {"step": progress.step,
            "model_equal": all(torch.equal(v, fresh.state_dict()[k]) for k, v in expected.items()),
            "opt_equal": all(torch.equal(a, s["exp_avg"]) for a, s in zip(expected_opt, fresh_opt.state.values())),
            "table": new_state["table"].tolist()}


def exchange_objects_larger_than_a_slot(rank: int, world: int) -> dict:
    """all_gather / gather / broadcast where some objects exceed coord.SLOT_BYTES."""
    from distckpt.protocol.coord import SLOT_BYTES, GlooCoordinator

    coord = GlooCoordinator(timeout_s=30)
    mine = {"rank": rank, "blob": bytes([rank]) * (3 * SLOT_BYTES if rank == 1 else 10)}
    out = {"all_gather": [len(o["blob"]) for o in coord.all_gather(mine, "test/all-gather")]}
    gathered = coord.gather(mine, "test/gather")
    out["gather"] = None if gathered is None else [(o["rank"], o["blob"][:1], len(o["blob"])) for o in gathered]
    out["broadcast"] = len(coord.broadcast(bytes(2 * SLOT_BYTES) if rank == 0 else None, "test/broadcast"))
    out["small broadcast"] = coord.broadcast({"from": rank}, "test/small")
    coord.close()
    return out


def fail_before_sending_a_large_object(rank: int, world: int, timeout_s: float, how: str) -> None:
    """Rank 1's object needs the message after the gather; it is SIGKILLed, or stops for
    longer than the timeout, before sending it."""
    import torch.distributed as dist

    from distckpt.protocol.coord import SLOT_BYTES, GlooCoordinator

    coord = GlooCoordinator(timeout_s=timeout_s)
    if rank == 1 and how == "killed":
        dist.send = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[assignment]
    if rank == 1 and how == "stopped":
        dist.send = lambda *a, **k: time.sleep(timeout_s + 8)  # type: ignore[assignment]
    coord.gather(bytes(2 * SLOT_BYTES), "test/gather")


def overlapped_failures(rank: int, world: int, url: str, how: str) -> dict:
    """how="changed": rank 0 changes a parameter in place while its overlapped copy is held;
    how="rank1-fails": rank 1's writer fails before the gather. Returns what wait() raised."""
    import threading

    from distckpt.runtime import faults
    release = threading.Event()

    def hook(name: str, context: dict) -> None:
        if name != "save/snapshot-copy" or context["step"] != 1:
            return
        if how == "changed" and rank == 0:
            assert release.wait(30)
        if how == "rank1-fails" and rank == 1:
            raise OSError(28, "No space left on device")

    faults.on_point(hook)
    state = _state(rank)
    out: dict = {}
    with distckpt.CheckpointManager(url, timeout=30, async_save=True, overlap_snapshot=True) as mgr:
        mgr.save(0, state)
        mgr.wait()
        mgr.save(1, state)
        if how == "changed" and rank == 0:
            with torch.no_grad():
                state["model"].weight.add_(1)
        release.set()
        try:
            mgr.wait()
            out["error"] = None
        except distckpt.AsyncSaveError as e:
            out["error"] = str(e).splitlines()[0]
            out["cause"] = type(e.__cause__).__name__
        out["committed"] = mgr.committed_steps()
    return out


class RefusingModule(nn.Module):
    """A module with load logic of its own that refuses on the ranks listed in `refuse_on`."""

    refuse_on: tuple[int, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))

    def _load_from_state_dict(self, *args, **kwargs):  # noqa: ANN002, ANN003
        if int(os.environ.get("RANK", "0")) in self.refuse_on:
            raise RuntimeError("this module refuses the checkpoint")
        return super()._load_from_state_dict(*args, **kwargs)


def _modules_state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"plain": nn.Linear(3, 3), "t": torch.randn(4), "refusing": RefusingModule(), "model_eval": nn.Linear(2, 2)}


def a_module_refusing_on_one_rank_leaves_every_rank_unchanged(rank: int, world: int, url: str, refuse_on: list) -> dict:
    with distckpt.CheckpointManager(url) as mgr:
        mgr.save(1, _modules_state(0))
    live = _modules_state(1)
    live["model_eval"].eval()
    before = {k: [t.clone() for t in v.state_dict().values()] if isinstance(v, nn.Module) else v.clone()
              for k, v in live.items()}
    RefusingModule.refuse_on = tuple(refuse_on)
    error = None
    try:
        with distckpt.CheckpointManager(url) as mgr:
            mgr.load_latest(live)
    except distckpt.DistCkptError as e:
        error = type(e).__name__
    unchanged = all(
        all(torch.equal(a, b) for a, b in zip(before[k], v.state_dict().values())) if isinstance(v, nn.Module)
        else torch.equal(before[k], v) for k, v in live.items())
    return {"error": error, "unchanged": unchanged, "eval_kept": not live["model_eval"].training}


def rank_0_slower_than_the_timeout(rank: int, world: int, url: str, async_save: bool) -> dict:
    """Rank 0's writes of step 1 take longer than timeout=: the other ranks stop waiting for its
    outcome. Then: another save with the same manager, and one with a new manager."""
    import time

    from distckpt.runtime import faults
    def slow(name: str, context: dict) -> None:
        if name == "save/replicated-written" and context["step"] == 1 and rank == 0:
            time.sleep(3.5)  # past the others' 2 s wait for the outcome

    faults.on_point(slow)
    state = _state(rank)
    out: dict = {}
    mgr = distckpt.CheckpointManager(url, timeout=2, async_save=async_save)
    mgr.save(0, state)
    mgr.wait()
    for step in (1, 2):
        try:
            mgr.save(step, state)
            mgr.wait()
            out[f"save {step}"] = None
        except distckpt.DistCkptError as e:
            out[f"save {step}"] = f"{type(e).__name__}: {e}"
        time.sleep(3)  # every rank past its error, whichever rank stopped waiting first
    try:
        mgr.close()
    except distckpt.DistCkptError:
        pass
    with distckpt.CheckpointManager(url, timeout=30, async_save=async_save) as fresh:
        fresh.load_latest(_state(rank))
        fresh.save(3, state)
        fresh.wait()
        out["committed"] = fresh.committed_steps()
    return out


def rank_0_writer_stuck(rank: int, world: int, url: str) -> dict:
    """Rank 0's background write of step 1 hangs in storage (until the end of this function):
    rank 0's wait for it is bounded (timeout + min(timeout, 60 s) after the save), not forever."""
    import threading
    import time

    from distckpt.runtime import faults
    release = threading.Event()

    def hang(name: str, context: dict) -> None:
        if name == "save/replicated-written" and context["step"] == 1 and rank == 0:
            release.wait(120)

    faults.on_point(hang)
    state = _state(rank)
    out: dict = {}
    mgr = distckpt.CheckpointManager(url, timeout=2, async_save=True)
    mgr.save(0, state)
    mgr.wait()
    mgr.save(1, state)
    started = time.monotonic()
    try:
        mgr.wait()
        out["wait"] = None
    except distckpt.DistCkptError as e:
        out["wait"] = f"{type(e).__name__}: {e}"
    out["waited_s"] = time.monotonic() - started
    time.sleep(1)  # every rank past its error
    try:
        mgr.save(2, state)
        out["save 2"] = None
    except distckpt.DistCkptError as e:
        out["save 2"] = f"{type(e).__name__}: {e}"
    try:
        mgr.close()
        out["close"] = None
    except distckpt.DistCkptError as e:
        out["close"] = f"{type(e).__name__}: {e}"
    release.set()
    return out


class _InterruptOnce:
    """A state_dict owner whose state_dict() raises `exc` once, on `rank`, at the second save."""

    def __init__(self, rank: int, on_rank: int, exc: type[BaseException]) -> None:
        self.calls, self.rank, self.on_rank, self.exc = 0, rank, on_rank, exc

    def state_dict(self) -> dict:
        self.calls += 1
        if self.calls == 2 and self.rank == self.on_rank:
            raise self.exc()
        return {"n": 1}

    def load_state_dict(self, state: dict) -> None:
        pass


def interrupted_in_capture_on_one_rank(rank: int, world: int, url: str, exc_name: str, async_save: bool) -> dict:
    """Rank 1's state_dict() raises KeyboardInterrupt / SystemExit at save(1); every rank catches
    what its save raised and saves step 1 again."""
    import time

    exc = {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}[exc_name]
    state = {**_state(rank), "owner": _InterruptOnce(rank, 1, exc)}
    out: dict = {}
    mgr = distckpt.CheckpointManager(url, timeout=20, async_save=async_save)
    mgr.save(0, state)
    started = time.monotonic()
    try:
        mgr.save(1, state)
        mgr.wait()
        out["first"] = None
    except BaseException as e:  # noqa: B036 - what each rank got is the point
        out["first"] = f"{type(e).__name__}: {e}"
    out["first_s"] = time.monotonic() - started
    started = time.monotonic()
    mgr.save(1, state)
    mgr.wait()
    out["retry_s"] = time.monotonic() - started
    out["committed"] = mgr.committed_steps()
    mgr.close()
    return out


_T = torch.zeros(2)


def replicated_values_by_rank(rank: int, world: int, url: str, case: str, async_save: bool = False) -> dict:
    """Each rank saves the `case` pair's value for its rank in a replicated entry (rank 0 the
    first, the others the second), then, if the save went through, loads it back."""
    pairs = {
        "float": (4.0, 4.5), "negative-zero": (0.0, -0.0), "nan-payload": (float("nan"), -float("nan")),
        "big-int": (2**80, 2**80 + 1), "str": ("a", "b"), "list-length": ([1], [1, 1]),
        "tuple-vs-list": ((1,), [1]), "int-vs-float": (1, 1.0), "dict-value": ({"a": 1, "b": 2}, {"b": 2, "a": 3}),
        "tensor-bits": (torch.tensor([0.0]), torch.tensor([-0.0])), "tensor-dtype": (torch.zeros(2), torch.zeros(2, dtype=torch.float64)),
        "nested-tensor": ({"h": [torch.ones(3)]}, {"h": [torch.ones(3) * 2]}), "numpy": (np.float32(1), np.float64(1)),
        "requires-grad": ([torch.zeros(2, requires_grad=True)], [torch.zeros(2)]),
        "parameter": ([nn.Parameter(torch.zeros(2))], [torch.zeros(2)]),
        "tie": ([_T, _T], [_T, _T.clone()]),
        "dim-order": (torch.zeros(2, 3), torch.zeros(3, 2).t()),
        "equal": ({"best": 1.5, "t": torch.arange(4)}, {"best": 1.5, "t": torch.arange(4)}),
        "equal-in-another-order": ({"a": 1, "b": [2], "t": _T, "u": torch.ones(2), "w": _T},
                                   {"w": _T, "u": torch.ones(2), "t": _T, "b": [2], "a": 1}),
        "ordered-dict-order": (collections.OrderedDict(a=1, b=2), collections.OrderedDict(b=2, a=1)),
    }
    stateful = {"stateful-ema": lambda r: _LossEma(1.0 + r),  # each rank's own loss: differs
                "stateful-plateau": lambda r: _plateau(1.0 + r),
                "equal-stateful": lambda r: _plateau(1.0)}
    if case in stateful:
        mine: Any = stateful[case](rank)
    else:
        mine = pairs[case][0 if rank == 0 else 1]
    state = {"v": mine, "own": distckpt.per_rank({"rank": rank, "loss": 1.0 + rank})}
    with distckpt.CheckpointManager(url, async_save=async_save) as mgr:
        mgr.load_latest(state)
        mgr.save(1, state)
    back = {"v": stateful[case](0) if case in stateful else None, "own": distckpt.per_rank({})}
    with distckpt.CheckpointManager(url) as mgr:
        mgr.load_latest(back)
    return {"own": back["own"].obj}


def entries_on_some_ranks(rank: int, world: int, url: str, case: str) -> dict:
    """Rank 1 saves an entry rank 0 does not (or of another kind); the save must be refused on
    every rank with nothing committed, and the ranks' next agreed save must go through."""
    state: dict = {"w": torch.ones(2)}
    if rank == 1:
        state["extra"] = {"per-rank": distckpt.per_rank({"r": rank}), "module": nn.Linear(2, 2),
                          "generator": torch.Generator(), "value": 3, "kind": nn.Linear(2, 2)}[case]
    elif case == "kind":
        state["extra"] = torch.zeros(1)
    with distckpt.CheckpointManager(url, timeout=60) as mgr:
        mgr.load_latest({"w": torch.ones(2)})
        try:
            mgr.save(1, state)
            outcome = "saved"
        except distckpt.DistCkptError as e:
            outcome = f"{type(e).__name__}: {e}"
        mgr.save(2, {"w": torch.ones(2)})
        return {"outcome": outcome, "committed": sorted(mgr.committed_steps())}


def unstorable_replicated_entry(rank: int, world: int, url: str) -> dict:
    """Every rank holds the same unstorable replicated value (a function in the config)."""
    state = {"w": torch.ones(2), "config": {"schedule": len}}
    with distckpt.CheckpointManager(url, timeout=60) as mgr:
        mgr.load_latest({"w": torch.ones(2)})
        try:
            mgr.save(1, state)
            return {"outcome": "saved"}
        except distckpt.DistCkptError as e:
            return {"outcome": f"{type(e).__name__}: {e}"}


class _LossEma:
    """A user's object with state_dict: an EMA of the loss each rank sees (its own)."""

    def __init__(self, value: float) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def _plateau(loss: float) -> Any:
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))
    scheduler.step(loss)  # stepped on a loss that is not all-reduced: `best` is each rank's own
    return scheduler


def interrupted_inside_an_exchange(rank: int, world: int, url: str) -> dict:
    """Rank 0 gets a KeyboardInterrupt inside load_latest()'s exchange, catches it and goes on to
    save(); rank 1 is still in load_latest(). Returns what each call raised."""
    import torch

    import distckpt
    from distckpt.protocol.coord import GlooCoordinator

    state = {"t": torch.arange(4.0)}
    out: dict = {}
    with distckpt.CheckpointManager(url, timeout=6) as mgr:
        mgr.save(1, state)
        if rank == 0:
            broadcast = GlooCoordinator._broadcast_object

            def interrupted(self, obj):  # a Ctrl-C landing as this rank enters the broadcast
                GlooCoordinator._broadcast_object = broadcast  # type: ignore[method-assign]
                raise KeyboardInterrupt

            GlooCoordinator._broadcast_object = interrupted  # type: ignore[method-assign]
        for call in ("load_latest", "save"):
            try:
                if call == "load_latest":
                    mgr.load_latest(state)
                else:
                    mgr.save(2, state)
                out[call] = None
            except BaseException as e:  # noqa: BLE001  (the test compares the types)
                out[call] = type(e).__name__
                out[f"{call} says"] = str(e)
            if rank == 1:
                break  # rank 1 goes on only after its load
        try:
            mgr.close()
        except BaseException as e:  # noqa: BLE001
            out["close"] = type(e).__name__
    return out


def metric_on_rank_0_only(rank: int, world: int, url: str, async_save: bool) -> dict:
    """A job that evaluates on rank 0 only: the others pass None. keep_best keeps by rank 0's values."""
    state = _state(rank)
    with distckpt.CheckpointManager(url, timeout=30, keep_last=1, keep_best=1, best_mode="min",
                                    async_save=async_save) as mgr:
        for step, loss in enumerate([3.0, 1.0, 2.0, 4.0]):
            mgr.save(step, state, metric=loss if rank == 0 else None)
        mgr.wait()
        kept = mgr.committed_steps()
        progress = mgr.load(state, 1)
    return {"kept": kept, "metric": progress.metric}


def split_view_load(rank: int, world: int, url: str) -> str:
    """Rank 1 cannot see the markers rank 0 reads (a local path not shared by the nodes)."""
    from distckpt.errors import MissingFileError
    from distckpt.protocol import loading

    state = _state(rank)
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        if rank == 1:
            def invisible(storage, step):
                raise MissingFileError(2, f"{storage.url}/step {step}/COMMITTED does not exist")
            loading.read_marker = invisible
        try:
            mgr.load_latest(_state(rank))
        except distckpt.DistCkptError as e:
            return f"{type(e).__name__}: {e}"
    return "loaded"


def race_reader(rank: int, world: int, url: str, loads: int) -> dict:
    """A 2-rank reader job loading in a loop while another process saves with keep_last=1 (a
    count of loads, not a time: the ranks' clocks would end their loops apart)."""
    out: dict = {"loads": 0, "none": 0, "errors": [], "steps": []}
    for _ in range(loads):
        target = {"w": torch.zeros(4), "big": torch.zeros(200_000)}
        with distckpt.CheckpointManager(url, timeout=30, world_size_policy="reshard") as mgr:  # written by 1 rank
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", distckpt.CheckpointFallbackWarning)
                    progress = mgr.load_latest(target)
            except distckpt.DistCkptError as e:
                out["errors"].append(f"{type(e).__name__}: {str(e)[:400]}")
                continue
        out["loads"] += 1
        if progress is None:
            out["none"] += 1
            continue
        value = float(target["w"][0])
        assert value == progress.step and bool((target["big"] == value).all()), (value, progress.step)
        out["steps"].append(progress.step)
    return out


def load_with_future_warnings_as_errors(rank: int, world: int, url: str) -> str:
    """A bare module in `state`, its DDP wrapper kept elsewhere (the warm-up finds it among all
    objects), under -W error::FutureWarning as CI runs often are."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ddp = nn.parallel.DistributedDataParallel(model)
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        mgr.save(1, {"model": model})
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            mgr.load_latest({"model": model})
    ddp(torch.ones(2, 4)).sum().backward()
    return "ok"


def load_different_steps(rank: int, world: int, url: str, asks: list) -> None:
    """Steps 1 and 2 committed; then each rank asks for its own load (None: load_latest)."""
    state = _state(rank)
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        mgr.load_latest(state) if asks[rank] is None else mgr.load(state, asks[rank])


def split_writes_round_trip_generated_trees(rank: int, world: int, url: str, examples: int) -> dict:
    """Generated trees (the round-trip property's) saved with split writes come back identical:
    values, dtypes, layouts, Parameters, requires_grad, ties. Every rank draws the same trees
    (derandomized), as a replicated value must be."""
    from hypothesis import HealthCheck, given, settings

    from tests.unit.test_roundtrip_property import _tensors_in, assert_identical, trees

    count = [0]

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(value=trees)
    def check(value: Any) -> None:
        count[0] += 1
        root = os.path.join(url, f"example-{count[0]}")
        with distckpt.CheckpointManager(root, timeout=30, split_writes=True) as mgr:
            mgr.save(0, {"r": {"x": value}, "tied": {"again": value}})
        back: dict = {"r": {}, "tied": {}}
        with distckpt.CheckpointManager(root, timeout=30) as mgr:
            mgr.load(back, 0)
        assert_identical(value, back["r"]["x"])
        assert_identical(value, back["tied"]["again"])
        held = {id(t) for t in _tensors_in(back["r"]["x"], [])}
        assert all(id(t) in held for t in _tensors_in(back["tied"]["again"], []))  # one object per stored tensor

    check()
    return {"examples": count[0]}


def an_argument_refused_on_one_rank(rank: int, world: int, url: str, how: str, async_save: bool) -> dict:
    """Rank 1 alone passes a bad argument, twice (it stays alive and tries again), then every rank
    saves normally: the same ConfigError on every rank at once, never a hang, and nothing
    left out of step for the next save. `metric` is rank 0's: anything elsewhere is accepted."""
    out: list = []
    with distckpt.CheckpointManager(url, timeout=20, async_save=async_save) as mgr:
        mgr.load_latest({"x": {}})
        mgr.save(1, {"x": {"a": torch.ones(2)}})
        for attempt in range(2):
            started = time.monotonic()
            try:
                if how == "epoch":
                    mgr.save(2, {"x": {"a": torch.ones(2)}}, epoch=-1 if rank == 1 else 0)
                elif how == "metric":
                    mgr.save(2 + attempt, {"x": {"a": torch.ones(2)}}, metric=0.5 if rank == 0 else "n/a")
                elif how == "load":
                    mgr.load({"x": {}}, step=-3 if rank == 1 else 1)
                elif how == "state_save":  # a state with a non-str key, on rank 1 only
                    mgr.save(2, {"x": {"a": torch.ones(2)}, **({3: 1} if rank == 1 else {})})
                else:
                    mgr.load_latest({"x": {}, **({3: 1} if rank == 1 else {})})
                out.append(("ok", 0.0, ""))
            except distckpt.DistCkptError as e:
                out.append((type(e).__name__, time.monotonic() - started, str(e)))
        mgr.save(5, {"x": {"a": torch.full((2,), 5.0)}})
        mgr.wait()
        steps = mgr.committed_steps()
    return {"outcomes": out, "steps": steps}


def ranks_in_different_calls(rank: int, world: int, url: str, saver: int) -> dict:
    """Rank `saver` calls save while the others call load_latest (a collective-order mistake),
    then every rank loads: the same RankDisagreementError on every rank, then a normal load."""
    state = {"w": torch.zeros(3)}
    out: dict = {}
    with distckpt.CheckpointManager(url, timeout=20) as mgr:
        mgr.load_latest(state)
        mgr.save(1, state)
        started = time.monotonic()
        try:
            if rank == saver:
                mgr.save(2, {"w": torch.ones(3)})
            else:
                mgr.load_latest(state)
            out["first"] = "ok"
        except distckpt.DistCkptError as e:
            out["first"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.monotonic() - started
        out["then"] = mgr.load_latest(state).step
        started = time.monotonic()
        mgr.save(3, {"w": torch.full((3,), 3.0)})  # the ranks' save counts differ from here on
        out["save seconds"] = time.monotonic() - started
        out["steps"] = sorted(mgr.committed_steps())
    return out


def save_steps_1_and_5(rank: int, world: int, url: str) -> None:
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        mgr.load_latest(_state(rank))
        state = _state(rank)
        mgr.save(1, {**state, "mine": distckpt.per_rank({"n": 1})}, epoch=0)
        mgr.save(5, {**state, "mine": distckpt.per_rank({"n": 5})}, epoch=0)


def load_mine_with_warnings(rank: int, world: int, url: str) -> dict:
    state = {**_state(rank), "mine": distckpt.per_rank({})}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distckpt.CheckpointManager(url, timeout=30) as mgr:
            p = mgr.load_latest(state)
    return {"step": p.step, "mine": state["mine"].obj,
            "warned": [str(w.message) for w in caught if issubclass(w.category, distckpt.CheckpointFallbackWarning)]}


def a_rank_reaching_the_manager_late(rank: int, world: int, url: str, manager_timeout: float) -> str:
    if rank == 0:
        time.sleep(2 * manager_timeout)
    try:
        distckpt.CheckpointManager(url, timeout=manager_timeout).close()
        return "constructed"
    except distckpt.DistCkptError as e:
        return f"{type(e).__name__}: {e}"


def a_rank_loading_into_a_state_without_an_entry(rank: int, world: int, url: str) -> dict:
    """Rank 1's state lacks the scheduler the checkpoint holds: it went on with its own, warned on
    rank 1 only. Now every rank refuses, nothing changed, and a load with equal states works."""
    def fresh() -> dict:
        state = _state(rank)
        state["sched"] = torch.optim.lr_scheduler.StepLR(state["optimizer"], step_size=1)
        return state

    with distckpt.CheckpointManager(url, timeout=20) as mgr:
        mgr.load_latest(fresh())
        saved = fresh()
        saved["sched"].step()
        mgr.save(1, saved)
    state = fresh()
    if rank == 1:
        del state["sched"]
    before = state["model"].weight.detach().clone()
    with distckpt.CheckpointManager(url, timeout=20) as mgr:
        try:
            mgr.load_latest(state)
            first = "loaded"
        except distckpt.DistCkptError as e:
            first = f"{type(e).__name__}: {e}"
        unchanged = torch.equal(state["model"].weight, before)
        again = mgr.load_latest(fresh()).step
    return {"first": first, "unchanged": unchanged, "again": again}


class _NoisyNet(nn.Module):
    """A forward that draws from every stream (a diffusion model's noise, dropout) and moves
    batch-norm statistics, called with a keyword argument as Hugging Face-style models are."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, *, x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(4, generator=self.gen) + torch.rand(()) + random.random() + float(np.random.rand())
        return self.drop(self.bn(self.fc(x + noise)))


def one_step_with_and_without_the_warmup(rank: int, world: int, url: str, wrap_after_load: bool) -> str:
    """The first training step of a DDP model with distckpt's warm-up installed (by a load on a
    fresh root) draws the same numbers, leaves the same statistics and gradients as without."""
    def step(with_manager: bool) -> dict:
        torch.manual_seed(0), random.seed(rank), np.random.seed(rank)
        bare = _NoisyNet()
        ddp = None if wrap_after_load else nn.parallel.DistributedDataParallel(bare)
        if with_manager:
            with distckpt.CheckpointManager(os.path.join(url, f"wrap-{wrap_after_load}"), timeout=30) as mgr:
                assert mgr.load_latest({"model": bare if wrap_after_load else ddp}) is None
        ddp = ddp or nn.parallel.DistributedDataParallel(bare)
        ddp(x=torch.ones(3, 4) * (rank + 1)).sum().backward()
        return {"after": (torch.rand(()).item(), random.random(), float(np.random.rand()),
                          torch.randn((), generator=bare.gen).item()),
                "buffers": [b.clone() for b in bare.buffers()], "grads": [p.grad.clone() for p in bare.parameters()],
                "warmed": getattr(ddp, "_distckpt_bucket_warmup", None) == "done"}

    plain, warmed = step(False), step(True)
    assert warmed["warmed"] and not plain["warmed"]
    assert plain["after"] == warmed["after"], (plain["after"], warmed["after"])
    assert all(torch.equal(a, b) for a, b in zip(plain["buffers"], warmed["buffers"]))
    assert all(torch.equal(a, b) for a, b in zip(plain["grads"], warmed["grads"]))
    return "ok"


def the_wrapper_watch_ends_at_the_first_optimizer_step(rank: int, world: int, url: str) -> dict:
    """A module in `state` that no DDP runs (an EMA copy): the global hook watching for a wrapper
    goes at the first optimizer step, not at the end of the run."""
    from torch.nn.modules import module as torch_module
    from torch.optim import optimizer as torch_optimizer

    net, ema = nn.Linear(2, 2), nn.Linear(2, 2)
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    hooks = (len(torch_module._global_forward_pre_hooks), len(torch_optimizer._global_optimizer_pre_hooks))
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        mgr.load_latest({"model": ddp, "ema": ema, "optimizer": opt})
    watching = (len(torch_module._global_forward_pre_hooks), len(torch_optimizer._global_optimizer_pre_hooks))
    ddp(torch.ones(1, 2)).sum().backward()
    opt.step()
    after = (len(torch_module._global_forward_pre_hooks), len(torch_optimizer._global_optimizer_pre_hooks))
    return {"before": hooks, "watching": watching, "after": after, "ema_hooks": len(ema._forward_pre_hooks)}


@dataclasses.dataclass
class _Output:
    loss: torch.Tensor
    logits: torch.Tensor


class _DataclassNet(nn.Module):
    """A forward returning a dataclass (not a dict, tuple or ModelOutput)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> _Output:
        logits = self.fc(x)
        return _Output(loss=logits.pow(2).mean(), logits=logits)


def the_warmup_backward_reaches_a_dataclass_output(rank: int, world: int, url: str) -> dict:
    """The warm-up back-propagates through the tensors of a dataclass output (it found none, so
    DDP's buckets were not rebuilt: a 4-rank resume drifted from its first step)."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(_DataclassNet())
    passes: list[int] = []
    model.module.fc.weight.register_hook(lambda g: passes.append(1))
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        mgr.load_latest({"model": model})
    model(torch.ones(3, 4)).loss.backward()
    return {"backward_passes": len(passes)}


def _native_threads() -> int:
    """Threads of this process that Python did not start (gloo's, torch's)."""
    import threading

    return len(os.listdir("/proc/self/task")) - len(threading.enumerate())


def native_threads_around_a_manager(rank: int, world: int, url: str, async_save: bool) -> dict:
    """Native thread counts before a manager, while it is open and after its close(): a group
    whose gloo threads outlive close() can abort the process at exit (see GlooCoordinator.close)."""
    before = _native_threads()
    mgr = distckpt.CheckpointManager(url, timeout=30, async_save=async_save)
    for step in range(3):
        mgr.save(step, _state(rank))
    mgr.wait()
    during = _native_threads()
    mgr.close()
    return {"before": before, "during": during, "after": _native_threads()}


def per_rank_kinds_differ(rank: int, world: int, url: str) -> dict:
    """nanoGPT's best_val_loss as README "Plain loop variables" says: per_rank, a float on every
    rank until rank 0's evaluation makes it a 0-d tensor there."""
    best = torch.tensor(0.5) if rank == 0 else 1e9
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        mgr.save(0, {"iter_num": 1, "best": distckpt.per_rank(best)})
    fresh = {"iter_num": 0, "best": distckpt.per_rank(1e9)}
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        step = mgr.load_latest(fresh).step
        mgr.save(1, fresh)  # and saved again from what was restored
    back = fresh["best"].obj
    return {"step": step, "back": back.item() if isinstance(back, torch.Tensor) else back,
            "is_tensor": isinstance(back, torch.Tensor)}


def save_rank_own_batchnorm(rank: int, world: int, url: str) -> None:
    """A BatchNorm whose running statistics differ per rank (each updates its own, as under FSDP2
    or DDP with broadcast_buffers=False)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with torch.no_grad():
        net[1].running_mean.fill_(float(rank + 1))
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        mgr.save(3, {"model": net})


def modules_trained_by_rank(rank: int, world: int, url: str, case: str, async_save: bool = False) -> dict:
    """A model with BatchNorm trained one step on each rank's own batch: bare (each rank its own
    weights), wrapped in DDP (equal weights; BatchNorm statistics still each rank's), a bare model
    in per_rank, or one never trained. Returns the save's outcome and the steps committed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    trained: nn.Module = nn.parallel.DistributedDataParallel(model) if case == "ddp" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if case != "untrained":
        torch.manual_seed(100 + rank)  # each rank's own batch
        trained(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
    entry = distckpt.per_rank(model) if case == "per-rank" else model
    state = {"model": entry, "opt": distckpt.per_rank(opt) if case == "per-rank" else opt}
    with distckpt.CheckpointManager(url, async_save=async_save) as mgr:
        mgr.load_latest(state)
        try:
            mgr.save(1, state)
            mgr.wait()
            outcome = "committed"
        except distckpt.DistCkptError as e:
            outcome = f"{type(e).__name__}: {e}"
        return {"outcome": outcome, "committed": mgr.committed_steps()}


def zero_optimizer_resume(rank: int, world: int, url: str, consolidate: str, async_save: bool) -> dict:
    """A DDP model with a ZeroRedundancyOptimizer: 8 steps uninterrupted, then 8 steps where step 4
    is saved (after the loop's own consolidation at step 2, at step 4, or none) and fresh objects
    resume from it. Returns both runs' losses as hex."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    def built():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        ddp = DistributedDataParallel(model)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)

    def step_of(ddp, opt, step):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        opt.zero_grad()
        loss = ((ddp(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return float(loss).hex()

    ddp, opt = built()
    reference = [step_of(ddp, opt, s) for s in range(8)]
    ddp, opt = built()
    resumed = []
    with distckpt.CheckpointManager(url, timeout=60, async_save=async_save) as mgr:
        for s in range(5):
            resumed.append(step_of(ddp, opt, s))
            if consolidate == "stale" and s == 2:
                opt.consolidate_state_dict(to=0)
            if consolidate == "fresh" and s == 4:
                opt.consolidate_state_dict(to=0)
        mgr.save(4, {"model": ddp, "optimizer": opt})
    ddp, opt = built()
    with distckpt.CheckpointManager(url, timeout=60) as mgr:
        assert mgr.load_latest({"model": ddp, "optimizer": opt}).step == 4
    resumed += [step_of(ddp, opt, s) for s in range(5, 8)]
    return {"reference": reference, "resumed": resumed}


def zero_optimizer_per_rank(rank: int, world: int, url: str) -> str:
    """A ZeroRedundancyOptimizer put in per_rank(...): refused at save, on every rank."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = nn.Linear(4, 2)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    with distckpt.CheckpointManager(url, timeout=60) as mgr:
        try:
            mgr.save(0, {"model": model, "optimizer": distckpt.per_rank(opt)})
        except distckpt.DistCkptError as e:
            return f"{type(e).__name__}: {e}"
        return "saved"
