"""The registered entry kinds, in the order they are asked: the first that matches an object is
its kind. Specific kinds come first, in the order they were registered; generic ones (anything
with state_dict, any tensor, any value) after them. A saved record names its kind, found again
with `kind_named`.

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

import threading
from typing import Any, TypeVar

from distckpt.errors import ConfigError
from distckpt.runtime.plugins import KINDS_GROUP, load_plugins
from distckpt.state.kinds.base import REPLICATED, Kind

K = TypeVar("K", bound=type[Kind])

_lock = threading.Lock()
_ordered: tuple[Kind, ...] = ()       # in matching order
_by_name: dict[str, Kind] = {}
_unknown: dict[str, Kind] = {}
_plugins_loaded = False


def register_kind(cls: K, *, before: type[Kind] | None = None) -> K:
    """Register an entry kind (a subclass of Kind with a `name` of its own): from now on `state`
    entries it matches are of it, and records saved with its name are read back with it. It is
    asked before every generic kind, after every specific kind registered before it, or right
    before the kind class `before`. Usable as a class decorator; returns the class."""
    global _ordered
    if not (isinstance(cls, type) and issubclass(cls, Kind)):
        raise ConfigError(f"register_kind({cls!r}): an entry kind is a subclass of distckpt's Kind")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"register_kind({cls.__name__}): set `name`, the kind's name in checkpoints (a str)")
    if cls.scope == REPLICATED and not cls.compared_across_ranks and not cls.not_compared_because:
        raise ConfigError(
            f"register_kind({cls.__name__}): a replicated kind's entries are compared across ranks at every save "
            "(rank 0's copy is the one saved and every rank gets it back); set `not_compared_because` to how its "
            "ranks' agreement is checked instead, or leave `compared_across_ranks` on")
    with _lock:
        taken = _by_name.get(name)
        if taken is not None:
            raise ConfigError(f"register_kind({cls.__name__}): the name {name!r} is {type(taken).__name__}'s; a "
                              "kind's name is written into checkpoints and must be its own")
        kinds, instance = list(_ordered), cls()
        kinds.insert(_position(kinds, cls, before), instance)
        _ordered = tuple(kinds)
        _by_name[name] = instance
        _unknown.pop(name, None)
    return cls


def unregister_kind(cls: type[Kind]) -> None:
    """Take a kind registered with register_kind out again (records of it read as unknown)."""
    global _ordered
    with _lock:
        instance = _by_name.get(getattr(cls, "name", ""))
        if instance is None or type(instance) is not cls:
            raise ConfigError(f"unregister_kind({getattr(cls, '__name__', cls)!r}): not a registered kind")
        _ordered = tuple(k for k in _ordered if k is not instance)
        del _by_name[cls.name]


def _position(kinds: list[Kind], cls: type[Kind], before: type[Kind] | None) -> int:
    if before is not None:
        found = next((i for i, k in enumerate(kinds) if type(k) is before), None)
        if found is None:
            raise ConfigError(f"register_kind({cls.__name__}, before={before.__name__}): "
                              f"{before.__name__} is not registered")
        return found
    if cls.generic:
        return len(kinds)
    return next((i for i, k in enumerate(kinds) if k.generic), len(kinds))


def _load_kind_plugins() -> None:
    """On the first lookup, the kinds of the entry point group ``distckpt.kinds``
    (runtime/plugins.py): a module that registers its kinds when imported, or a Kind class,
    registered here. A kind saved by a job is then read back by name in every process (the
    command line included) with no import by hand."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True  # before the imports: a plugin's own lookups see the kinds so far
    try:
        for plugin in load_plugins(KINDS_GROUP):
            if isinstance(plugin, type) and issubclass(plugin, Kind) and type(_by_name.get(plugin.name)) is not plugin:
                register_kind(plugin)
    except BaseException:
        _plugins_loaded = False  # asked again, the broken plugin is said again
        raise


def registered_kinds() -> tuple[Kind, ...]:
    """Every registered kind, in the order they are asked."""
    _load_kind_plugins()
    return _ordered


def matching_kind(key: str, obj: Any) -> Kind:
    """The kind of `obj` under `state[key]`: the first registered kind that matches it."""
    _load_kind_plugins()
    for kind in _ordered:
        if kind.matches(key, obj):
            return kind
    raise ConfigError(f"state[{key!r}]: no entry kind takes a {type(obj).__name__}")  # the built-in `value` takes all


def kind_named(name: Any) -> Kind:
    """The kind a saved record names. A name no registered kind has (a kind registered by the
    job that saved and not here, a record from a later version) gives a kind that declares
    nothing and is shown by that name: a live entry of it cannot be restored (its kind differs)."""
    _load_kind_plugins()
    kind = _by_name.get(name) if isinstance(name, str) else None
    if kind is not None:
        return kind
    shown = name if isinstance(name, str) else repr(name)
    with _lock:
        if shown not in _unknown:
            _unknown[shown] = type(f"Unknown({shown})", (UnknownKind,), {"name": shown})()
        return _unknown[shown]


class UnknownKind(Kind):
    """A saved kind this process does not know: shown by its name, holding nothing it declares."""

    name = "unknown"
    compared_across_ranks = False
    not_compared_because = "never a live entry: only read from a checkpoint"
