"""Telling a peer rank's process is gone (liveness.py): only where this process can see it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from distckpt.protocol.liveness import ProcessIdentity


def test_this_process_is_alive_and_an_ended_one_is_gone():
    here = ProcessIdentity.current()
    assert here is not None and not here.is_gone(here)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        running = dataclasses.replace(here, pid=child.pid, start_ticks=_ticks(child.pid))
        assert not running.is_gone(here)
        child.kill()
        child.wait()  # reaped: no such process
        assert running.is_gone(here)
    finally:
        child.kill()


def test_a_zombie_is_gone():
    here = ProcessIdentity.current()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    peer = dataclasses.replace(here, pid=child.pid, start_ticks=_ticks(child.pid))
    import time

    deadline = time.monotonic() + 30
    while _state(child.pid) != "Z" and time.monotonic() < deadline:  # exited, not yet reaped
        time.sleep(0.01)
    assert _state(child.pid) == "Z"
    assert peer.is_gone(here)
    child.wait()


def test_a_recycled_pid_is_not_the_rank():
    here = ProcessIdentity.current()
    assert dataclasses.replace(here, start_ticks=here.start_ticks - 1).is_gone(here)


def test_other_machines_and_containers_are_never_judged():
    here = ProcessIdentity.current()
    ghost = dataclasses.replace(here, pid=2**22 + 12345)  # no such process here
    assert ghost.is_gone(here)
    assert not dataclasses.replace(ghost, boot_id="another-machine").is_gone(here)
    assert not dataclasses.replace(ghost, pid_namespace=here.pid_namespace + 1).is_gone(here)
    assert not ghost.is_gone(None)  # this process cannot tell (not Linux)


def test_identities_round_trip_and_garbage_is_none():
    here = ProcessIdentity.current()
    assert ProcessIdentity.from_json(here.to_json()) == here
    for bad in (None, {}, {"pid": "x"}, [1, 2], "text"):
        assert ProcessIdentity.from_json(bad) is None


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return stat[stat.rindex(")") + 2:].split()


def _ticks(pid: int) -> int:
    return int(_stat_fields(pid)[19])


def _state(pid: int) -> str:
    return _stat_fields(pid)[0]


def _store():
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timedelta(seconds=10))


def test_rank_0s_wait_for_reports_fails_at_once_when_the_peer_is_gone():
    import json
    import threading
    import time

    import pytest

    from distckpt.errors import CoordinationError
    from distckpt.protocol.reports import StoreReports, _identity_key

    store = _store()
    reports = StoreReports(store, timeout_s=30, rank=0)
    threading.Timer(0.3, lambda: store.set("s/files/rank-0", json.dumps({"ok": 1}))).start()
    assert reports.collect(["s/files/rank-0"], "phase") == [{"ok": 1}]  # a late report is waited for

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    here = ProcessIdentity.current()
    peer = dataclasses.replace(here, pid=child.pid, start_ticks=_ticks(child.pid))
    store.set(_identity_key(1), json.dumps(peer.to_json()))
    threading.Timer(0.5, child.kill).start()
    started = time.monotonic()
    with pytest.raises(CoordinationError, match=rf"rank 1 \(pid {child.pid} on this machine\) ended before it reported"):
        reports.collect(["s/files/rank-0", "s/files/rank-1"], "save of step 3")
    assert time.monotonic() - started < 5  # not the 30 s timeout
    child.wait()

    short = StoreReports(store, timeout_s=0.5)
    with pytest.raises(CoordinationError, match=r"no report under \['s/files/rank-7'\] within the 0.5s timeout"):
        short.collect(["s/files/rank-7"], "phase")
