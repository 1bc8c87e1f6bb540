"""Replicated values agree across ranks: a digest of each one, compared at every save.

A replicated entry is written once, from rank 0, and every rank gets rank 0's copy back on
load. Modules and optimizers are kept equal by DDP (and checked on load against each rank's
own objects); a plain value or tensor is not — nanoGPT's `best_val_loss` is each rank's own —
and a resume then silently gives every rank rank 0's. So every rank digests each replicated
entry whose kind compares it (compared_across_ranks: values, tensors, stateful objects by their
state_dict, a user's kind by its capture) during the capture, the digests travel in the capture's agreement
(no extra exchange), and a difference is refused on every rank by save() itself, naming the
entry and the ranks. Hashing costs a pass over those tensors' bytes (xxh3: several GB/s per
core); optimizers and config (compared on load instead) are not hashed. A module's parameters
are compared by a sample of their bytes (module_digest): DDP keeps them equal, but a bare model
that each rank trains on its own data without it (a script that wraps in DDP only on GPUs) saved
rank 0's weights and resumed every rank with them, silently. A stateful
object is digested by its state_dict(), called again on every rank (rank 0 also captures it):
a ReduceLROnPlateau stepped on each rank's own loss, a user's EMA of each rank's loss, differ.

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

import struct
import weakref
from typing import Any

import numpy as np
import torch
import xxhash

from distckpt.errors import DistCkptError, UnstorableValueError
from distckpt.io.serialize import dim_order
from distckpt.io.staging import memory_of, region_key
from distckpt.state.capture import PER_RANK, REPLICATED, Entry, note_user_error, unwrap_module

MODULE_DIGEST_PREFIX = "module:"  # marks a module's digest, so a difference is explained as one
# A compared entry's top-level fields (a scheduler's state_dict keys, a dict value's keys) have digests
# of their own, under "<key><FIELD><field as shown>", so that a refusal names the field that differs
FIELD = "\x1f"
FIELDS_NAMED = 64  # per entry: the first ones of a larger dict are named, the entry still compared whole
SAMPLED_ELEMENTS = 16  # per parameter: a model trained apart differs in nearly every element
# A parameter this small is taken whole: an embedding whose few rows each rank updated on its own
# (sparse updates) differed in elements a sample of 16 missed; 64 such per save cost ~0.4 ms more.
WHOLE_PARAMETER_BYTES = 64 << 10
SAMPLED_PARAMETERS = 64  # per save after a manager's first (module_digest)
# Each module's parameter list, walked again every REWALK_SAVES saves (a walk of 20,000 parameters
# costs more than sampling 64): a parameter replaced meanwhile is missed until then, never refused.
REWALK_SAVES = 64


def replicated_digests(entries: list[Entry], gpu_modules: bool = False, save_seq: int | None = None) -> dict[str, str]:
    """Each compared replicated entry's digest (the same on every rank iff equal),
    and each replicated module's sampled digest (module_digest: every parameter, GPU ones too,
    with `gpu_modules` — a manager's first save —, else a window of them moving with `save_seq`)."""
    out = {}
    for entry in entries:
        # A sharded module's plain parameters too (a partly tensor-parallel model's head): its
        # DTensors count by name and shape only, and a head each rank trained apart was saved as
        # rank 0's and resumed on every rank, silently
        kind = entry.kind_spec
        if entry.scope != PER_RANK and kind.holds_weights:
            out[entry.key] = MODULE_DIGEST_PREFIX + module_digest(entry.target, gpu_modules, save_seq)
        if entry.scope == REPLICATED and kind.compared_across_ranks:
            if isinstance(entry.target, torch.optim.Optimizer):
                continue  # DDP keeps them equal; its state is as large as the model (checked on load)
            h = xxhash.xxh3_64()
            regions: dict[Any, list[str]] = {}
            # a user's object (a loss EMA, a curriculum counter), a scheduler, a scaler: by what it saves
            try:
                value = kind.compared_value(entry)
            except DistCkptError:
                raise
            except Exception as e:  # the user's own state_dict(), on a rank other than 0: say where
                note_user_error(e, entry.key, entry.kind)
                raise
            fields: dict[Any, str] = {}
            _feed(h, value, 0, "", regions, fields)
            # which tensors are one object comes back as saved, so it is compared too: as the
            # sets of paths that share bytes, whatever order the tree was walked in
            h.update(repr(sorted(sorted(paths) for paths in regions.values() if len(paths) > 1)).encode())
            out[entry.key] = h.hexdigest()
            for name, digest in fields.items():
                out[f"{entry.key}{FIELD}{_field_shown(name, derived=value is not entry.target)}"] = digest
    return out


