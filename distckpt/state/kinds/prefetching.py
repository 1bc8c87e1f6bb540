"""A prefetching wrapper over a data loader in `state`: the loader's position and the batches the
wrapper holds ahead of the loop, per rank.

A wrapper that takes batches from its loader before the loop asks for them (timm's PrefetchLoader
moves the next batch to the device and normalizes it, random erasing included, while the loop
trains on the current one) leaves its loader's position ahead of what the loop consumed: a resume
from that position skipped the held batches, silently. A wrapper that can say which batches it
holds, and give restored ones first, is saved whole, by this protocol:

* `wrapper.loader`: the loader it iterates (a torchdata StatefulDataLoader, saved as a loader);
* `wrapper.distckpt_held_batches() -> list`: the batches taken from `loader` and not yet given to
  the loop, oldest first (tensors and plain values; mappings are saved as dicts);
* `wrapper.distckpt_pass_ending() -> bool`: whether it has given its pass's last batch and not ended
  the pass yet (the loop holds that batch now);
* `wrapper.distckpt_give_first(batches: list, end_pass: bool) -> None`: after a restore, the batches
  its next pass gives before taking any from `loader`, or (`end_pass`) that its next pass ends at
  once, as the saved one did at its next batch (an empty list and False: nothing; a load that
  fails gives it that).

distckpt.integrations.timm.PrefetchLoader is such a wrapper. Their augmentation was drawn before the
save, so the held batches are saved as they are, not drawn again.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from distckpt.errors import IncompatibleCheckpointError, UnstorableValueError
from distckpt.state.capture import Entry, Release
from distckpt.state.epoch_record import is_stateful_dataloader
from distckpt.state.kinds.accelerate_loader import plain_batch
from distckpt.state.kinds.loader import Loader
from distckpt.state.undo import Undo

HELD = "distckpt_held_batches"
ENDING = "distckpt_pass_ending"
GIVE_FIRST = "distckpt_give_first"


class PrefetchingLoader(Loader):
    """A wrapper holding batches ahead of its loader (the protocol above): the loader's position and
    the held batches."""

    name = "prefetching_loader"
    description = ("a wrapper holding batches ahead of its loader (timm's prefetcher through "
                   "distckpt.integrations.timm): the loader's position and the held batches, per rank")

    def matches(self, key: str, obj: Any) -> bool:
        if not all(callable(getattr(obj, name, None)) for name in (HELD, ENDING, GIVE_FIRST)):
            return False
        inner = getattr(obj, "loader", None)
        if not isinstance(inner, torch.utils.data.DataLoader) or not is_stateful_dataloader(inner):
            raise UnstorableValueError(
                f"state[{key!r}] holds batches ahead of its loader, a {type(inner).__name__} that cannot say where it "
                "is: build the wrapper over a torchdata StatefulDataLoader (distckpt.integrations.timm.create_loader "
                "does)")
        return True

    def observe(self, target: Any) -> None:
        super().observe(target.loader)

    def prepare_capture(self, entry: Entry) -> None:
        super().prepare_capture(_inner(entry))

    def capture(self, entry: Entry) -> Any:
        saved = super().capture(_inner(entry))
        held, ending = getattr(entry.target, HELD)(), getattr(entry.target, ENDING)()
        return {"loader": saved, "held": [plain_batch(batch) for batch in held], "ending": bool(ending)}

    def validate(self, entry: Entry, saved: Any, where: str, world: Any, rules: Any) -> None:
        if not isinstance(saved, dict) or not {"loader", "held", "ending"} <= set(saved) \
                or not isinstance(saved["held"], list) or type(saved["ending"]) is not bool:
            raise IncompatibleCheckpointError(f"{where}: not the record of a prefetching loader")
        super().validate(_inner(entry), saved["loader"], where, world, rules)

    def restore(self, entry: Entry, value: Any, state: dict[str, Any], release: Release | None) -> list[str]:
        notes = super().restore(_inner(entry), value["loader"], state, release)
        getattr(entry.target, GIVE_FIRST)(list(value["held"]), value["ending"])
        return notes

    def undo(self, entry: Entry, state: dict[str, Any]) -> Undo:
        inner_undo = super().undo(_inner(entry), state)

        def put_back() -> None:
            inner_undo()
            getattr(entry.target, GIVE_FIRST)([], False)  # the restore's batches are not given

        return put_back

    def elastic(self, entry: Entry, saved: list[Any], context: Any, held: list[int] | None = None) -> Any:
        """The inner loader's rest of the epoch, counting the batches each old rank's wrapper held
        ahead of its loop as not consumed (they are dealt again, not given first)."""
        if not all(isinstance(s, dict) and isinstance(s.get("held"), list) for s in saved):
            raise IncompatibleCheckpointError(f"state[{entry.key!r}]: not the records of a prefetching loader")
        inner = super().elastic(_inner(entry), [s["loader"] for s in saved], context,
                                [len(s["held"]) for s in saved])
        return {"loader": inner, "held": [], "ending": False}

    def summary(self, state: Any) -> dict[str, Any]:
        if not isinstance(state, dict):
            return {}
        return {**super().summary(state.get("loader")), "held_batches": len(state.get("held") or [])}


def _inner(entry: Entry) -> Entry:
    return replace(entry, target=entry.target.loader)
