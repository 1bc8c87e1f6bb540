"""A manager looks at every thread's stack (its calls run one at a time) with the garbage
collector held off: on CPython 3.11 a collection started inside sys._current_frames() that frees
a threading.local deadlocks the process (a whole test run hung in close())."""

import gc
import sys
import types

import pytest

from distckpt import manager


@pytest.mark.parametrize("enabled", [True, False])
def test_the_threads_frames_are_taken_with_the_collector_off_and_its_state_put_back(monkeypatch, enabled):
    seen: list[bool] = []

    def current_frames() -> dict:
        seen.append(gc.isenabled())
        return sys._current_frames()

    monkeypatch.setattr(manager, "sys", types.SimpleNamespace(_current_frames=current_frames))
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        frames = manager._current_frames()
        assert gc.isenabled() is enabled  # as it was: a caller that turned it off keeps it off
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False] and len(frames) >= 1


def test_a_managers_calls_use_it(tmp_path):
    import torch

    import distckpt

    calls: list[int] = []
    real = manager._current_frames

    def counted() -> dict:
        calls.append(1)
        return real()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(manager, "_current_frames", counted)
        with distckpt.CheckpointManager(str(tmp_path / "ckpt")) as mgr:
            mgr.save(1, {"w": torch.zeros(2)})
    assert calls  # save and close looked at the threads' stacks through it
