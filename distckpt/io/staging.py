"""Host buffers for async saves (StagingPool) and what names a tensor's bytes (region_key).

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

import ctypes
from typing import Any, Iterator

import torch

from distckpt.errors import SnapshotChangedError


def region_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """Tensors with equal keys are the same bytes (tied weights); None: never shared. The first
    element's address already includes the storage offset: with the dtype, shape and strides
    it names the bytes (untyped_storage() made a Python object per tensor: 1.5 us of 40). An
    empty tensor has no address (every one is null): its storage names it instead (a module's
    state_dict() hands out detached views, other objects on the same storage), so one held in two
    places is still stored once and comes back as one, and two separate empty tensors never are."""
    if tensor.numel() == 0:
        return ("empty", tensor.device, tensor.untyped_storage()._cdata, tensor.storage_offset(),
                tensor.shape, tensor.stride(), tensor.dtype)
    # the lazy neg/conj bits are part of the value: z.imag and z.conj().imag share every byte
    return (tensor.device, tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype,
            tensor.is_neg(), tensor.is_conj())


WARM_MIN_BYTES = 64 << 10


class StagingPool:
    """Host buffers for async saves, allocated once and reused while shapes stay the same.

    Pinned when CUDA is present, so device-to-host copies run asynchronously; `sync()` waits for
    them before the background write starts. Call between saves only: a save in flight reads them.

    With `deferrable` set (overlap_snapshot), the copy of a CPU tensor whose region is in it is
    left to `copy_deferred()`, which the writer thread runs while training goes on; that of a
    CUDA tensor is enqueued on a side stream (after the work already queued on the current one)
    and `copy_deferred()` only waits for it, so the next forward and backward run on the GPU while
    the copy engine drains it. Each source's version counter, noted at capture, tells whether
    anything changed it in place meanwhile.
    """

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        # allocated ahead (warm), by (shape, dtype, pinned): the first save takes them by shape
        self._spares: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self._pending_devices: set[torch.device] = set()  # asynchronous copies on current streams
        self.deferrable: set[tuple[Any, ...]] = set()
        self._deferred: list[tuple[str, torch.Tensor, torch.Tensor, int]] = []
        self._side_streams: dict[torch.device, Any] = {}  # per device, made once
        self._side_pending: set[torch.device] = set()     # side streams with this save's copies

    def warm(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Allocate ahead the buffers a first save of these tensors would, before any save
        (`load_latest` with async_save): a save allocating its buffers stalled 0.15 s for 256 MiB
        against 0.04 s for the next ones, most of it faulting in never-touched pages. Returns the
        new buffers, for the caller to fault in off the training thread (copying.Prefault). Only
        tensors of WARM_MIN_BYTES and more: a smaller one costs the first save next to nothing.
        Nothing is allocated once the pool holds buffers (a save has run)."""
        if self.buffers or self._spares:
            return []
        made = []
        for tensor in tensors:
            if tensor.device.type not in ("cpu", "cuda") or tensor.numel() * tensor.element_size() < WARM_MIN_BYTES:
                continue
            pin = tensor.device.type == "cuda"
            buf = self.allocate(tensor.shape, tensor.dtype, pin)
            self._spares.setdefault((tensor.shape, tensor.dtype, pin), []).append(buf)
            made.append(buf)
        return made

    def drop_spares(self) -> None:
        """Let go of the buffers allocated ahead that the first save did not take."""
        self._spares = {}

    def _buffer_for(self, tensor: torch.Tensor) -> torch.Tensor:
        pin = tensor.device.type == "cuda"
        spares = self._spares.get((tensor.shape, tensor.dtype, pin))
        if spares:
            return spares.pop()
        return self.allocate(tensor.shape, tensor.dtype, pin)

    def before_save(self) -> None:
        """Called before each save stages anything (a shared pool compacts its memory here)."""

    def allocate(self, shape: torch.Size, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """A new buffer (a subclass puts it in shared memory: shared_staging.py)."""
        return torch.empty(shape, dtype=dtype, pin_memory=pin)

    def stage(self, name: str, tensor: torch.Tensor, may_defer: bool = False) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = self._buffer_for(tensor)
            self.buffers[name] = buf
        if may_defer and self.deferrable and tensor.device.type in ("cpu", "cuda") \
                and not tensor.is_inference() and region_key(tensor) in self.deferrable:
            if tensor.device.type == "cuda":
                self._copy_on_side_stream(buf, tensor)
            self._deferred.append((name, buf, tensor, tensor._version))
            return buf
        on_cuda = tensor.device.type == "cuda"  # pinned buffer: the copy is asynchronous
        if tensor.requires_grad:
            tensor = tensor.detach()  # else the copy would record autograd history into `buf`
        buf.copy_(tensor, non_blocking=on_cuda)
        if on_cuda:
            self._pending_devices.add(tensor.device)
        return buf

    @property
    def has_deferred(self) -> bool:
        return bool(self._deferred)

    def _copy_on_side_stream(self, buf: torch.Tensor, tensor: torch.Tensor) -> None:
        """Enqueue a CUDA tensor's copy into its pinned buffer on the device's side stream. The
        side stream first waits for everything already queued on the current stream (the step
        that produced these values); kernels queued later (the next forward) do not wait for it.
        record_stream keeps the allocator from handing the source's memory to anything else
        until the copy has run, even if the source is freed meanwhile."""
        device = tensor.device
        stream = self._side_streams.get(device)
        if stream is None:
            stream = self._side_streams[device] = torch.cuda.Stream(device=device)
        if device not in self._side_pending:
            stream.wait_stream(torch.cuda.current_stream(device))
            self._side_pending.add(device)
        with torch.cuda.stream(stream):
            buf.copy_(tensor.detach(), non_blocking=True)
        tensor.record_stream(stream)

    def copy_deferred(self) -> None:
        """The copies staging left for later (the writer thread): CPU tensors copied here, CUDA
        tensors' side-stream copies waited for (that stream holds only them)."""
        for _, buf, source, _ in self._deferred:
            if source.device.type == "cpu":
                buf.copy_(source.detach())
        pending, self._side_pending = self._side_pending, set()
        for device in pending:
            self._side_streams[device].synchronize()

    def verify_deferred(self) -> None:
        """After copy_deferred, on the thread that changes the sources (so no in-place operation
        is half done): raises SnapshotChangedError, naming the tensors, if any source's version
        counter moved since the capture."""
        pending, self._deferred = self._deferred, []
        changed = [name for name, _, source, version in pending if source._version != version]
        if changed:
            shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            raise SnapshotChangedError(
                f"{shown} changed in place while the overlapped snapshot copied {'it' if len(changed) == 1 else 'them'}; "
                "only the step of an optimizer in `state` waits for the copy. Call wait() before changing "
                "parameters or optimizer state any other way (load_state_dict, copy_, an in-place update "
                "under no_grad), or turn overlap_snapshot off")

    def discard_deferred(self) -> None:
        self._deferred = []
        pending, self._side_pending = self._side_pending, set()
        for device in pending:  # the buffers may be reused by the next save: let these land first
            self._side_streams[device].synchronize()

    def sync(self) -> None:
        """Wait for the copies made on the current streams (not torch.cuda.synchronize(): that
        would wait for the side streams' deferred copies too, and for the whole device)."""
        pending, self._pending_devices = self._pending_devices, set()
        for device in pending:
            torch.cuda.current_stream(device).synchronize()


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements in memory order as one flat uint8 tensor (a view of a contiguous tensor,
    else a compact copy). torch calls a tensor whose dimensions of size 1 have any stride
    contiguous, and reshape(-1) keeps that stride (logits[:, -1] of a batch of one: shape (1,),
    stride (5,)); view(torch.uint8) refuses it, so a single element is re-viewed with stride 1."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def memory_of(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor in memory order: a read-only view of its memory when it is
    contiguous (the caller keeps `t` alive while the view is used), else of a compact copy the
    view owns. Not through `t.numpy()`: that marks the storage non-resizable for good, so after a
    save a user's `resize_` (or a framework freeing storage with `resize_(0)`) failed. 2.4 us per
    tensor against 6.6 us for numpy and 23 us for a ctypes array that holds the tensor."""
    if not t.is_contiguous():
        return memoryview(flat_bytes(t).numpy())  # type: ignore[arg-type]  # our own copy: marking it is harmless
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return _MEMORY_VIEW(t.data_ptr(), nbytes, _PYBUF_READ)  # type: ignore[no-any-return]


_MEMORY_VIEW = ctypes.pythonapi.PyMemoryView_FromMemory
_MEMORY_VIEW.restype = ctypes.py_object
_MEMORY_VIEW.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
_PYBUF_READ = 0x100


PIECE_BYTES = 16 << 20  # a tensor copied in pieces goes to the writer in pieces of about this size


def tensor_pieces(t: torch.Tensor, piece_bytes: int = PIECE_BYTES) -> Iterator[memoryview]:
    """`t`'s bytes in memory order, as memory_of gives them: one view when `t` is a contiguous CPU
    tensor, else pieces of about `piece_bytes` (at least one row) copied to host memory, so that
    a tensor read where it lives (bounded staging: on the GPU, or a non-contiguous view) never
    needs a whole-size host copy. The bytes of `t` are the row-major bytes of its rows in order,
    so the pieces concatenate to memory_of's bytes. Each piece's view owns its copy."""
    if t.device.type == "cpu" and (t.is_contiguous() or t.dim() == 0) and not t.is_neg() and not t.is_conj():
        yield memory_of(t)
        return
    if t.dim() == 0:
        t = t.reshape(1)
    rows = t.shape[0]
    row_bytes = max(1, t.numel() * t.element_size() // max(1, rows))
    step = max(1, piece_bytes // row_bytes)
    for start in range(0, rows, step):
        piece = t[start:start + step].detach().resolve_neg().resolve_conj().to("cpu").contiguous()
        yield memoryview(flat_bytes(piece).numpy())  # type: ignore[arg-type]  # our own copy: marking it is harmless
