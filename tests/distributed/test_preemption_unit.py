"""The SIGTERM handler in one process: recorded once the loop asks, default effect otherwise."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest


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


def test_no_preemption_signals_leaves_the_job_s_own_handler_in_place(tmp_path):
    out = run(f"""
        import os, signal, distckpt
        seen = []
        signal.signal(signal.SIGTERM, lambda *a: seen.append("own handler"))
        mgr = distckpt.CheckpointManager({str(tmp_path)!r}, preemption_signals=())
        assert mgr.preemption_requested() is False
        os.kill(os.getpid(), signal.SIGTERM)
        print(seen, "asked:", mgr.preemption_requested())
        mgr.close()
    """)
    assert out.returncode == 0, out.stderr
    assert "['own handler'] asked: False" in out.stdout


def test_a_real_time_signal_is_a_notice_too(tmp_path):
    out = run(f"""
        import os, signal, distckpt
        mgr = distckpt.CheckpointManager({str(tmp_path)!r}, preemption_signals=signal.SIGRTMIN + 2)
        mgr.preemption_requested()
        os.kill(os.getpid(), signal.SIGRTMIN + 2)
        print("asked:", mgr.preemption_requested())
        mgr.close()
    """)
    assert out.returncode == 0, out.stderr
    assert "asked: True" in out.stdout and "received SIGRTMIN+2" in out.stderr, out.stderr


_LOADER = """
    import os, signal, sys, time, torch, distckpt
    from torch.utils.data import IterableDataset, TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    class Stream(IterableDataset):
        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            return iter(range(info.id, 400, info.num_workers))

    data = TensorDataset(torch.arange(400.0)) if {kind!r} != "iterable" else Stream()
    if {kind!r} == "worker_init_fn":  # not wrapped: distckpt's worker_init_fn instead
        loader = StatefulDataLoader(data, batch_size=4, num_workers=2,
                                    worker_init_fn=distckpt.preemption_safe_worker_init)
    else:
        loader = StatefulDataLoader(distckpt.with_worker_rng(data), batch_size=4, num_workers=2)
    mgr = distckpt.CheckpointManager({root!r}, timeout=10)
    it = iter(loader)
    next(it)
"""


_SAMPLED = {("map", "end"), ("iterable", "raise"), ("worker_init_fn", "exit"), ("map", "close")}  # make test


@pytest.mark.parametrize("kind, ending", [
    pytest.param(kind, ending, marks=() if (kind, ending) in _SAMPLED else pytest.mark.faults)
    for kind in ("map", "iterable", "worker_init_fn") for ending in ("end", "close", "exit", "raise")])
def test_a_rank_that_exits_with_loader_workers_mid_epoch_ends(tmp_path, kind, ending):
    """Workers of a with_worker_rng dataset outlive a pre-emption notice; they ignored SIGTERM
    outright, and multiprocessing's exit hook (SIGTERM to each worker, then a join with no
    deadline) hung the exit of every script that left a loader's iterator mid-epoch."""
    tail = {"end": "", "close": "mgr.close()", "exit": "sys.exit(3)", "raise": "raise RuntimeError('in the step')"}[ending]
    code = _LOADER.format(kind=kind, root=str(tmp_path)) + f"    {tail}\n    print('end of script', flush=True)\n"
    started = time.monotonic()
    out = run(code)
    assert out.returncode == {"exit": 3, "raise": 1}.get(ending, 0), out.stderr[-2000:]
    assert time.monotonic() - started < 60
    assert "is killed by signal" not in out.stderr, out.stderr[-2000:]  # ended quietly, as torch ends them


