"""The background writer: one thread for its lifetime, jobs in order, outcomes to wait(), and
nothing left waiting in a forked child (a DataLoader worker) at its exit."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest

import distckpt
from distckpt.protocol import async_writer
from distckpt.protocol.async_writer import AsyncWriter


def test_one_thread_serves_every_job_and_hands_back_results_and_errors():
    writer = AsyncWriter()
    names = []
    for i in range(5):
        writer.submit(lambda i=i: (names.append(threading.current_thread().ident), i)[1], f"job {i}")
        assert writer.busy
        assert writer.wait() == (i, None)
        assert not writer.busy
    assert len(set(names)) == 1 and names[0] != threading.get_ident()

    def fail() -> None:
        raise OSError(28, "No space left on device")

    writer.submit(fail, "failing job")
    result, error = writer.wait()
    assert result is None and isinstance(error, OSError) and error.errno == 28
    with pytest.raises(RuntimeError, match="already in flight"):
        writer.submit(lambda: None, "a")
        writer.submit(lambda: None, "b")
    writer.wait()
    writer.close()


def test_the_thread_ends_when_the_writer_is_closed_or_dropped():
    closed = AsyncWriter()
    closed.submit(lambda: None, "x")
    closed.wait()
    closed_thread = closed._thread
    closed.close()
    dropped = AsyncWriter()
    dropped.submit(lambda: None, "y")
    dropped.wait()
    dropped_thread = dropped._thread
    del dropped
    gc.collect()
    for thread in (closed_thread, dropped_thread):
        assert thread is not None
        thread.join(10)
        assert not thread.is_alive()
    closed.submit(lambda: 7, "after close")  # a closed writer starts a thread again
    assert closed.wait() == (7, None)
    closed.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_wait_at_exit_for_the_parents_save_in_flight():
    """A DataLoader worker forked while a save is in flight has no writer thread: waiting for it
    at the worker's exit would hang the worker (and whatever reads its output) for 10 minutes."""
    gate = threading.Event()
    writer = AsyncWriter()
    writer.submit(gate.wait, "step 1")
    pid = os.fork()
    if pid == 0:  # the child: run the exit hook, report how long it took
        start = time.monotonic()
        async_writer._finish_at_exit()
        os._exit(0 if time.monotonic() - start < 5 else 1)
    _, status = os.waitpid(pid, 0)
    gate.set()
    assert writer.wait() == (True, None)
    writer.close()
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_second_ctrl_c_at_exit_says_the_save_in_flight_is_abandoned(caplog):
    writer = AsyncWriter()
    release = threading.Event()
    writer.submit(release.wait, "step 7")
    async_writer._IN_FLIGHT.add(writer)

    def interrupted():
        raise KeyboardInterrupt  # the user's second Ctrl-C while the exit hook waits

    writer.before_exit = interrupted
    try:
        with caplog.at_level("ERROR", logger="distckpt"):
            async_writer._finish_at_exit()
        assert "the background save of step 7 was abandoned and is NOT committed" in caplog.text
    finally:
        writer.before_exit = None
        release.set()
        writer.wait()
        async_writer._IN_FLIGHT.discard(writer)
        writer.close()


@pytest.mark.parametrize("options", [{"async_save": True}, {"async_save": True, "overlap_snapshot": True},
                                     {"async_save": True, "incremental": True}])
def test_no_subprocess_is_started_off_the_training_thread(tmp_path, monkeypatch, options):
    """A process started from the writer thread while a DataLoader forks its workers on the
    training thread can leave a worker holding the child's pipe: the writer then waits forever
    (platform's `uname -p` and git, collected for the manifest at the first write, did)."""
    import subprocess

    import torch

    import distckpt

    started_on = []
    real_init = subprocess.Popen.__init__

    def recording_init(self, *args, **kwargs):
        started_on.append(threading.current_thread().name)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", recording_init)
    with distckpt.CheckpointManager(str(tmp_path), **options) as mgr:
        mgr.load_latest({"w": torch.zeros(4)})
        for step in range(3):
            mgr.save(step, {"w": torch.full((4,), float(step))})
        mgr.wait()
    assert started_on and set(started_on) == {threading.main_thread().name}, started_on


def test_the_exit_line_says_what_is_known_of_the_commit():
    # It read share_outcome's message text; now the flag the error carries. A message merely
    # quoting "IS committed" (a user's exception text) no longer passes for a commit.
    from distckpt.protocol.async_writer import _commit_state_of

    def failed_telling(committed):
        error = distckpt.CoordinationError("telling every rank failed")
        error.committed = committed
        return error

    assert "IS committed" in _commit_state_of(failed_telling(True))
    assert "cannot tell" in _commit_state_of(failed_telling(None))
    assert _commit_state_of(failed_telling(False)) == "is not committed"
    assert _commit_state_of(OSError("disk says: step 3 IS committed")) == "is not committed"
