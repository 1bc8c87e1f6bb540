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
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_HOOK_ATTR = "_distckpt_bucket_warmup"


def install_bucket_warmup(module: nn.Module) -> None:
    """Install the one-shot warm-up on a DDP module (no-op for any other module)."""
    if not isinstance(module, nn.parallel.DistributedDataParallel) or getattr(module, _HOOK_ATTR, None):
        return
    handle = module.register_forward_pre_hook(_warmup_hook, with_kwargs=True)
    setattr(module, _HOOK_ATTR, handle)


def _warmup_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if not (module.training and torch.is_grad_enabled()):
        return None  # a validation pass: wait for the first training forward
    getattr(module, _HOOK_ATTR).remove()
    setattr(module, _HOOK_ATTR, "done")
    flags = {m: m.training for m in module.modules()}
    params = [p for p in module.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    try:
        module.eval()
        output = module(*args, **kwargs)
        zero = sum((t.sum() * 0.0 for t in _tensors(output) if t.requires_grad), torch.zeros(()))
        if isinstance(zero, torch.Tensor) and zero.requires_grad:
            zero.backward()
    finally:
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
