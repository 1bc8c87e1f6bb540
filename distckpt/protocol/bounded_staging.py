"""Bounded host staging (staging_bytes=): an async save stages at most that many bytes per rank.

Without a bound an async save copies its whole payload into host buffers before save()
returns. With one, the capture copies nothing; once the payload files' trees are known, the
tensors are taken in the order the writer writes them (this rank's shard file, then rank 0's
replicated file; in each, safetensors' order) and the *last* ones, as many as fit in
`staging_bytes`, are copied into reused buffers; the rest stay where they live. save() then
returns as soon as the writer has written every file holding such a live tensor (its
`written` callback), never earlier: training cannot change a tensor the writer still reads.
The stall is the time to write the part over the bound; with the bound above the payload
there is none, and the bytes written are the same whatever the bound (the files are the same:
only where the writer reads each tensor from changes).

A tensor larger than the bound is not refused: it is written from where it lives, a GPU or a
non-contiguous tensor in pieces of at most PIECE_BYTES copied one at a time (io/staging.py
tensor_pieces), so the bound holds for any tensor size.

The per-rank file (RNG streams, per-rank entries) is encoded at capture as before, outside the
bound: it is this rank's small state, not the replicated payload.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from distckpt.io.safetensors_format import EncodedTree
from distckpt.io.staging import StagingPool
from distckpt.runtime.interrupts import Gate


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _write_order(tree: EncodedTree) -> list[tuple[str, torch.Tensor]]:
    from distckpt.io.safetensors_format import _aligned_order  # the file's order: the writer reads in it

    return _aligned_order(tree.tensors)


class BoundedStagingPool(StagingPool):
    """A StagingPool that copies at most `budget` bytes per save (see the module docstring)."""

    def __init__(self, budget: int) -> None:
        super().__init__()
        self.budget = budget
        self._drained = Gate()         # open while no file holding a live tensor is left to write
        self._pending_trees = 0
        self._lock = threading.Lock()
        self.last_staged_bytes = 0
        self.last_live_bytes = 0
        self.last_stall_s = 0.0

    def stage(self, name: str, tensor: torch.Tensor, may_defer: bool = False) -> torch.Tensor:
        """At capture: nothing is copied yet (`bound` decides, the trees known)."""
        return tensor.detach() if tensor.requires_grad else tensor

    def warm(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return []  # which tensors get buffers is decided per save, within the bound

    def bound(self, trees: list[EncodedTree]) -> None:
        """Copy the tail of the writer's order that fits in the budget; the trees holding the
        rest are marked, and `wait_drained` waits for their files. Call on the training thread,
        after the capture, before the writer starts."""
        order = [(i, tree, name, t) for i, tree in enumerate(trees) for name, t in _write_order(tree)]
        used, keep, cut = 0, set(), len(order)
        for position in range(len(order) - 1, -1, -1):
            i, tree, name, t = order[position]
            size = _nbytes(t)
            if used + size > self.budget:
                break
            key = f"{i}/{name}"
            keep.add(key)
            tree.tensors[name] = self._copy(key, t)
            used += size
            cut = position
        self.buffers = {key: buf for key, buf in self.buffers.items() if key in keep}  # within the bound
        self.sync()
        live_trees = {id(tree): tree for _, tree, _, t in order[:cut] if _nbytes(t) > 0}
        self.last_staged_bytes, self.last_live_bytes = used, sum(_nbytes(t) for *_, t in order[:cut])
        with self._lock:
            self._pending_trees = len(live_trees)
            if live_trees:
                self._drained.close()
        for tree in live_trees.values():
            tree.written = self._tree_written

    def _copy(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = self.buffers[key] = self.allocate(tensor.shape, tensor.dtype, tensor.device.type == "cuda")
        on_cuda = tensor.device.type == "cuda"
        buf.copy_(tensor, non_blocking=on_cuda)
        if on_cuda:
            self._pending_devices.add(tensor.device)
        return buf

    def _tree_written(self) -> None:
        with self._lock:
            self._pending_trees -= 1
            if self._pending_trees <= 0:
                self._drained.open()

    def release(self) -> None:
        """The save's job ended (or never started): nothing reads a live tensor any more."""
        with self._lock:
            self._pending_trees = 0
            self._drained.open()

    def wait_drained(self) -> float:
        """Block until the writer no longer reads live tensors; returns (and records) the stall."""
        t0 = time.perf_counter()
        self._drained.wait()
        self.last_stall_s = time.perf_counter() - t0
        return self.last_stall_s

    def stats(self) -> dict[str, Any]:
        return {"staged_bytes": self.last_staged_bytes, "live_bytes": self.last_live_bytes,
                "stall_s": self.last_stall_s}


def payload_trees(captured: Any) -> list[EncodedTree]:
    """A captured save's payload trees in the order this rank's writer writes them: its own
    shard file (sharded entries, split writes), then rank 0's replicated file."""
    trees = []
    if captured.own_write is not None and captured.own_write.shard_tree is not None:
        trees.append(captured.own_write.shard_tree)
    if captured.local.replicated is not None:
        trees.append(captured.local.replicated)
    return trees
