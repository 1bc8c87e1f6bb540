"""A load's peak memory, measured in a fresh process as a resume is: into existing tensors at most
a quarter of the state on top of the model (the mapped file is let go of piece by piece while
it is verified and copied), into fresh tensors about the tensors themselves; and every value
comes back bitwise."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys

import pytest
import torch

from distckpt.io import copying

CHILD = r"""
import json, sys
import torch
from torch import nn
import distckpt

root, layout, fill, options = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
threads = int(sys.argv[5])
if threads:  # the load's copies on this many threads (copying.copy_threads decides otherwise)
    import distckpt.io.copying
    distckpt.io.copying.copy_threads = lambda: threads
MIB = 2**20 // 4  # float32 elements per MiB


def build(make):
    torch.manual_seed(0)
    if layout == "tensors":      # 16 top-level tensor entries of 8 MiB
        return {f"t{i}": make(8 * MIB) for i in range(16)}
    if layout == "module":       # one module entry: 8 parameters of 16 MiB
        model = nn.Sequential(*[nn.Linear(1024, 4096, bias=False) for _ in range(8)])
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(make(p.numel()).view_as(p))
        return {"model": model}
    if layout == "one-large":    # one tensor of 128 MiB: copied in pieces
        return {"big": make(128 * MIB)}
    raise SystemExit(layout)


def values(state):
    return {k: (v.state_dict() if isinstance(v, nn.Module) else {"": v}) for k, v in state.items()}


def rss_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


if fill == "save":
    with distckpt.CheckpointManager(root, storage_options=options) as mgr:
        mgr.load_latest(build(torch.randn))
        mgr.save(1, build(torch.randn))
    raise SystemExit(0)
