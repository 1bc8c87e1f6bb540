"""A module over DTensor parameters (FSDP2 `fully_shard`, tensor parallel): each rank writes its
own pieces, and any world size reads them back (a world of one gathers them whole)."""

from __future__ import annotations

from typing import Any

from torch import nn

from distckpt.errors import IncompatibleCheckpointError
from distckpt.state import sharded, validation
from distckpt.state.capture import SHARDED, Entry, Release, parameter_flags, restore_parameter_flags, unwrap_module
from distckpt.state.kinds.base import World
from distckpt.state.kinds.module import Module, ModuleLike
from distckpt.state.validation import LoadRules


class ShardedModule(ModuleLike):
    """A module over DTensor parameters (FSDP2, tensor parallel): each rank writes its pieces."""

    name, scope = "sharded_module", SHARDED
    description = "a model over DTensor parameters (FSDP2, tensor parallel): each rank's pieces"

    def matches(self, key: str, obj: Any) -> bool:
        return isinstance(obj, nn.Module) and sharded.has_dtensor_params(unwrap_module(obj).parameters())

    def capture(self, entry: Entry) -> Any:
        module = unwrap_module(entry.target)
        return {**sharded.capture_module(module), "requires_grad": parameter_flags(module)}

    def validate(self, entry: Entry, saved: Any, where: str, world: World, rules: LoadRules) -> None:
        # shapes and keys were checked while its pieces were assembled (resolve_shards)
        if entry.scope == SHARDED and not rules.allow_dtype_cast:
            validation._check_dtypes(unwrap_module(entry.target).state_dict(), saved["state_dict"], where)

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        sharded.restore_module(unwrap_module(entry.target), value)
        restore_parameter_flags(unwrap_module(entry.target), value)
        return []

    def staged_tensors(self, entry: Entry) -> list[Any]:
        return list(unwrap_module(entry.target).state_dict(keep_vars=True).values())

    def loads_into(self, entry: Entry) -> Entry | None:
        """Sharded pieces load into a sharded module and into a plain one (gathered whole)."""
        if not isinstance(entry.kind_spec, (Module, ShardedModule)):
            return None
        return Entry(entry.key, SHARDED, self.name, entry.target, entry.owner)

    def resolve_shards(self, entry: Entry, saved_state: Any, reader: "sharded.ShardReader") -> Any:
        module = unwrap_module(entry.target)
        target = sharded.target_module_state(module)
        sharded.check_module_keys(saved_state, target, module, f"state[{entry.key!r}]")
        # load_state_dict copies into the parameters: the pieces may view the files' buffers
        return {"state_dict": sharded.resolve(saved_state["state_dict"], target, reader, (entry.key,), may_alias=True),
                "training": saved_state["training"], "requires_grad": saved_state.get("requires_grad")}

    def from_imported(self, entry: Entry, state: Any) -> dict[str, Any]:
        raise _imported_into_sharded(entry)


def _imported_into_sharded(entry: Entry) -> IncompatibleCheckpointError:
    return IncompatibleCheckpointError(
        f"state[{entry.key!r}] is sharded (FSDP2) here; an imported checkpoint holds whole tensors: load "
        "them into the unsharded model first (distckpt.load_weights), then shard it")