@pytest.mark.faults  # make test-faults
def test_a_loader_worker_signalled_alone_ends(tmp_path):
    """A SIGTERM the rank did not get (a kill of one worker) keeps its default effect, after a
    bounded wait for the rank's notice (the loader then reports the worker killed, as usual)."""
    code = _LOADER.format(kind="map", root=str(tmp_path)) + """
    assert mgr.preemption_requested() is False  # armed: the loop asks
    os.kill(it._workers[0].pid, signal.SIGTERM)
    started, said = time.monotonic(), ""
    try:
        while time.monotonic() - started < 30 and it._workers[0].exitcode is None:
            time.sleep(0.05)
    except RuntimeError as e:  # torch's SIGCHLD handler: "DataLoader worker ... is killed by signal"
        said = str(e)
    while time.monotonic() - started < 30 and it._workers[0].exitcode is None:
        time.sleep(0.05)
    print("alone:", it._workers[0].exitcode, round(time.monotonic() - started, 1), "killed by signal" in said, flush=True)
    os._exit(0)
    """
    out = run(code)
    assert out.returncode == 0, out.stderr[-3000:]
    alone = next(line for line in out.stdout.splitlines() if line.startswith("alone:")).split()
    assert alone[1] == "-15" and float(alone[2]) < 15 and alone[3] == "True", out.stdout


@pytest.mark.parametrize("kind, order", [("map", "workers first"), ("worker_init_fn", "rank first"),
                                         pytest.param("map", "rank first", marks=pytest.mark.faults),
                                         pytest.param("worker_init_fn", "workers first", marks=pytest.mark.faults)])
