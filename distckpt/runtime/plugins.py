"""Plugins found through Python entry points: a distribution installed beside distckpt declares
a storage backend (group ``distckpt.backends``) or an entry kind (group ``distckpt.kinds``) in
its pyproject.toml, and every process — a training job, the command line — finds it without
importing it by hand::

    [project.entry-points."distckpt.backends"]
    mystore = "mystore_backend"              # a module that registers its spec when imported

The registries load their group on their first lookup (storage/registry.py, state/kinds/registry.py).

This module never imports torch.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Any

from distckpt.errors import ConfigError

BACKENDS_GROUP = "distckpt.backends"
KINDS_GROUP = "distckpt.kinds"


def load_plugins(group: str) -> list[Any]:
    """Import every entry point of `group`, in name order, and return what each names (a module,
    or the object after its colon). ConfigError naming the plugin, its distribution and the import
    error when one fails: a plugin installed but broken is never skipped in silence (a checkpoint
    would then be written, or read, without the backend or kind the job counts on)."""
    unique = {(ep.name, ep.value): ep for ep in entry_points(group=group)}  # a path listed twice
    loaded = []
    for _, ep in sorted(unique.items()):
        try:
            loaded.append(ep.load())
        except Exception as e:
            raise ConfigError(f"the {group} plugin {ep.name!r} = {ep.value!r}{_declared_by(ep)} failed to import: "
                              f"{type(e).__name__}: {e}. Repair or reinstall that distribution, or uninstall it "
                              "if it is not needed") from e
    return loaded


def _declared_by(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    name = getattr(dist, "name", None) if dist is not None else None
    return f" (declared by the distribution {name!r})" if name else ""
