"""The SIGTERM handler in one process: recorded once the loop asks, default effect otherwise."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_a_loop_that_asks_sees_the_request_and_keeps_running(tmp_path):
    out = run(f"""
        import os, signal, distckpt
        mgr = distckpt.CheckpointManager({str(tmp_path)!r})
        assert mgr.preemption_requested() is False
        os.kill(os.getpid(), signal.SIGTERM)
        print("asked:", mgr.preemption_requested())
        mgr.close()
        print("still alive")
    """)
    assert out.returncode == 0, out.stderr
    assert "asked: True" in out.stdout and "still alive" in out.stdout


def test_a_loop_that_never_asks_is_terminated_as_usual(tmp_path):
    out = run(f"""
        import os, signal, time, distckpt
        mgr = distckpt.CheckpointManager({str(tmp_path)!r})
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("ignored the signal")
    """)
    assert out.returncode == -15 and "ignored" not in out.stdout
