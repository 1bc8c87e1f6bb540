"""The live tensors a load copies saved tensors into, in place: ties between entries kept, and
two different saved tensors refused when their destinations share memory.

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from distckpt.errors import IncompatibleCheckpointError
from distckpt.io import copying
from distckpt.io.staging import region_key
from distckpt.state.capture import TIES_BY_REGION, Entry


def live_ties(entries: list[Entry], saved: dict[str, Any], by_region: bool = True) -> dict[Any, Any]:
    """The restore's memo to start from: each saved tensor that a tensor or module entry restores
    in place, mapped to the live tensor it goes into. Another entry holding the same tensor (a
    parameter list or an EMA kept beside the model, `{"a": t, "b": [t]}`) then gets that live
    object back, not a copy: the tie of the saved state holds after the load. `by_region`: also a
    reference that decoded as another view of the same stored bytes (a Parameter beside the
    state_dict's plain tensor) — not for an incremental step, whose shared files hold equal bytes
    of different tensors once."""
    memo: dict[Any, Any] = {TIES_BY_REGION: by_region}
    for _, stored, live in in_place_copies(entries, saved):
        memo[id(stored)] = live
        region = region_key(stored)  # another reference to the same stored bytes decodes as its own view
        if by_region and region is not None:
            memo[("region",) + region] = live
    return memo


def in_place_copies(entries: list[Entry], saved: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(where, stored tensor, live tensor) for every copy a load makes in place (each kind's
    in_place_copies: a tensor entry, a module's parameters and buffers)."""
    for entry in entries:
        record = saved.get(entry.key)
        if isinstance(record, dict) and record.get("kind") == entry.kind:
            yield from entry.kind_spec.in_place_copies(entry, record)


def check_destinations_apart(entries: list[Entry], saved: dict[str, Any]) -> None:
    """Refuse, before anything changes, two different saved tensors whose live destinations share
    memory (`{"a": t, "b": t}` loaded from a checkpoint where a and b differed; a checkpoint of an
    untied model loaded into a tied one): the second copy would overwrite the first, and one of
    them would silently hold the other's values. Equal bytes into the same live tensor are fine."""
    by_storage: dict[tuple[Any, int], list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for where, stored, live in in_place_copies(entries, saved):
        if live.numel() == 0 or live.device.type == "meta":
            continue
        by_storage.setdefault((live.device, live.untyped_storage().data_ptr()), []).append((where, stored, live))
    for alone_or_not in by_storage.values():
        if len(alone_or_not) < 2:
            continue  # most tensors own their storage: their extents are never needed (a 20,000-tensor load paid ~4 us each)
        copies = sorted(((*copying.byte_extent(live), where, stored, live) for where, stored, live in alone_or_not),
                        key=lambda c: c[0])
        for i, (_, end, where, stored, live) in enumerate(copies):
            for other_start, _, other_where, other_stored, other_live in copies[i + 1:]:
                if other_start >= end:
                    break
                if _same_stored(stored, other_stored) or not copying.elements_overlap(live, other_live):
                    continue
                if region_key(live) == region_key(other_live) and copying.same_bits(stored, other_stored):
                    continue
                if _copies_agree([(stored, live), (other_stored, other_live)]):
                    continue  # views of one buffer saved as such (x and x.view(-1)): either order writes the same
                raise IncompatibleCheckpointError(
                    f"{where} and {other_where} share memory here but are different tensors in the checkpoint: "
                    "copying both into it would leave one holding the other's values. Untie them here (or tie "
                    "them as the run that saved did, e.g. the same parameter for embedding and output) before loading")


def _copies_agree(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether copying each stored tensor into its live view of one memory leaves every view
    holding its stored values (they agree wherever the views overlap): tried on a scratch copy
    of the bytes the views span."""
    extents = [copying.byte_extent(live) for _, live in copies]
    start, end = min(e[0] for e in extents), max(e[1] for e in extents)
    if any((live.data_ptr() - start) % live.element_size() for _, live in copies) or end - start > 1 << 30:
        return False  # views that do not fit one scratch buffer evenly (or beyond 1 GiB): kept apart
    scratch = torch.empty(end - start, dtype=torch.uint8, device=copies[0][1].device).untyped_storage()
    views = [torch.empty(0, dtype=live.dtype, device=live.device).set_(
        scratch, (live.data_ptr() - start) // live.element_size(), live.shape, live.stride()) for _, live in copies]
    for (stored, _), view in zip(copies, views):
        view.copy_(stored)
    return all(copying.same_bits(view, stored) for (stored, _), view in zip(copies, views))


def _same_stored(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (region_key(a) is not None and region_key(a) == region_key(b))