target = build(torch.zeros if fill == "existing" else torch.empty)
expected = values(build(torch.randn))
mgr = distckpt.CheckpointManager(root, storage_options=options)
before = rss_kib("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current resident set
assert mgr.load_latest(target).step == 1
extra_mib = (rss_kib("VmHWM:") - before) / 1024
mgr.close()
same = all(torch.equal(a, b) for k in expected for a, b in zip(expected[k].values(), values(target)[k].values()))
print(json.dumps({"extra_mib": extra_mib, "same": same}))
"""

STATE_MIB = 128


def _run(root: str, layout: str, fill: str, options: dict | None = None, threads: int = 0) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, root, layout, fill, json.dumps(options), str(threads)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]) if fill != "save" else {}


@pytest.mark.parametrize("threads", [pytest.param(1, marks=pytest.mark.faults), 4])
@pytest.mark.parametrize("layout", ["module", pytest.param("tensors", marks=pytest.mark.faults),
                                    pytest.param("one-large", marks=pytest.mark.faults)])
def test_a_load_holds_little_more_than_the_state_it_fills(tmp_path, layout, threads):
    """With one copying thread and with four (each walks its own run of pieces, letting go of
    each piece's pages as it goes)."""
    root = str(tmp_path / "ckpt")
    _run(root, layout, "save")
    existing = _run(root, layout, "existing", threads=threads)
    fresh = _run(root, layout, "fresh", threads=threads)
    assert existing["same"] and fresh["same"]
    # into tensors that hold memory already: verification and the copy let go of the file's
    # pages as they go (8 MiB pieces); 8 MiB of slack for the interpreter's own allocations
    assert existing["extra_mib"] <= 0.25 * STATE_MIB + 8, existing
    # into fresh (never touched) tensors: those tensors' pages are the cost, and little else
    assert fresh["extra_mib"] <= 1.1 * STATE_MIB + 8, fresh


# S3: concurrency x the 1 MiB pieces each ranged GET is streamed in; GCS and Azure: one 8 MiB
# ranged request at a time, read whole by the client (twice that while it joins the body).
IN_FLIGHT_MIB = {"s3": 8 * 1, "gcs": 2 * 8, "azure": 2 * 8}


@pytest.mark.parametrize("store", ["s3", pytest.param("gcs", marks=pytest.mark.faults),
                                   pytest.param("azure", marks=pytest.mark.faults)])
@pytest.mark.parametrize("layout", ["module", pytest.param("one-large", marks=pytest.mark.faults)])
def test_an_object_store_load_holds_the_reads_in_flight_not_the_file(request, tmp_path, store, layout):
    """From an object store the file is downloaded into an unnamed local file and mapped: a load
    into existing tensors holds what it holds from local disk plus the reads in flight; held in
    memory (spill_dir=None) it holds the whole file, which is what this bound tells apart."""
    import uuid

    server = request.getfixturevalue({"s3": "s3_server", "gcs": "gcs_server", "azure": "azure_server"}[store])
    url = f"{ {'s3': 's3', 'gcs': 'gs', 'azure': 'az'}[store]}://ckpt/memory-{uuid.uuid4().hex[:8]}"
    server_options = server.storage_options()
    _run(url, layout, "save", server_options)
    spill = tmp_path / "spill"
    spill.mkdir()
    existing = _run(url, layout, "existing", {**server_options, "spill_dir": str(spill)})
    in_memory = _run(url, layout, "existing", {**server_options, "spill_dir": None})
    assert existing["same"] and in_memory["same"]
    assert existing["extra_mib"] <= 0.25 * STATE_MIB + IN_FLIGHT_MIB[store] + 8, existing
    assert in_memory["extra_mib"] >= STATE_MIB, in_memory  # the bound above is not met by accident
    assert list(spill.iterdir()) == []  # the download file had no name: nothing left behind


def _queued_copy_cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Targets and sources of every shape a restore queues: small and large, contiguous or not,
    pieces that do not divide evenly, other dtypes, a 0-d and an empty tensor."""
    g = torch.Generator().manual_seed(7)
    piece = copying.COPY_PIECE_BYTES // 4  # float32 elements per piece
    cases = []
    for numel in (1, 3, 1000, piece - 1, piece, piece + 1, 2 * piece + 17, 5 * piece // 2):
        cases.append((torch.empty(numel), torch.randn(numel, generator=g)))
    cases.append((torch.empty(()), torch.randn((), generator=g)))
    cases.append((torch.empty(0), torch.randn(0, generator=g)))
    cases.append((torch.empty(512, 4096).t(), torch.randn(4096, 512, generator=g)))  # target not contiguous
    cases.append((torch.empty(4096, 1024), torch.randn(1024, 4096, generator=g).t()))  # source not contiguous
    cases.append((torch.empty(3 * piece, dtype=torch.int16), torch.randint(-9, 9, (3 * piece,), dtype=torch.int16, generator=g)))
    cases.append((torch.empty(piece + 5, dtype=torch.float64), torch.randn(piece + 5, dtype=torch.float64, generator=g)))
    return cases


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_queued_copies_put_every_value_where_a_direct_copy_would(threads):
    """The restore's copies run at the phase's end, split into pieces over threads: each target
    ends bitwise what target.copy_(source) makes it, and nothing runs before finish()."""
    cases = _queued_copy_cases()
    release = copying.PageRelease([], threads=threads)
    for target, _ in cases:
        target.fill_(0)
    for target, source in cases:
        copying.copy_released(target, source, release)
    assert all(not target.any() for target, _ in cases)  # queued, not run
    release.finish()
    for target, source in cases:
        expected = torch.empty_like(target).copy_(source)
        assert torch.equal(target, expected), (target.shape, target.dtype)


def test_the_copy_threads_follow_torch_and_the_local_ranks(monkeypatch):
    """One thread where torch's own copies use several; else the cores shared by the node's ranks."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert copying.copy_threads() == 1
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(copying.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert copying.copy_threads() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert copying.copy_threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert copying.copy_threads() == copying.MAX_COPY_THREADS


def _resident_fraction(tensor: torch.Tensor) -> float:
    """The share of a tensor's whole pages that are resident (mincore). Asked of the range
    itself, not of the process's resident set, which other memory freed meanwhile moves."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-tensor.data_ptr() // page) * page
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
    pages = (end - start) // page
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) / pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_prefaulting_the_destination_faults_its_pages_in_and_changes_no_value():
    """What a load runs while it reads the files: the destination's pages become resident (the
    copy then costs no faults), and every value, touched or not, is what it was."""
    # 64 MiB never touched: mapped here, since torch.empty may hand back memory an earlier test
    # freed into the heap, resident and holding its values
    fresh = torch.frombuffer(mmap.mmap(-1, 64 << 20), dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    held = torch.randn(3 << 18, generator=g)[5:]  # touched, and not starting on a page boundary
    expected = held.clone()
    small = torch.arange(100.0)  # below the size worth a thread's call: left alone
    assert _resident_fraction(fresh) < 0.5
    prefault = copying.Prefault([fresh, held, small, torch.zeros(4, 4).t()])
    assert prefault._thread is not None
    prefault._thread.join()  # let it finish rather than stop it where it got to
    prefault.stop()
    assert _resident_fraction(fresh) > 0.99 and _resident_fraction(held) > 0.99
    assert torch.equal(held, expected) and torch.equal(small, torch.arange(100.0))
    assert not fresh.any()  # untouched anonymous memory reads as zeros, and still does


def test_a_stopped_prefault_stops_at_once():
    """stop() ends it where it got to: a load never waits for it."""
    import time

    tensors = [torch.empty(256 << 18) for _ in range(4)]  # 1 GiB, never touched
    prefault = copying.Prefault(tensors)
    started = time.perf_counter()
    prefault.stop()
    assert time.perf_counter() - started < 0.5
    assert prefault._thread is None
