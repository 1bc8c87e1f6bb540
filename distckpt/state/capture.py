"""Entries of `state` and the helpers their kinds (kinds/) compose to capture and restore them.

Entries are classified once, by their type (the registered kinds, kinds/registry.py):

* per rank by nature: `torch.Generator`, NumPy `Generator` and `RandomState`, Python
  `random.Random`, samplers, data loaders with
  `state_dict` (torchdata's `StatefulDataLoader`), and anything wrapped in :func:`per_rank`;
* sharded (every rank writes its own pieces, sharded.py): modules whose parameters are DTensors
  (FSDP2 ``fully_shard``, tensor parallel) and the optimizers over them;
* replicated (written once, from rank 0): modules (with every submodule's `training` flag),
  optimizers, schedulers and anything else with `state_dict`/`load_state_dict`, tensors,
  plain values, and `config` (compared with the resuming run, never overwritten).

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import numpy as np
import torch
from torch import nn

from distckpt.config import arguments_checked
from distckpt.errors import (
    CheckpointWarning,
    ConfigError,
    IncompatibleCheckpointError,
    warn,
)
from distckpt.io.copying import PageRelease, copy_released, same_bits
from distckpt.io.serialize import key_path
from distckpt.io.staging import region_key
from distckpt.state import sharded

if TYPE_CHECKING:
    from distckpt.state.kinds.base import Kind


REPLICATED = "replicated"
PER_RANK = "per_rank"
SHARDED = sharded.SHARDED
CONFIG_KEY = "config"



@dataclass(eq=False)
class PerRank:
    """Marks a `state` entry as per rank: every rank saves and restores its own copy. `obj` may
    be reassigned between saves (`state["best"].obj = loss`): each save reads it afresh.
    `reshard`: how its values map to another world size (world_size_policy="elastic")."""

    obj: Any
    reshard: "Callable[[list[Any], int], Sequence[Any]] | None" = None


@arguments_checked
def per_rank(obj: Any, *, reshard: "Callable[[list[Any], int], Sequence[Any]] | None" = None) -> PerRank:
    """Mark `obj` as per rank: each rank stores its own copy instead of rank 0's.

    `reshard(old_values, new_world_size) -> new_values`: under world_size_policy="elastic" at
    another world size, called on every new rank with every old rank's saved value (in old rank
    order; a plain value or tensor as it is, an object with state_dict as its state_dict) and
    returns one value per new rank, of the same form; each rank restores its own. Without it, an
    elastic resume at another world size refuses the entry (docs: guides/elastic.md)."""
    if isinstance(obj, PerRank):
        raise ConfigError("per_rank(per_rank(...)): the value is marked per rank once; pass the inner object")
    if reshard is not None and not callable(reshard):
        raise ConfigError(f"per_rank(..., reshard={type(reshard).__name__}): must be a function "
                          "(old_values: list, new_world_size: int) -> list of new values, or None")
    return PerRank(obj, reshard)


@dataclass(frozen=True)
class Entry:
    key: str
    scope: str   # REPLICATED, PER_RANK or SHARDED
    kind: str    # its kind's name, as checkpoints hold it (kinds/: module, loader, value, ...)
    target: Any  # the object state is captured from and restored into
    owner: Any = None  # an optimizer's module (sharded state is named by the module's parameters)
    reshard: Any = None  # per_rank(obj, reshard=fn): its values at another world size (elastic.py)

    @property
    def kind_spec(self) -> "Kind":
        """The entry's kind: what it declares, how it is captured and restored (kinds/)."""
        return _kind_named(self.kind)


def _kind_named(name: str) -> "Kind":
    # The kinds sit above this module (they compose its helpers): found on first use
    from distckpt.state.kinds import kind_named

    return kind_named(name)


def note_user_error(error: BaseException, key: str, kind: str) -> None:
    """Name the entry on an exception out of the user's own state_dict() (Python >= 3.11 notes;
    they travel in the message the other ranks get)."""
    if hasattr(error, "add_note"):
        error.add_note(f"distckpt: raised while capturing state[{key!r}] ({kind} entry) for a save; nothing of "
                       "this save was written")


