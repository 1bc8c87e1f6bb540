"""Ctrl-C at random instants of a training loop's checkpoint calls; run as a script.

    python tests/helpers/interrupt_storm.py MODE SECONDS SEED DIR

MODE: `overlap` (async saves with overlap_snapshot), `async`, `sync`, `load`, `own-handlers` (loads,
the program's own SIGINT and SIGTERM handlers raising in turn), `close` (an async
save in flight, close() interrupted, close() again), or `gate` (the
wait primitive alone, opened from another thread; a threading.Event in its place hangs in 3 s).
A real SIGINT (what a terminal's Ctrl-C sends) is raised a random 0-3 ms (a save or load: or
0-30 ms) into save(), wait(), the next optimizer step, or load_latest(); every CLEAN_EVERY-th
save runs uninterrupted, so that some commit however slow the machine. It runs SECONDS, and on
past them until MIN_ROUNDS rounds and MIN_INTERRUPTS interrupted calls. Checked: nothing hangs (a watchdog kills the process when a
round, or the exit, takes DEADLINE_S), an interrupted call leaves gradients on, every step that
committed holds exactly the values at its save() call, and after an interrupted load the state
is wholly the live one or wholly the checkpoint's. Prints `ok rounds=N interrupted=M` and exits
0, or raises.
"""

from __future__ import annotations

import faulthandler
import random
import signal
import sys
import threading
import time
from typing import Any, Callable

import torch
from torch import nn

import distckpt

DEADLINE_S = 60  # a round (a few calls) that takes longer is a hang
MIN_ROUNDS = 25  # on a slow machine the storm runs past SECONDS until it made these
MIN_INTERRUPTS = 12  # and until this many calls were interrupted (a busy machine interrupted 5 in
# 236 rounds of 3 s once), for at most EXTRA_S more
EXTRA_S = 90.0
CLEAN_EVERY = 8  # every 8th save runs without an interrupt: some must commit, however slow the machine
LONGER = (0.003, 0.03)  # a save or load may take longer than 3 ms: some must also finish


def main() -> None:
    mode, seconds, seed, root = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    _watch()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    storm = _Storm(random.Random(seed))
    if mode == "own-handlers":  # the program's own handlers, SIGINT and SIGTERM alike, raise
        storm.signals = (signal.SIGINT, signal.SIGTERM)
        signal.signal(signal.SIGINT, _own_handler)
        signal.signal(signal.SIGTERM, _own_handler)
    run = {"load": _loads, "own-handlers": _loads, "gate": _gate, "close": _closes}.get(mode, _saves)
    rounds = run(storm, mode, seconds, root)
    print(f"ok rounds={rounds} interrupted={storm.interrupted}", flush=True)


def _own_handler(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"the program's own {signal.Signals(signum).name} handler")


def _watch() -> None:
    """(Re)arm the watchdog: a hang, at exit too, prints every thread's stack and fails the run."""
    faulthandler.dump_traceback_later(DEADLINE_S, exit=True)


def _going(end: float, rounds: int, storm: "_Storm") -> bool:
    _watch()
    now = time.monotonic()
    return now < end or rounds < MIN_ROUNDS or (storm.interrupted < MIN_INTERRUPTS and now < end + EXTRA_S)