def module_digest(module: torch.nn.Module, gpu: bool, save_seq: int | None = None) -> str:
    """A digest of parameters' names, dtypes and shapes and of SAMPLED_ELEMENTS of each one's
    elements, evenly spaced (every element of one up to WHOLE_PARAMETER_BYTES): equal on ranks
    whose parameters are equal (DDP's), different, all but surely, where each rank trained its own. Every parameter with `gpu` or without `save_seq` (a
    manager's first save); otherwise SAMPLED_PARAMETERS of them, a window that moves with
    `save_seq` (the same on every rank): at 7-10 us a parameter, a 2,000-parameter model cost
    every save 16 ms, and a model trained apart differs in nearly every parameter anyway.
    Buffers are left out: DDP hands rank 0's to every rank at each forward, and between forwards
    they may differ (BatchNorm's running statistics of each rank's batch) with nothing lost. A
    parameter on a GPU is sampled only with `gpu` (the copy to the host waits for the work queued
    on the device); one held apart by a wrapper that shards or flattens it (FSDP's flat
    parameters) only by its name, dtype and shape."""
    params = _parameters(unwrap_module(module), save_seq)
    chosen = params
    if not gpu and save_seq is not None and len(params) > SAMPLED_PARAMETERS:
        first = save_seq * SAMPLED_PARAMETERS % len(params)
        chosen = [params[(first + i) % len(params)] for i in range(SAMPLED_PARAMETERS)]
    h = xxhash.xxh3_64()
    h.update(str(len(params)).encode())
    samples: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for name, p in chosen:
        h.update(f"{name}{p.dtype}{tuple(p.shape)}".encode())
        if (type(p) not in (torch.Tensor, torch.nn.Parameter) or p.layout != torch.strided or not p.numel()
                or p.is_quantized or p.device.type not in ("cpu", "cuda") or (p.device.type == "cuda" and not gpu)
                or not p.is_contiguous() or "_flat_param" in name):
            continue
        flat = p.detach().view(-1)
        small = flat.numel() * flat.element_size() <= WHOLE_PARAMETER_BYTES
        samples.setdefault((p.dtype, p.device), []).append(
            flat if small else flat[::max(1, flat.numel() // SAMPLED_ELEMENTS)][:SAMPLED_ELEMENTS])
    for (dtype, _), pieces in sorted(samples.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        sample = torch.cat(pieces).cpu().contiguous()  # held while its memory is read
        h.update(str(dtype).encode())
        h.update(memory_of(sample))
    return h.hexdigest()


_WALKED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, list[tuple[str, torch.Tensor]]]] = \
    weakref.WeakKeyDictionary()


def _parameters(module: torch.nn.Module, save_seq: int | None) -> list[tuple[str, torch.Tensor]]:
    walked = _WALKED.get(module)
    if save_seq is None or walked is None or not 0 <= save_seq - walked[0] < REWALK_SAVES:
        params: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
        if save_seq is not None:
            _WALKED[module] = (save_seq, params)
        return params
    return walked[1]


def _field_shown(name: Any, derived: bool) -> str:
    """A top-level field as a message names it after `state[key]`: `.metric` for a key of what an
    object's state_dict() returns (`derived`, its attribute as a rule), `['best']` for a dict's own key."""
    return f".{name}" if derived and isinstance(name, str) and name.isidentifier() else f"[{name!r}]"


def _feed(h: Any, value: Any, depth: int, path: str, regions: dict[Any, list[str]],
          fields: dict[Any, str] | None = None) -> None:
    """`path` names where `value` sits in the entry; `regions` collects each tensor's path by the
    bytes it views; `fields`, given for the entry's top, collects each of its dict's items' digest."""
    kind = type(value)
    h.update(kind.__name__.encode() + b"\x00")
    if depth > 256:  # the encoder refuses such a tree on rank 0, naming it
        return
    if value is None or kind is bool:
        h.update(b"1" if value else b"0")
    elif isinstance(value, int):
        h.update(hex(int(value)).encode())  # hex: no 4,300-digit limit as str() has
    elif isinstance(value, float):
        h.update(struct.pack("<d", value))  # by its bits: -0.0 and NaN payloads as saved
    elif isinstance(value, str):
        h.update(value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, torch.Tensor):
        _feed_tensor(h, value)
        region = region_key(value)
        if region is not None:
            regions.setdefault(region, []).append(path)
    elif isinstance(value, np.generic):
        h.update(str(value.dtype).encode() + value.tobytes())
    elif isinstance(value, dict):
        pairs = []
        for k, v in value.items():
            pair = xxhash.xxh3_64()
            _feed(pair, k, depth + 1, path, regions)
            _feed(pair, v, depth + 1, f"{path}[{type(k).__name__}:{k!r}]", regions)
            pairs.append(pair.digest())
            if fields is not None and isinstance(k, (str, int)) and len(fields) < FIELDS_NAMED:
                fields[k] = pair.hexdigest()
        # a plain dict in any order: one built from a set (string hashes are seeded per process)
        # holds the same items in another order on each rank; an OrderedDict's order is its value
        for digest in (pairs if kind is not dict else sorted(pairs)):
            h.update(digest)
    elif isinstance(value, (list, tuple)):
        h.update(str(len(value)).encode())
        for i, v in enumerate(value):
            _feed(h, v, depth + 1, f"{path}[{i}]", regions)
    # anything else is refused at save by the encoder (rank 0 names it): its type is fed above


def _feed_tensor(h: Any, t: torch.Tensor) -> None:
    # what a load gives back besides the bytes: requires_grad and the dimension order
    h.update(f"{t.dtype}{tuple(t.shape)}{t.layout}{t.device.type}{t.requires_grad}{dim_order(t)}".encode())
    if t.layout != torch.strided or t.is_quantized or t.is_nested or t.device.type == "meta" or not t.numel():
        return  # refused by the encoder, or nothing to compare
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return  # a subclass (DTensor): refused or sharded elsewhere
    data = t.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    h.update(memory_of(data))


def _fields_that_differ(key: str, changed: list[str]) -> str:
    fields = [f"state[{key!r}]{name[len(key) + 1:]}" for name in changed if name.startswith(f"{key}{FIELD}")]
    if not fields:
        return ""
    more = f" and {len(fields) - 4} more" if len(fields) > 4 else ""
    return f" in {', '.join(fields[:4])}{more}"


def check_replicated_agree(digests: list[dict[str, str]], what: str) -> None:
    """Every rank runs this on the same gathered digests, so every rank raises the same error."""
    first = digests[0]
    changed = sorted({key for d in digests[1:] for key in set(d) | set(first) if d.get(key) != first.get(key)})
    differing = [key for key in changed if FIELD not in key]
    if not differing:
        return
    ranks = {key: [r for r, d in enumerate(digests) if d.get(key) != first.get(key)] for key in differing}
    named = "; ".join(f"state[{key!r}] differs on rank(s) {ranks[key]} from rank 0's{_fields_that_differ(key, changed)}"
                      for key in differing[:8])
    modules = [key for key in differing if str(first.get(key, "")).startswith(MODULE_DIGEST_PREFIX)]
    why = (f" {', '.join(f'state[{k!r}]' for k in modules[:4])}: a module whose parameters differ between "
           "ranks — trained by each rank on its own data without DistributedDataParallel (or another "
           "all-reduce of its gradients)? Wrap it in DDP, or in distckpt.per_rank(...) if each rank keeps "
           "its own model." if modules else "")
    raise UnstorableValueError(
        f"{what}: {named}. A replicated entry is written once, from rank 0, and every rank would get rank "
        "0's value back on resume. Wrap values each rank keeps for itself in distckpt.per_rank(...) (or "
        f"make them equal, e.g. by an all_reduce) before saving.{why}")
