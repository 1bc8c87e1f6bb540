"""A process that used an object store exits 0: nothing distckpt or its clients leave running
aborts the interpreter's finalization ("terminate called without an active exception", exit
134: fsspec's IO thread freeing a finished request that held a tensor's view while the
interpreter finalized; storage/clients.py stops that loop at exit)."""

import os
import subprocess
import sys

import fsspec.asyn
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def test_a_pytest_process_that_saved_to_s3_with_both_writers_exits_0(s3_server):
    # The case that aborted at every exit before the fix (a pytest process: finalization's
    # collection is long enough for the loop's timers to run into it); a fresh process of its own.
    case = "tests/protocol/test_writer_process.py::test_round_trip_on_s3_matches_the_writer_thread"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", case],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    output = result.stdout + result.stderr
    assert "1 passed" in output, output[-3000:]
    assert "terminate called" not in output and "Fatal Python" not in output, output[-3000:]
    assert result.returncode == 0, output[-3000:]


def test_stopping_the_io_loop_ends_its_thread_and_later_calls_fail_instead_of_waiting(monkeypatch):
    from distckpt.storage.clients import stop_io_loop

    # a loop of this test's own, in fsspec's slots, so the session's shared one is left alone
    monkeypatch.setattr(fsspec.asyn, "loop", [None])
    monkeypatch.setattr(fsspec.asyn, "iothread", [None])
    monkeypatch.setattr(fsspec.asyn, "_lock", None)
    loop = fsspec.asyn.get_loop()
    thread = fsspec.asyn.iothread[0]

    async def answer():
        return 42

    assert fsspec.asyn.sync(loop, answer) == 42
    stop_io_loop()
    assert not thread.is_alive() and loop.is_closed()
    with pytest.raises(RuntimeError, match="not running"):
        fsspec.asyn.sync(loop, answer)
    stop_io_loop()  # twice, or with no loop at all: nothing to do
    monkeypatch.setattr(fsspec.asyn, "loop", [None])
    stop_io_loop()
