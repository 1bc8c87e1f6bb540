"""Make a resumed DDP job reduce gradients in the same order as an uninterrupted one.

DDP builds its gradient buckets in parameter order, then rebuilds them after the first backward
in the order gradients became ready. A resumed run always starts with a fresh DDP, so without
help its first step reduces in parameter order while the uninterrupted run, at that step, uses
the rebuilt order; with three or more ranks float sums in another order differ in the last bits
(measured at 4 ranks: the losses diverged a few steps after a resume).

The fix is a one-shot forward pre-hook: before the first training forward of every fresh DDP
(on a fresh start as well as on a resume, so both runs take the same path), run the real batch
once and back-propagate a zero loss. It runs in the loop's own (training) mode, so it uses the
parameters the real step uses: in eval mode a training-only branch (an auxiliary head) left its
gradients unreduced and plain DDP failed the real step. Whatever that forward changes is put back
afterwards: every process-wide random stream (a model that draws its own noise, dropout), the
generators the modules hold, every buffer (batch-norm statistics) and the gradients. The buckets
are then rebuilt before the real step, as in the uninterrupted run.

Two loops would skip the rebuild without more care, both measured at 4 ranks:
* gradient accumulation, whose first forward runs under `no_sync()`: DDP records the order only
  for a backward that syncs, so the warm-up syncs whatever context the user's forward is in
  (without it the resumed run differed from the 2nd step after the resume);
* `state` holding the bare module while the loop trains through its DDP wrapper: the wrapper is
  found among the live objects (once per load) and gets the warm-up (without it the resumed run
  differed from the 1st step after the resume).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from distckpt.state.capture import is_compiled_wrapper, is_fabric_wrapper
from distckpt.state.rng import capture_process_rng, restore_process_rng

log = logging.getLogger("distckpt")

_HOOK_ATTR = "_distckpt_bucket_warmup"
_DDP = nn.parallel.DistributedDataParallel


def install_bucket_warmup(module: nn.Module) -> None:
    """Install the one-shot warm-up on the DDP module in `module`'s wrapper chain (DDP,
    torch.compile), or, for a bare module, on the live DDP modules that wrap it, or, when none
    wraps it yet, on the first one that runs it (a loop that wraps the model after the load)."""
    chain = _wrapper_chain(module)
    wrappers = [m for m in chain if isinstance(m, _DDP)] or ddp_wrappers_of(chain[-1])
    for ddp in wrappers:
        _install_on(ddp)
    if not wrappers and torch.distributed.is_available() and torch.distributed.is_initialized():
        _watch_for_a_wrapper(chain[-1])


def _install_on(ddp: nn.Module) -> None:
    if not getattr(ddp, _HOOK_ATTR, None):
        setattr(ddp, _HOOK_ATTR, ddp.register_forward_pre_hook(_warmup_hook, with_kwargs=True))


# Bare modules loaded while no DDP wrapped them. A global forward pre-hook (torch calls it before
# every module's forward, and before the module's own hooks) sees the first DDP forward that runs
# one of them and warms that DDP up; each bare module's own pre-hook ends the watch at its first
# forward (by then a wrapper, if any, has been seen), and the first optimizer step ends every
# watch (a module in `state` that is never run, an EMA copy, would otherwise keep the global hook,
# and torch's slower call path for every module, for the whole run).
_watched: dict[int, tuple[weakref.ref[nn.Module], Any]] = {}
_global_hook: list[Any] = []


def _watch_for_a_wrapper(bare: nn.Module) -> None:
    if id(bare) in _watched:
        return
    own = bare.register_forward_pre_hook(_end_watch)
    key = id(bare)

    def collected(_ref: weakref.ref[nn.Module]) -> None:
        _forget(key)

    _watched[key] = (weakref.ref(bare, collected), own)
    if not _global_hook:
        _global_hook.append(nn.modules.module.register_module_forward_pre_hook(_first_ddp_forward))
        _global_hook.append(register_optimizer_step_pre_hook(_end_every_watch))


def _end_every_watch(*_: Any) -> None:
    for key in list(_watched):
        _forget(key)


def _first_ddp_forward(module: nn.Module, args: tuple[Any, ...]) -> None:
    if not issubclass(type(module), _DDP):
        return
    bare = _wrapper_chain(module)[-1]
    if id(bare) not in _watched or _watched[id(bare)][0]() is not bare:
        return
    _forget(id(bare))
    _install_on(module)  # torch calls it from the next forward on (a validation pass comes first)
    if not (module.training and torch.is_grad_enabled()) or "_pre_forward" in vars(module):
        return
    # This forward's hooks are already chosen, and a global hook gets no keyword arguments: warm
    # up from DDP's own first step instead, which sees the call's arguments as they are.
    ddp: Any = module  # DDP's own step, not an nn.Module attribute mypy knows
    original = ddp._pre_forward

    def warm_up_then_pre_forward(*inputs: Any, **kwargs: Any) -> Any:
        del ddp._pre_forward
        _warmup_hook(module, inputs, kwargs)
        return original(*inputs, **kwargs)

    ddp._pre_forward = warm_up_then_pre_forward


def _end_watch(bare: nn.Module, args: tuple[Any, ...]) -> None:
    _forget(id(bare))


def _forget(key: int) -> None:
    entry = _watched.pop(key, None)
    if entry is not None:
        entry[1].remove()
    if not _watched:
        while _global_hook:
            _global_hook.pop().remove()


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
            else getattr(chain[-1], "_orig_mod", None) if is_compiled_wrapper(chain[-1]) \
            else getattr(chain[-1], "_original_module", None) if is_fabric_wrapper(chain[-1]) else None
        if not isinstance(inner, nn.Module) or len(chain) > 8:
            return chain
        chain.append(inner)


def _warmup_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if not (module.training and torch.is_grad_enabled()):
        return None  # a validation pass: wait for the first training forward
    getattr(module, _HOOK_ATTR).remove()
    setattr(module, _HOOK_ATTR, "done")
    params = [p for p in module.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    syncing = module.require_backward_grad_sync
    streams = capture_process_rng()
    generators = [(g, g.get_state()) for g in _module_generators(module)]
    with torch.no_grad():
        buffers = [(b, b.clone()) for b in module.buffers()]
    try:
        module.require_backward_grad_sync = True  # type: ignore[assignment]  # no_sync() would skip recording the order
        output = module(*args, **kwargs)
        zero = sum((t.sum() * 0.0 for t in _tensors(output) if t.requires_grad), torch.zeros(()))
        if isinstance(zero, torch.Tensor) and zero.requires_grad:
            zero.backward()
        else:
            log.warning("the DDP warm-up found no tensor that needs gradients in the model's output (a %s): "
                        "DDP's gradient buckets are not rebuilt before the first step, so at 3 or more ranks "
                        "a resumed run may differ in the last bits; return tensors in a tuple, list, dict or "
                        "dataclass", type(output).__name__)
    finally:
        module.require_backward_grad_sync = syncing
        for p, grad in zip(params, saved_grads):
            p.grad = grad
        with torch.no_grad():
            for b, saved in buffers:
                if b.shape == saved.shape:
                    b.copy_(saved)
                else:  # resized in place by the forward (a growing cache): back to what it was
                    b.set_(saved.untyped_storage(), saved.storage_offset(), saved.shape, saved.stride())
        for generator, state in generators:
            generator.set_state(state)
        restore_process_rng(streams, "the DDP warm-up")
    return None


def _module_generators(module: nn.Module) -> list[torch.Generator]:
    """The torch.Generator objects the modules hold as attributes (a model drawing its noise
    from a private generator): the warm-up's forward advances them too."""
    found: dict[int, torch.Generator] = {}
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, torch.Generator):
                found[id(value)] = value
    return list(found.values())


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a model's output, where DDP looks for them too (a dataclass output was
    missed: no warm-up backward ran and a 4-rank resume drifted from its first step)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in _tensors(getattr(value, f.name))]
    return []