class _Storm:
    """Runs a call with a SIGINT raised a random instant into it.

    The instant is kept by the kernel (an interval timer's SIGALRM, whose handler raises the
    SIGINT in the main thread): a timer thread would have to wait for the GIL, so its signals
    would land mostly while the main thread blocks, and not between two bytecodes."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.interrupted = 0
        self.signals = (signal.SIGINT,)  # raised in turn
        self.armed = False  # only inside call(): a SIGALRM whose handler runs after it is dropped
        signal.signal(signal.SIGALRM, self._alarm)

    def _alarm(self, signum: int, frame: Any) -> None:
        # The timer can fire just before call() cancels it, and Python runs the handler at the
        # main thread's next bytecode, which may be the harness's own code after call() (it once
        # interrupted the creation of the next round's threading.Timer): only call() is stormed.
        if self.armed:
            signal.raise_signal(self.signals[self.interrupted % len(self.signals)])

    def call(self, fn: Callable[[], Any], within: tuple[float, ...] | None = (0.003,)) -> bool:
        """True if fn returned, False if a KeyboardInterrupt ended it (or landed just after);
        the interrupt comes up to one of `within` seconds in (None: no interrupt)."""
        try:
            try:
                self.armed = True
                if within is not None:
                    signal.setitimer(signal.ITIMER_REAL, self.rng.uniform(1e-5, self.rng.choice(within)))
                fn()
            finally:
                self.armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)
            return True
        except KeyboardInterrupt:
            self.interrupted += 1
            assert torch.is_grad_enabled(), f"an interrupted {fn} left gradients off"
            return False


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Linear(512, 512))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    try:
        _one_step(model, opt, seed)
    except KeyboardInterrupt:
        # torch's own optimizer step, interrupted between its set_grad_enabled(False) and the
        # finally that puts it back, leaves gradients off (1 in ~2,000 interrupted steps here)
        torch.set_grad_enabled(True)
        raise


def _one_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _values(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        out.update({f"opt.{i}.{k}": v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _collect(storm: _Storm, mgr: distckpt.CheckpointManager) -> None:
    """wait() until the pending save is collected (a refused one is a save error, not a hang)."""
    while True:
        try:
            if storm.call(mgr.wait):
                return
        except distckpt.DistCkptError:
            return


def _saves(storm: _Storm, mode: str, seconds: float, root: str) -> int:
    model, opt = _model()
    _train(model, opt, 0)
    mgr = distckpt.CheckpointManager(root, async_save=mode != "sync", overlap_snapshot=mode == "overlap",
                                     timeout=30, keep_last=storm.rng.choice([2, 8]))
    expected: dict[int, dict[str, torch.Tensor]] = {}
    end, step = time.monotonic() + seconds, 0
    while _going(end, step, storm):
        step += 1
        expected[step] = _values(model, opt)
        try:
            storm.call(lambda s=step: mgr.save(s, {"model": model, "optimizer": opt}),
                       None if step % CLEAN_EVERY == 0 else LONGER)
        except distckpt.DistCkptError:
            pass  # a failed save: its step must not commit with other values, checked below
        try:
            if storm.rng.random() < 0.5:
                storm.call(mgr.wait)
            else:
                storm.call(lambda s=step: _train(model, opt, s))
        except distckpt.DistCkptError:
            pass
        _collect(storm, mgr)
    mgr.close()
    _check_committed(root, expected)
    return step


def _check_committed(root: str, expected: dict[int, dict[str, torch.Tensor]]) -> None:
    with distckpt.CheckpointManager(root, keep_last=None) as reader:
        steps = reader.committed_steps()
        assert steps, "no save committed"
        for step in steps:
            model, opt = _model()
            reader.load({"model": model, "optimizer": opt}, step)
            assert _same(_values(model, opt), expected[step]), f"step {step} does not hold its save's values"


def _loads(storm: _Storm, mode: str, seconds: float, root: str) -> int:
    model, opt = _model()
    _train(model, opt, 0)
    with distckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"model": model, "optimizer": opt})
    saved = _values(model, opt)
    end, rounds = time.monotonic() + seconds, 0
    mgr = distckpt.CheckpointManager(root)
    while _going(end, rounds, storm):
        rounds += 1
        _train(model, opt, rounds)  # the live state moves away from the checkpoint
        live = _values(model, opt)
        if not storm.call(lambda: mgr.load_latest({"model": model, "optimizer": opt}), LONGER):
            now = _values(model, opt)
            assert _same(now, live) or _same(now, saved), f"round {rounds}: an interrupted load half-restored"
        mgr.load_latest({"model": model, "optimizer": opt})
        assert _same(_values(model, opt), saved), f"round {rounds}: the load after an interrupted one is wrong"
    mgr.close()
    return rounds


def _closes(storm: _Storm, mode: str, seconds: float, root: str) -> int:
    """Each round an async save (overlapped or not) in flight, then close() interrupted at a
    random instant, then close() again: the step is committed, exactly, as that close() returns."""
    model, opt = _model()
    end, step = time.monotonic() + seconds, 0
    while _going(end, step, storm):
        step += 1
        mgr = distckpt.CheckpointManager(root, async_save=True, overlap_snapshot=step % 2 == 0, keep_last=2)
        mgr.load_latest({"model": model, "optimizer": opt})  # a new job resuming the last one
        _train(model, opt, step)
        want = _values(model, opt)
        mgr.save(step, {"model": model, "optimizer": opt})
        storm.call(mgr.close, LONGER)
        while not storm.call(mgr.close, None):
            pass
        with distckpt.CheckpointManager(root) as reader:
            assert reader.committed_steps()[0] == step, f"step {step} not committed as close() returned"
            fresh_model, fresh_opt = _model()
            reader.load({"model": fresh_model, "optimizer": fresh_opt}, step)
        assert _same(_values(fresh_model, fresh_opt), want), f"step {step} does not hold its save's values"
    return step


def _gate(storm: _Storm, mode: str, seconds: float, root: str) -> int:
    from distckpt.runtime.interrupts import Gate

    gate, rounds, end = Gate(), 0, time.monotonic() + seconds
    while _going(end, rounds, storm):
        rounds += 1
        gate.close()
        threading.Timer(storm.rng.uniform(0, 0.0002), gate.open).start()
        storm.call(lambda: (gate.wait(5), gate.wait(5)), (0.0003,))
        while True:  # the opener got through: the gate opens, and a wait sees it
            try:
                assert gate.wait(5), f"round {rounds}: the gate never opened"
                break
            except KeyboardInterrupt:  # a SIGINT still on its way
                pass
    return rounds


if __name__ == "__main__":
    main()