def test_loader_workers_signalled_with_their_rank_serve_on_until_it_saves(tmp_path, order, kind):
    """A pre-emption signal to the process group reaches the workers and the rank in either
    order: the workers wait for the rank's notice and keep serving batches."""
    signal_rank = "os.kill(os.getpid(), signal.SIGTERM)"
    signal_workers = "for w in it._workers: os.kill(w.pid, signal.SIGTERM)"
    first, second = (signal_workers, signal_rank) if order == "workers first" else (signal_rank, signal_workers)
    code = _LOADER.format(kind=kind, root=str(tmp_path)) + f"""
    assert mgr.preemption_requested() is False  # armed: the loop asks
    {first}
    time.sleep(0.2)
    {second}
    time.sleep(0.5)
    batches = sum(1 for _ in zip(range(20), it))
    print("with the rank:", mgr.preemption_requested(), batches, [w.exitcode for w in it._workers], flush=True)
    mgr.close()
    """
    out = run(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "with the rank: True 20 [None, None]" in out.stdout, out.stdout


# How the manager before the one that asks ended: each must leave the next one hearing the notice,
# and nothing installed once every manager is closed.
_ENDINGS = {
    "closed": "old.close()",
    "dropped": "del old; gc.collect()",               # a notebook cell run again, a sweep in one process
    "dropped-armed": "old.preemption_requested(); del old; gc.collect()",
    "with-block-raised": "old.__exit__(RuntimeError, RuntimeError('x'), None); del old",
    "still-open": "pass",                              # two managers live at once
}


@pytest.mark.parametrize("ending", sorted(_ENDINGS))
def test_the_next_manager_hears_the_notice_however_the_one_before_ended(tmp_path, ending):
    out = run(f"""
        import gc, os, signal, distckpt, torch
        state = {{"w": torch.zeros(2)}}
        old = distckpt.CheckpointManager({str(tmp_path / "a")!r})
        old.load_latest(state)
        old.save(0, state)
        {_ENDINGS[ending]}
        new = distckpt.CheckpointManager({str(tmp_path / "b")!r})
        assert new.load_latest(state) is None
        assert new.preemption_requested() is False
        os.kill(os.getpid(), signal.SIGTERM)
        print("asked:", new.preemption_requested())
        new.close()
        if {ending!r} == "still-open":
            print("old asked:", old.preemption_requested())
            old.close()
        gc.collect()
        print("after close:", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    """)
    assert out.returncode == 0, out.stderr
    assert "asked: True" in out.stdout, out.stdout + out.stderr
    assert "after close: True" in out.stdout, out.stdout
    if ending == "still-open":  # it never asked: not armed, so it records nothing
        assert "old asked: False" in out.stdout


def test_a_dropped_managers_handler_gives_the_signal_its_default_effect_when_nobody_asks(tmp_path):
    out = run(f"""
        import gc, os, signal, time, distckpt
        old = distckpt.CheckpointManager({str(tmp_path)!r})
        old.preemption_requested()
        del old; gc.collect()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("ignored the signal")
    """)
    assert out.returncode == -15 and "ignored" not in out.stdout


def test_a_manager_in_a_forked_child_hears_its_own_notice_beside_a_parents_manager(tmp_path):
    # The child inherited the parent's handler, which saw another pid and gave the signal its
    # default effect: the child's manager, which had asked, never heard it.
    out = run(f"""
        import os, signal, distckpt
        parent = distckpt.CheckpointManager({str(tmp_path / "p")!r})
        parent.preemption_requested()
        pid = os.fork()
        if pid == 0:
            child = distckpt.CheckpointManager({str(tmp_path / "c")!r})
            child.preemption_requested()
            os.kill(os.getpid(), signal.SIGTERM)
            heard = child.preemption_requested()
            child.close()
            os._exit(0 if heard else 3)
        _, status = os.waitpid(pid, 0)
        print("child status", status, "parent heard", parent.preemption_requested())
        parent.close()
    """)
    assert out.returncode == 0, out.stderr
    assert "child status 0 parent heard False" in out.stdout, out.stdout + out.stderr


def test_close_from_another_thread_closes_everything(tmp_path):
    # signal.signal raised there ("only works in main thread") half-way through close(): the
    # writer and the other threads of the manager were never closed.
    out = run(f"""
        import threading, torch, distckpt
        mgr = distckpt.CheckpointManager({str(tmp_path)!r}, async_save=True)
        mgr.preemption_requested()
        mgr.save(0, {{"w": torch.zeros(2)}})
        errors = []
        def close():
            try:
                mgr.close()
            except BaseException as e:
                errors.append(repr(e))
        t = threading.Thread(target=close)
        t.start(); t.join()
        print("errors", errors)
        print("threads", sorted(t.name for t in threading.enumerate() if t.name.startswith("distckpt") and not t.daemon))
    """)
    assert out.returncode == 0, out.stderr
    assert "errors []" in out.stdout and "threads []" in out.stdout, out.stdout


@pytest.mark.parametrize("where", ["sigint", "thread-manager"])
def test_a_configured_signal_and_a_manager_built_in_a_thread_hear_the_notice(tmp_path, where):
    # SIGINT's default handler is not SIG_DFL, so preemption_signals=("SIGINT",) installed nothing
    # (a KeyboardInterrupt mid-step instead); a manager built in a thread never listened, and once
    # the main thread's manager closed, SIGTERM ended the process although it had asked.
    signal_name = "SIGINT" if where == "sigint" else "SIGTERM"
    out = run(f"""
        import os, signal, threading, distckpt
        # SIGINT as an interactive shell leaves it: a job started in the background by a
        # non-interactive shell has it ignored, and Python then installs no handler of its own
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if {where!r} == "sigint":
            mgr = distckpt.CheckpointManager({str(tmp_path)!r}, preemption_signals=("SIGINT",))
            mgr.preemption_requested()
            os.kill(os.getpid(), signal.SIGINT)
            print("heard", mgr.preemption_requested())
            mgr.close()
            print("after close", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        else:
            main = distckpt.CheckpointManager({str(tmp_path / "a")!r})
            main.preemption_requested()
            made = {{}}
            def build():
                made["b"] = distckpt.CheckpointManager({str(tmp_path / "b")!r})
                made["b"].preemption_requested()
            t = threading.Thread(target=build); t.start(); t.join()
            main.close()
            os.kill(os.getpid(), signal.{signal_name})
            print("heard", made["b"].preemption_requested())
            made["b"].close()
            print("after close", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    """)
    assert out.returncode == 0, out.stderr
    assert "heard True" in out.stdout and "after close True" in out.stdout, out.stdout + out.stderr
