"""The collector is held off during saves and loads, and always put back as it was found."""

from __future__ import annotations

import faulthandler
import gc
import os
import random
import signal
import threading
import time

import pytest
import torch

import distckpt
from distckpt.runtime import gcpause
from distckpt.runtime.gcpause import collector_paused


@pytest.fixture(autouse=True)
def _collector_restored():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("enabled", [True, False])
def test_a_pause_puts_the_collector_back_as_it_found_it_also_after_an_error(enabled):
    (gc.enable if enabled else gc.disable)()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled() is enabled
    with pytest.raises(RuntimeError):
        with collector_paused():
            raise RuntimeError("boom")
    assert gc.isenabled() is enabled


def test_nested_and_overlapping_pauses_on_two_threads_end_with_the_last_one():
    gc.enable()
    inside, leave = threading.Event(), threading.Event()

    def writer() -> None:
        with collector_paused():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=writer)
    thread.start()
    assert inside.wait(10)
    with collector_paused():
        with collector_paused():
            assert not gc.isenabled()
    assert not gc.isenabled(), "the other thread's pause still holds"
    leave.set()
    thread.join(10)
    assert gc.isenabled()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_child_forked_during_a_pause_has_the_collector_back():
    gc.enable()
    with collector_paused():
        pid = os.fork()
        if pid == 0:
            ok = gc.isenabled()
            with collector_paused():  # and its own pauses work from zero
                ok = ok and not gc.isenabled()
            os._exit(0 if ok and gc.isenabled() else 1)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("enabled", [True, False])
def test_saves_and_loads_leave_the_collector_as_found_whether_they_succeed_or_fail(tmp_path, async_save, enabled):
    (gc.enable if enabled else gc.disable)()
    state = {"w": torch.arange(8.0), "model": torch.nn.Linear(3, 2)}
    with distckpt.CheckpointManager(tmp_path / "ckpt", async_save=async_save) as mgr:
        mgr.save(1, state)
        mgr.wait()
        assert gc.isenabled() is enabled
        with pytest.raises(distckpt.CheckpointExistsError):
            mgr.save(1, state)
        with pytest.raises(distckpt.UnstorableValueError):
            mgr.save(2, {"bad": object()})
        assert gc.isenabled() is enabled
        fresh = {"w": torch.zeros(8), "model": torch.nn.Linear(3, 2)}
        assert mgr.load_latest(fresh).step == 1
        assert torch.equal(fresh["w"], state["w"])
        assert gc.isenabled() is enabled
        with pytest.raises(distckpt.DistCkptError):
            mgr.load_latest({"w": torch.zeros(9), "model": torch.nn.Linear(3, 2)})  # wrong shape: refused
        assert gc.isenabled() is enabled
    assert gc.isenabled() is enabled


class _Recording(torch.nn.Linear):
    """Notes whether the collector was on while its state was captured and restored."""

    def __init__(self) -> None:
        super().__init__(3, 2)
        self.seen: list[tuple[str, bool]] = []

    def state_dict(self, *args, **kwargs):  # type: ignore[override]
        self.seen.append(("capture", gc.isenabled()))
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):  # type: ignore[override]
        self.seen.append(("restore", gc.isenabled()))
        return super().load_state_dict(*args, **kwargs)


def test_the_collector_is_off_while_a_save_captures_and_a_load_restores(tmp_path):
    gc.enable()
    model = _Recording()
    with distckpt.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"model": model})
        mgr.load_latest({"model": model})
    assert model.seen and ("capture", False) in model.seen and ("restore", False) in model.seen, model.seen
    assert all(not enabled for _, enabled in model.seen), model.seen
    assert gc.isenabled()


def test_an_async_saves_background_write_leaves_the_collector_on_for_the_training_loop(tmp_path):
    """The switch is the whole process's: a write in flight must not hold it off for the steps
    the loop runs meanwhile."""
    from distckpt.runtime import faults
    gc.enable()
    in_write, release, seen = threading.Event(), threading.Event(), []

    def hold(name, context):
        if name == "save/snapshot-copy":
            in_write.set()
            release.wait(10)

    unregister = faults.on_point(hold)
    try:
        with distckpt.CheckpointManager(tmp_path / "ckpt", async_save=True) as mgr:
            mgr.save(1, {"w": torch.arange(4.0)})
            assert in_write.wait(10)
            seen.append(gc.isenabled())  # the training thread, while the write is held
            release.set()
            mgr.wait()
    finally:
        release.set()
        unregister()
    assert seen == [True]


