"""Staging buffers in shared memory, for a writer in another process (writer="process").

The buffers of an async save live in anonymous shared-memory segments (Linux memfd), each
mapped once here and once in the writer process, whose file descriptors travel over the
writer's socket (protocol/writer_process.py). A segment has no name in /dev/shm: when both
processes are gone, the kernel frees it, so a SIGKILLed trainer leaves nothing behind.

Buffers are carved from the segments and kept by StagingPool under the tensor's name, reused by
every later save while its shape and dtype stay the same (a tensor that changes shape gets a new
buffer; the old one's bytes are reclaimed by `before_save` once they are half the segments).

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

import itertools
import mmap
import os
from dataclasses import dataclass
from typing import Any

import torch

from distckpt.io.staging import StagingPool

ALIGN = 64                 # every buffer starts at a multiple: any dtype's view is aligned
SEGMENT_BYTES = 64 << 20   # a segment holds many small buffers; a larger tensor gets its own
_SEGMENT_NUMBERS = itertools.count()


@dataclass
class Segment:
    index: int
    fd: int
    size: int
    memory: mmap.mmap
    base: torch.Tensor  # the whole segment as uint8 (a view of `memory`)
    used: int = 0

    @property
    def address(self) -> int:
        return int(self.base.data_ptr())


class SharedArena:
    """Anonymous shared-memory segments, bump-allocated, never freed one buffer at a time."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.segments)

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor of `nbytes` in shared memory."""
        need = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        segment = next((s for s in self.segments if s.size - s.used >= need), None)
        if segment is None:
            segment = self._new_segment(max(need, SEGMENT_BYTES))
        start = segment.used
        segment.used += need
        return segment.base[start:start + nbytes]

    def _new_segment(self, size: int) -> Segment:
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        index = next(_SEGMENT_NUMBERS)  # unique in the process: the writer keeps its mappings by it
        fd = os.memfd_create(f"distckpt-staging-{index}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            memory = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        base = torch.frombuffer(memory, dtype=torch.uint8)
        segment = Segment(index, fd, size, memory, base)
        self.segments.append(segment)
        return segment

    def locate(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """(segment index, byte offset) of a contiguous CPU tensor's bytes when they lie in one
        of the segments, else None."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.is_neg() or tensor.is_conj():
            return None
        start = tensor.data_ptr()
        nbytes = tensor.numel() * tensor.element_size()
        for segment in self.segments:
            if segment.address <= start and start + nbytes <= segment.address + segment.size:
                return segment.index, start - segment.address
        return None

    def close(self) -> None:
        """Close the descriptors; each mapping goes with the last buffer that views it."""
        for segment in self.segments:
            os.close(segment.fd)
        self.segments = []


class SharedAllocation:
    """Buffers of a StagingPool in a SharedArena (not pinned: a pinned buffer is this process's;
    copies from a GPU into it are synchronous). Mixed into a pool class before it."""

    buffers: dict[str, torch.Tensor]
    _spares: dict[Any, list[torch.Tensor]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.arena = SharedArena()

    def allocate(self, shape: torch.Size, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return self.arena.allocate(nbytes).view(dtype).view(shape)

    def before_save(self) -> None:
        """When buffers given up (shapes that changed, tensors no longer staged) hold more than
        half the segments, start over with fresh segments; this save allocates what it needs."""
        live = sum(b.numel() * b.element_size() for b in self.buffers.values())
        if self.arena.total_bytes > 2 * live + SEGMENT_BYTES:
            self.buffers = {}
            self._spares = {}
            self.arena.close()
            self.arena = SharedArena()  # the old segments go with the last buffer viewing them


class SharedStagingPool(SharedAllocation, StagingPool):
    """A StagingPool whose buffers live in shared memory."""


def tensor_spec(tensor: torch.Tensor) -> tuple[str, list[int]]:
    return str(tensor.dtype).removeprefix("torch."), list(tensor.shape)


def tensor_in(memory: Any, offset: int, dtype_name: str, shape: list[int]) -> torch.Tensor:
    """The writer process's view of a staged tensor: its bytes in a mapped segment (`memory`
    None: a meta tensor, whose bytes come over the socket)."""
    dtype = getattr(torch, dtype_name)
    numel = int(torch.Size(shape).numel())
    if memory is None:
        return torch.empty(shape, dtype=dtype, device="meta")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(memory, dtype=torch.uint8, count=numel * itemsize,
                            offset=offset).view(dtype).view(shape)
