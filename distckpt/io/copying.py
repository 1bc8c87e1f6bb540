"""Copying a load's tensors out of the mapped checkpoint files into the state.

A restore phase queues its copies (`PageRelease.copy`) and runs them together at its end
(`PageRelease.finish`): split into 8 MiB pieces and spread over the cores this rank may use
when torch's own copies run on one thread, each piece's file pages let go as soon as it is
copied, so a load never holds the mapped files resident. The copies were checked completely
before they are queued (keys, shapes, dtypes, devices), so running them later cannot fail
half-way for a reason a check could have seen.

Why threads: copying into tensors never touched before (a state built with `torch.empty`, an
optimizer's fresh buffers) is bound by the page faults of the destination, not by memory
bandwidth; two threads copied 256 MiB from a warm mapping into fresh tensors in 0.08 s against
0.13 s for one (2-core VM), which is what torch's own copy does when it may use two threads.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from typing import Any

import torch

from distckpt.io.staging import flat_bytes
from distckpt.runtime.cores import cores_per_rank
from distckpt.runtime.interrupts import Helpers, start_thread
from distckpt.storage import is_mapped, release_pages

COPY_PIECE_BYTES = 8 << 20  # a large tensor is copied (and its source pages let go) in pieces
MAX_COPY_THREADS = 8
Piece = tuple[torch.Tensor, torch.Tensor, str]  # target, source, what it restores


def copy_threads() -> int:
    """How many threads a load's copies may use: the cores this process may run on, shared
    with the other ranks of its node (torchrun's LOCAL_WORLD_SIZE), and one where torch's own
    copies already run on several (they would only compete)."""
    if torch.get_num_threads() > 1:
        return 1
    return max(1, min(MAX_COPY_THREADS, cores_per_rank()))


# Helper threads per thread count, kept for the process (interrupts.Helpers: a wait for them an
# interrupt cannot wedge, unlike concurrent.futures' pool, which also started threads per load).
_COPIERS: dict[int, Helpers] = {}


class PageRelease:
    """Lets go of the file pages behind restored tensors (storage.release_pages), and runs a
    phase's queued copies. A load into existing tensors then holds at most a few pieces of the
    mapped files resident, not all of them (the pages stay in the page cache; the tensors view
    them again if read). Tensors that do not view a mapped file are ignored."""

    PIECE = 8 << 20  # small tensors: the whole file is let go once this many bytes were copied

    def __init__(self, buffers: list[Any], threads: int | None = None) -> None:
        self._spans: list[list[Any]] = []  # [base address, length, buffer, bytes copied since released]
        for data in buffers:
            if len(data) and is_mapped(data):
                self._spans.append([torch.frombuffer(data, dtype=torch.uint8).data_ptr(), len(data), data, 0])
        self._threads = copy_threads() if threads is None else threads
        self._queued: list[Piece] = []
        self._lock = threading.Lock()  # the small-tensor counts, updated from the copying threads

    def __call__(self, tensor: torch.Tensor) -> None:
        if not self._spans or tensor.device.type != "cpu":
            return
        start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        for span in self._spans:
            base, length, data, _ = span
            if not base <= start < base + length:
                continue
            if nbytes >= self.PIECE // 4:
                release_pages(data, start - base, nbytes)
                return
            with self._lock:
                span[3] += nbytes
                due = span[3] >= self.PIECE  # one call for many small tensors (20,000 calls: 40 ms)
                if due:
                    span[3] = 0
            if due:
                release_pages(data)
            return

    def everything(self) -> None:
        for span in self._spans:
            release_pages(span[2])
            span[3] = 0

    def copy(self, target: torch.Tensor, source: torch.Tensor, what: str = "a tensor") -> None:
        """target.copy_(source), run by `finish`. Checked before (validation.check_writable and
        the shape and dtype checks), so it fails only for what no check sees; `what` names it then."""
        self._queued.append((target, source, what))

    def finish(self) -> None:
        """Run the queued copies, in parallel where this rank has cores to spare, letting go of
        each source piece once copied; then of whatever else of the files is still mapped. The
        first failure stops every thread before its next piece and is raised as CopyFailed."""
        queued, self._queued = self._queued, []
        pieces = [p for target, source, what in queued for p in _pieces(target, source, what)]
        failed: list[CopyFailed] = []
        try:
            if self._threads <= 1 or len(pieces) <= 1:
                self._copy_run(pieces, failed)
            else:
                copiers = _COPIERS.get(self._threads) or _COPIERS.setdefault(self._threads, Helpers(self._threads, "distckpt-copy"))
                tasks = [copiers.submit(self._copy_run, run, failed) for run in _runs(pieces, self._threads)]
                try:
                    for task in tasks:
                        task.result()
                finally:
                    for task in tasks:
                        task.wait()  # every copy ended before the files are let go
        finally:
            self.everything()
        if failed:
            raise failed[0]

    def _copy_run(self, run: list[Piece], failed: list[CopyFailed]) -> None:
        with torch.no_grad():
            for target, source, what in run:
                if failed:
                    return  # another piece failed: copy no more
                try:
                    target.copy_(source)
                except Exception as e:  # noqa: BLE001  (handed to the phase, which names it)
                    failed.append(CopyFailed(what, e))
                    return
                self(source)


class CopyFailed(Exception):
    """A queued copy failed (memory, a device): `what` it copied into, and the error."""

    def __init__(self, what: str, error: BaseException) -> None:
        super().__init__(f"{what}: {type(error).__name__}: {error}")
        self.what, self.error = what, error


def copy_released(target: torch.Tensor, source: torch.Tensor, release: PageRelease | None,
                  what: str = "a tensor") -> None:
    """target.copy_(source): at once without `release`, else queued for the phase's `finish`."""
    if release is None:
        with torch.no_grad():
            target.copy_(source)
    else:
        release.copy(target, source, what)


def _pieces(target: torch.Tensor, source: torch.Tensor, what: str) -> list[Piece]:
    """A contiguous pair of one shape and dtype as 8 MiB flat pieces; anything else whole."""
    nbytes = source.numel() * source.element_size()
    if nbytes <= COPY_PIECE_BYTES or not (target.is_contiguous() and source.is_contiguous()
                                          and target.shape == source.shape and target.dtype == source.dtype):
        return [(target, source, what)]
    flat_target, flat_source = target.view(-1), source.view(-1)
    step = max(1, COPY_PIECE_BYTES // max(1, source.element_size()))
    return [(flat_target[i:i + step], flat_source[i:i + step], what) for i in range(0, flat_source.numel(), step)]


def _runs(pieces: list[Piece], threads: int) -> list[list[Piece]]:
    """The pieces in about `threads` x 4 consecutive runs of similar byte counts: consecutive, so
    each thread walks the files forward (the kernel's read-ahead), several per thread, so an
    uneven run does not leave a core idle at the end."""
    total = sum(s.numel() * s.element_size() for _, s, _ in pieces)
    share = max(1, total // (threads * 4))
    runs: list[list[Piece]] = [[]]
    held = 0
    for pair in pieces:
        if held >= share:
            runs.append([])
            held = 0
        runs[-1].append(pair)
        held += pair[1].numel() * pair[1].element_size()
    return runs


# -- the destination's pages, faulted in while the files are read ------------------------------

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable, without writing to them
_PREFAULT_MIN_BYTES = 1 << 20


class Prefault:
    """Faults in the pages of the tensors a load will copy into, on a thread of its own, while
    the files are read and verified (`stop` ends it where it got to). A tensor never touched
    before (`torch.empty`, a model built without initialising, an optimizer's new buffers) costs
    a page fault per 4 KiB on its first write, most of a copy's cost; from a cold page cache
    the reading waits on the disk, and this fills that wait (256 MiB into fresh tensors: copy
    0.15 -> 0.07 s after the read). It never delays the load: from a warm cache the read ends
    first and the copy faults in the rest. Faulting a page in writes nothing to it, so the
    state's values are what they were whatever the load decides. Linux only; elsewhere, or if
    the kernel refuses, the copy faults the pages in as before."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        ranges = [r for r in (_page_range(t) for t in tensors) if r is not None]
        self._stopping = False  # a flag, not an Event: set() takes a lock a Ctrl-C could leave held
        self._thread: threading.Thread | None = None
        madvise = _libc_madvise() if ranges else None
        if madvise is not None:
            self._thread = threading.Thread(target=self._populate, args=(madvise, ranges), daemon=True,
                                            name="distckpt-prefault")
            start_thread(self._thread)

    def stop(self) -> None:
        self._stopping = True
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _populate(self, madvise: Any, ranges: list[tuple[int, int]]) -> None:
        for address, length in ranges:
            for offset in range(0, length, _PREFAULT_STEP):
                if self._stopping:
                    return
                if madvise(address + offset, min(_PREFAULT_STEP, length - offset), _MADV_POPULATE_WRITE) != 0:
                    return  # an older kernel (EINVAL) or memory it will not fault in: the copy does it


_PREFAULT_STEP = 2 << 20  # how far it gets past a stop(): one call's worth


def _page_range(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The whole pages inside a contiguous CPU tensor's bytes: (address, length)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.is_sparse:
        return None
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < _PREFAULT_MIN_BYTES:
        return None
    page = _PAGE_SIZE
    start = -(-tensor.data_ptr() // page) * page
    end = (tensor.data_ptr() + nbytes) // page * page
    return (start, end - start) if end > start else None


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MADVISE: Any = None


def _libc_madvise() -> Any:
    global _MADVISE
    if _MADVISE is None:
        _MADVISE = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                fn = libc.madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
                _MADVISE = fn
            except (OSError, AttributeError):
                pass
    return _MADVISE or None


# -- where copies land: overlap between two destinations --------------------------------------

def byte_extent(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte address a non-empty tensor's elements span (strides >= 0)."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


# Above this many elements two tensors whose extents overlap are taken to overlap (a list of
# every element's address costs 8 bytes an element); only interleaved views (x[::2] and x[1::2])
# are told apart below it.
_EXACT_OVERLAP_ELEMENTS = 1 << 22


def elements_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors on one storage share a byte (their extents are known to overlap)."""
    if a.is_contiguous() and b.is_contiguous() or max(a.numel(), b.numel()) > _EXACT_OVERLAP_ELEMENTS:
        return True
    bytes_a, bytes_b = _byte_addresses(a), _byte_addresses(b)
    return bool(torch.isin(bytes_a, bytes_b).any())


def _byte_addresses(t: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros((), dtype=torch.int64)
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[dim] = size
        offsets = offsets + torch.arange(size, dtype=torch.int64).reshape(shape) * stride
    first = offsets.reshape(-1, 1) * t.element_size() + t.data_ptr()
    return (first + torch.arange(t.element_size(), dtype=torch.int64)).reshape(-1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaNs with equal bits are equal), dtype and shape included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(flat_bytes(a), flat_bytes(b))