def test_the_decorated_weights_functions_run_paused_and_keep_their_signature():
    from distckpt.runtime.gcpause import paused_while_running

    gc.enable()

    @paused_while_running
    def probe(x: int, *, fail: bool = False) -> bool:
        """doc"""
        if fail:
            raise ValueError("x")
        return gc.isenabled()

    assert probe(1) is False and gc.isenabled()
    with pytest.raises(ValueError):
        probe(1, fail=True)
    assert gc.isenabled() and probe.__doc__ == "doc"
    assert distckpt.load_weights.__name__ == "load_weights" and distckpt.export_weights.__name__ == "export_weights"


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs setitimer")
@pytest.mark.timeout(300, method="thread")  # SIGALRM is this test's: pytest-timeout's own alarm would be clobbered
def test_ctrl_c_at_any_instant_of_a_pause_leaves_the_collector_on_by_the_next_pause_at_the_latest():
    """A KeyboardInterrupt can land between any two bytecodes of the pause's entry and exit.
    Whatever it hits, the collector is on again once the next uninterrupted pause ends (a pause
    whose exit was cut short stops counting when its frame goes)."""
    gc.enable()
    armed = [False]

    def interrupt(signum, frame):
        if armed[0]:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    interrupts, wrong_after_next = 0, 0
    signal.setitimer(signal.ITIMER_REAL, 0.00005, 0.00003)
    try:
        deadline = time.monotonic() + float(os.environ.get("DISTCKPT_GC_STRESS_S", "3"))
        while time.monotonic() < deadline:
            cut = False
            try:
                armed[0] = True
                with collector_paused():
                    pass
                armed[0] = False
            except KeyboardInterrupt:
                armed[0] = False
                cut = True
            if cut:  # out of the except clause: the interrupt's traceback (and the cut pause) is gone
                interrupts += 1
                with collector_paused():  # the next pause, not interrupted
                    pass
                if not gc.isenabled() or len(gcpause._holders):
                    wrong_after_next += 1
                    gc.enable()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert interrupts > 100, interrupts  # the windows were really shot at
    assert wrong_after_next == 0, f"{wrong_after_next} of {interrupts} interrupts left the collector off"
    assert gc.isenabled() and len(gcpause._holders) == 0


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs setitimer")
@pytest.mark.timeout(300, method="thread")  # SIGALRM is this test's: pytest-timeout's own alarm would be clobbered
def test_ctrl_c_during_the_wait_for_a_background_save_never_hangs_the_next_wait():
    """An interrupt inside wait() leaves the job pending; the next wait() collects it. (With a
    threading.Event, an interrupt inside Event.wait() could leave its lock held: both hung.)"""
    from distckpt.protocol.async_writer import AsyncWriter

    armed = [False]

    def interrupt(signum, frame):
        if armed[0]:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    faulthandler.dump_traceback_later(60, exit=True)  # a hang ends the run loudly, with the stacks
    writer = AsyncWriter()
    rng = random.Random(7)
    interrupted, jobs = 0, 0
    deadline = time.monotonic() + float(os.environ.get("DISTCKPT_GC_STRESS_S", "3"))
    try:
        while time.monotonic() < deadline:
            jobs += 1
            writer.submit(lambda n=jobs: n, f"job {jobs}")
            time.sleep(rng.uniform(0, 0.002))  # often already done: wait() goes straight for the end signal
            try:
                armed[0] = True
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.000005, 0.0003))
                writer.wait()
                time.sleep(0.0004)
            except KeyboardInterrupt:
                interrupted += 1
            finally:
                armed[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
            result, error = writer.wait()  # collected here if the interrupt cut the first one short
            assert error is None and result in (None, jobs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        faulthandler.cancel_dump_traceback_later()
        writer.close()
    assert interrupted > 10, interrupted