def _has_state_dict(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def unwrap_module(module: nn.Module) -> nn.Module:
    """The bare module under DDP / DataParallel / torch.compile / Lightning Fabric wrappers."""
    while True:
        if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            module = module.module
        elif is_compiled_wrapper(module):
            module = cast(nn.Module, module._orig_mod)
        elif is_fabric_wrapper(module):
            module = cast(nn.Module, module._original_module)
        else:
            return module


def is_compiled_wrapper(module: nn.Module) -> bool:
    """torch.compile's wrapper (OptimizedModule), by its class: a model with a child of its own
    named `_orig_mod` is no wrapper (taken for one, only that child was saved, silently).
    By name, since importing torch._dynamo to compare classes costs seconds."""
    return has_class_named(module, "OptimizedModule", "torch._dynamo") \
        and isinstance(getattr(module, "_orig_mod", None), nn.Module)


def is_fabric_wrapper(module: nn.Module) -> bool:
    """Lightning Fabric's wrapper (`fabric.setup(model)` returns a _FabricModule): the user's
    module is its `_original_module`, its `_forward_module` that module's DDP wrapper. Taken as a
    module of its own, its buffers were named through both paths while its state_dict() is the
    inner module's: every save committed and no load could pass the buffer check (BatchNorm).
    By name: Lightning need not be installed."""
    return has_class_named(module, "_FabricModule", *FABRIC_MODULES) \
        and isinstance(getattr(module, "_original_module", None), nn.Module)


FABRIC_MODULES = ("lightning_fabric.", "lightning.fabric.")  # where Lightning Fabric's classes live


def has_class_named(obj: Any, name: str, *modules: str) -> bool:
    """Whether `obj`'s class, or a base of it, is `name` from a module under one of `modules`:
    a third-party class told apart without importing its package (absent, or seconds to import)."""
    return any(c.__name__ == name and c.__module__.startswith(modules) for c in type(obj).__mro__)


# -- capture ----------------------------------------------------------------------------------

def _capture_module(module: nn.Module) -> dict[str, Any]:
    bare = unwrap_module(module)
    sd = bare.state_dict()
    metadata = getattr(sd, "_metadata", None) or {}
    return {"state_dict": dict(sd),
            "metadata": {k: dict(v) for k, v in metadata.items()},
            "training": {name: m.training for name, m in bare.named_modules()},
            "requires_grad": parameter_flags(bare)}


def parameter_flags(module: nn.Module) -> dict[str, bool]:
    """Each parameter's requires_grad: a layer frozen mid-run (requires_grad_(False)) is part of
    the run's state, and a resumed job builds every parameter trainable again (the resumed run
    trained the frozen layer from the first step after the resume)."""
    return {name: p.requires_grad for name, p in module.named_parameters()}


def restore_parameter_flags(module: nn.Module, saved: dict[str, Any]) -> None:
    flags = saved.get("requires_grad")
    if not isinstance(flags, dict):
        return  # written before the flags were recorded, or imported: the module keeps its own
    for name, p in module.named_parameters():
        if name in flags and p.requires_grad != flags[name]:
            p.requires_grad_(bool(flags[name]))


def _capture_plain(value: Any) -> Any:
    """A shallow copy of a top-level dict (later writes to the live dict do not reach a save in
    flight) of the same type: an OrderedDict or a Counter stays one, and another dict subclass
    (defaultdict) reaches the encoder as itself and is refused there, naming its key."""
    kind = type(value)
    if kind is dict or kind is OrderedDict or kind is Counter:
        return kind(value)
    return value


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers `module.state_dict()` holds, by their state_dict names (DTensors excluded)."""
    out = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, buf in sub._buffers.items():
            if buf is not None and name not in sub._non_persistent_buffers_set and not sharded.is_dtensor(buf):
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def use_rank_buffers(saved_entries: dict[str, Any], buffers: dict[str, Any], where: str) -> None:
    """Put this rank's own buffers into the saved module states (checked: names, shapes, dtypes)."""
    for key, own in buffers.items():
        saved = saved_entries.get(key)
        state_dict = saved.get("state", {}).get("state_dict") if isinstance(saved, dict) else None
        if not isinstance(state_dict, dict) or not isinstance(own, dict):
            raise IncompatibleCheckpointError(f"{where}: per-rank buffers of {key!r} without its module state")
        for name, tensor in own.items():
            stored = state_dict.get(name)
            if not isinstance(stored, torch.Tensor) or not isinstance(tensor, torch.Tensor) \
                    or stored.shape != tensor.shape or stored.dtype != tensor.dtype:
                raise IncompatibleCheckpointError(
                    f"{where}: this rank's buffer {key}.{name} does not match the module state saved with it")
            state_dict[name] = tensor


# -- restore ----------------------------------------------------------------------------------

Release = PageRelease  # lets go of the file pages behind source tensors; runs a phase's copies


# In a restore's memo: True where one stored tensor is one range of its file (not an incremental
# step, whose shared files hold equal bytes of different tensors once), so that references
# decoded on the same bytes are one tensor (kinds.live_ties sets it).
TIES_BY_REGION = ("ties by region",)


def _owned(value: Any, memo: dict[Any, Any] | None = None, release: Release | None = None) -> Any:
    """`value` with every tensor copied into its own memory, keeping what the tree said: the
    Parameter type, requires_grad, the layout, and ties (a tensor in two places stays one; one
    that a tensor or module entry restores in place is that live tensor: kinds.live_ties)."""
    memo = {} if memo is None else memo
    if id(value) in memo:
        return _as_saved_reference(memo[id(value)], value, memo)
    if sharded.is_dtensor(value):
        return value  # assembled for this load: already its own memory
    if isinstance(value, torch.Tensor):
        region = region_key(value)
        if region is not None and ("region",) + region in memo:
            return _as_saved_reference(memo[("region",) + region], value, memo)
        copy = (value.detach() if value.requires_grad else value).clone()
        if release is not None:
            release(value)
        if type(value) is nn.Parameter:
            copy = nn.Parameter(copy, requires_grad=value.requires_grad)
        elif value.requires_grad:
            copy.requires_grad_(True)
        memo[id(value)] = copy
        if region is not None and value.numel() and memo.get(TIES_BY_REGION):
            # The decoder makes one object per stored tensor and flags: a Parameter and its
            # .detach(), saved once, are two objects on the same bytes; one copy serves both
            # (not empty tensors: two separate ones can sit at one offset of the file).
            memo.setdefault(("region",) + region, copy)
        return copy
    out: Any
    if isinstance(value, dict):
        out = type(value)()  # filled item by item: Counter(pairs) would count the pairs
        for k, v in value.items():
            out[k] = _owned(v, memo, release)
    elif isinstance(value, list):
        out = [_owned(v, memo, release) for v in value]
    elif isinstance(value, tuple) and type(value) is tuple:
        out = tuple(_owned(v, memo, release) for v in value)
    else:
        return value
    memo[id(value)] = out
    return out


def _as_saved_reference(live: Any, value: Any, memo: dict[Any, Any]) -> Any:
    """What a reference already met comes back as: for a tensor tied to one a load restores in
    place (kinds.live_ties), the live tensor itself when the saved reference has its type and
    requires_grad, else one tensor (per saved object) on the live memory with the saved type and
    flag: `{"w": lin.weight.detach()}` beside the model came back as the model's Parameter,
    requires_grad and all."""
    if not (isinstance(value, torch.Tensor) and isinstance(live, torch.Tensor)) or \
            (type(live) is type(value) and live.requires_grad == value.requires_grad):
        return live
    key = ("as saved", id(value))
    if key not in memo:
        alias = live.detach()  # the same memory: the tie with the live tensor holds
        if type(value) is nn.Parameter:
            alias = nn.Parameter(alias, requires_grad=value.requires_grad)
        elif value.requires_grad:
            alias.requires_grad_(True)
        memo[key] = alias
    return memo[key]


def _restore_module(module: nn.Module, saved: dict[str, Any], release: Release | None = None,
                    where: str = "a module") -> None:
    from collections import OrderedDict

    sd = OrderedDict(saved["state_dict"])
    copied_all = release is not None and not has_own_load_logic(module) and _copy_into_live(module, sd, release, where)
    if not (copied_all and loads_by_copy_alone(module)):
        sd._metadata = OrderedDict((k, dict(v)) for k, v in saved["metadata"].items())  # type: ignore[attr-defined]
        module.load_state_dict(sd, strict=True)
    restore_parameter_flags(module, saved)
    flags = saved["training"]
    if flags is None:
        return  # imported from a file that never recorded them: the module keeps its own
    for name, sub in module.named_modules():
        sub.training = bool(flags[name])  # set each flag itself: .train() would overwrite children


def _copy_into_live(module: nn.Module, sd: dict[str, Any], release: Release, where: str) -> bool:
    """Copy each saved tensor into the live parameter or buffer it restores, letting go of its
    file pages as it goes, and hand load_state_dict the live tensor itself (its copy of a tensor
    onto itself returns at once). Only for modules torch's own code loads (checked completely
    before: keys, shapes, dtypes), so this cannot fail half-way either. True when every entry of
    the live state dict was given its own tensor."""
    live = module.state_dict(keep_vars=True)
    for key, value in sd.items():
        target = live.get(key)
        if (isinstance(value, torch.Tensor) and isinstance(target, torch.Tensor) and target is not value
                and not sharded.is_dtensor(target) and target.device.type == "cpu" and value.device.type == "cpu"
                and target.shape == value.shape and target.dtype == value.dtype):
            copy_released(target, value, release, f"{where}.{key}")
            sd[key] = target
    return sd.keys() == live.keys() and all(sd[key] is live[key] for key in live)


# torch's own _load_from_state_dict of these does nothing but copy each tensor into its parameter
# or buffer once every key is present (_NormBase adds num_batches_tracked when it is missing).
_COPYING_LOADERS = (nn.Module._load_from_state_dict, nn.modules.batchnorm._NormBase._load_from_state_dict)


def loads_by_copy_alone(module: nn.Module) -> bool:
    """Whether module.load_state_dict, given every live tensor itself (_copy_into_live), would do
    nothing at all: no module saves or loads anything but its parameters and buffers, no hooks.
    Then it is skipped: torch filters the state dict by prefix once per child, so its cost grows
    with the square of the direct children (4,000 children: 2.2 s for a no-op)."""
    for m in module.modules():
        kind = type(m)
        if (kind._load_from_state_dict not in _COPYING_LOADERS
                or kind._save_to_state_dict is not nn.Module._save_to_state_dict
                or kind.load_state_dict is not nn.Module.load_state_dict
                or kind.get_extra_state is not nn.Module.get_extra_state
                or m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks or m._state_dict_hooks
                or m._state_dict_pre_hooks):
            return False
    return True


def has_own_load_logic(module: nn.Module) -> bool:
    """Whether loading `module` runs code beyond torch's own (load_state_dict hooks, its own
    _load_from_state_dict, load_state_dict or set_extra_state): such code may transform what it is
    given, or refuse it."""
    for m in module.modules():
        hooks = [*m._load_state_dict_pre_hooks.values(), *m._load_state_dict_post_hooks.values()]
        if any(not _is_fsdp2_hook(hook) for hook in hooks):
            return True
        for method in ("_load_from_state_dict", "load_state_dict", "set_extra_state"):
            defined_in = getattr(type(m), method).__module__ or ""
            if not defined_in.startswith("torch."):
                return True
    return False


# FSDP2's own load hooks: one puts the module's parameters in their sharded form (a load puts
# every FSDP2 module in it first, sharded.reshard_fully_sharded), one re-pads a local piece that
# load_state_dict(assign=True) replaced (a copy in place keeps it). Neither transforms nor refuses
# what is loaded; counted as load logic of the module's own, they made every FSDP2 load copy the
# whole model aside first for its undo: 0.27 of a 0.68 s load of 256 MiB at 2 ranks
# (bench/profile_sharded.py --what load).
_FSDP2_MODULES = "torch.distributed.fsdp._fully_shard."


def _is_fsdp2_hook(hook: Any) -> bool:
    fn = getattr(hook, "hook", hook)  # a module's pre-hook comes wrapped (torch's _WrappedHook)
    return (getattr(fn, "__module__", None) or "").startswith(_FSDP2_MODULES)


IMPORTED = "imported"  # the kind of an imported torch.save / DCP checkpoint's entries (kinds/imported.py)


def config_differences(saved: Any, current: Any, path: tuple[Any, ...] = ("config",)) -> list[str]:
    """Key-by-key differences between the checkpoint's config and this run's."""
    if isinstance(saved, dict) and isinstance(current, dict) and type(saved) is type(current):
        out: list[str] = []
        if isinstance(saved, OrderedDict) and set(saved) == set(current) and list(saved) != list(current):
            out.append(f"{key_path(path)}: keys in the order {list(saved)} in the checkpoint, {list(current)} here")
        for k in list(saved) + [k for k in current if k not in saved]:
            if k not in current:
                out.append(f"{key_path(path + (k,))}: {_shown(saved[k])} in the checkpoint, absent here")
            elif k not in saved:
                out.append(f"{key_path(path + (k,))}: absent in the checkpoint, {_shown(current[k])} here")
            else:
                out.extend(config_differences(saved[k], current[k], path + (k,)))
        return out
    same = same_value(saved, current)
    return [] if same else [f"{key_path(path)}: {_shown(saved)} in the checkpoint, {_shown(current)} here"]


def _shown(value: Any) -> str:
    """repr for a config-difference line; a repr that raises (a Counter's sorts its counts: a
    NumPy bool beside a 2**63 count raised OverflowError and failed the load) is not the load's
    business."""
    try:
        return repr(value)
    except Exception as e:  # noqa: BLE001  (any user __repr__)
        return f"<{type(value).__name__} whose repr failed: {type(e).__name__}>"


def same_value(a: Any, b: Any) -> bool:
    """Equal as a load gives them back: by type and bits (1 and True and 1.0 differ, as do 0.0
    and -0.0, a list and a tuple; an unchanged NaN, NumPy's included, is the same), tensors by
    Parameter or not, requires_grad, dtype, shape and bits (as `distckpt diff` compares them)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (float, np.floating, np.complexfloating)):
        return bool(np.asarray(a).tobytes() == np.asarray(b).tobytes())
    if isinstance(a, torch.Tensor):
        return a.requires_grad == b.requires_grad and same_bits(a.detach(), b.detach())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same_value(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False


def warn_extra_entries(saved_keys: set[str], state_keys: set[str], where: str) -> None:
    extra = sorted(saved_keys - state_keys)
    if extra:
        message = f"{where}: entries {extra} are in the checkpoint but not in `state`; they were not restored"
        warn(message, CheckpointWarning)
