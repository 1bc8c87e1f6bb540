"""Make a resumed DDP job reduce gradients in the same order as an uninterrupted one.

DDP builds its gradient buckets in parameter order, then rebuilds them after the first backward
in the order gradients became ready. A resumed run always starts with a fresh DDP, so without
help its first step reduces in parameter order while the uninterrupted run, at that step, uses
the rebuilt order; with three or more ranks float sums in another order differ in the last bits
(measured at 4 ranks: the losses diverged a few steps after a resume).

The fix is a one-shot forward pre-hook: before the first training forward of every fresh DDP
(on a fresh start as well as on a resume, so both runs take the same path), run the real batch
once in eval mode and back-propagate a zero loss. Eval mode draws no random numbers (dropout is
off) and updates no statistics (batch norm uses its running estimates); the gradients it leaves
are cleared. The buckets are then rebuilt before the real step, as in the uninterrupted run.

Two loops would skip the rebuild without more care, both measured at 4 ranks:
* gradient accumulation, whose first forward runs under `no_sync()`: DDP records the order only
  for a backward that syncs, so the warm-up syncs whatever context the user's forward is in
  (without it the resumed run differed from the 2nd step after the resume);
* `state` holding the bare module while the loop trains through its DDP wrapper: the wrapper is
  found among the live objects (once per load) and gets the warm-up (without it the resumed run
  differed from the 1st step after the resume).
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn

_HOOK_ATTR = "_distckpt_bucket_warmup"
_DDP = nn.parallel.DistributedDataParallel


def install_bucket_warmup(module: nn.Module) -> None:
    """Install the one-shot warm-up on the DDP module in `module`'s wrapper chain (DDP,
    torch.compile), or, for a bare module, on the live DDP modules that wrap it."""
    chain = _wrapper_chain(module)
    wrappers = [m for m in chain if isinstance(m, _DDP)] or ddp_wrappers_of(chain[-1])
    for ddp in wrappers:
        if not getattr(ddp, _HOOK_ATTR, None):
            setattr(ddp, _HOOK_ATTR, ddp.register_forward_pre_hook(_warmup_hook, with_kwargs=True))


def ddp_wrappers_of(bare: nn.Module) -> list[nn.Module]:
    """The live DDP modules wrapping `bare` (DDP keeps its module; the module does not know it).

    One pass over the garbage collector's objects (about 60 ms per million objects here), made
    once per load; nothing is searched without a process group, where DDP cannot exist.
    """
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return []
    # By type(obj), not isinstance: DDP is an ABC (Joinable), whose isinstance asks each object's
    # __class__, and some module-level objects warn when touched (torch.distributed.reduce_op's
    # FutureWarning, an error under -W error).
    return [obj for obj in gc.get_objects() if issubclass(type(obj), _DDP) and _wrapper_chain(obj)[-1] is bare]


def _wrapper_chain(module: nn.Module) -> list[nn.Module]:
    """`module`, then each module it wraps (DDP / DataParallel `.module`, torch.compile
    `._orig_mod`), down to the bare module."""
    chain = [module]
    while True:
        inner = getattr(chain[-1], "module", None) if isinstance(chain[-1], (_DDP, nn.DataParallel)) \
            else getattr(chain[-1], "_orig_mod", None)
        if not isinstance(inner, nn.Module) or len(chain) > 8:
            return chain
        chain.append(inner)


def _warmup_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if not (module.training and torch.is_grad_enabled()):
        return None  # a validation pass: wait for the first training forward
    getattr(module, _HOOK_ATTR).remove()
    setattr(module, _HOOK_ATTR, "done")
    flags = {m: m.training for m in module.modules()}
    params = [p for p in module.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    syncing = module.require_backward_grad_sync
    try:
        module.eval()
        module.require_backward_grad_sync = True  # type: ignore[assignment]  # no_sync() would skip recording the order
        output = module(*args, **kwargs)
        zero = sum((t.sum() * 0.0 for t in _tensors(output) if t.requires_grad), torch.zeros(()))
        if isinstance(zero, torch.Tensor) and zero.requires_grad:
            zero.backward()
    finally:
        module.require_backward_grad_sync = syncing
        for m, flag in flags.items():
            m.training = flag
        for p, g in zip(params, saved_grads):
            p.grad = g
    return None


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
