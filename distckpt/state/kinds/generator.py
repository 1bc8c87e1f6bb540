"""A `torch.Generator` in `state` (a loader's, a sampler's, augmentation's): per rank."""

from __future__ import annotations

from typing import Any

import torch

from distckpt.errors import IncompatibleCheckpointError
from distckpt.state.capture import Entry
from distckpt.state.kinds.random_stream import RandomStreamKind
from distckpt.state.streams import TORCH_GENERATOR


class Generator(RandomStreamKind):
    """A torch.Generator: its state and the device it draws on."""

    name, stream = "generator", TORCH_GENERATOR
    description = "a torch.Generator: its state and device, per rank"
    copies_loaded_tensors = False

    def capture(self, entry: Entry) -> Any:
        return {"state": self.stream.get(entry.target), "device": str(entry.target.device)}

    def stream_state(self, saved: Any) -> Any:
        return saved["state"]

    def check(self, target: Any, saved: Any, where: str) -> None:
        state = saved.get("state") if isinstance(saved, dict) else None
        if not isinstance(state, torch.Tensor) or saved.get("device") != str(target.device) \
                or state.numel() != target.get_state().numel():
            raise IncompatibleCheckpointError(
                f"{where}: the checkpoint's generator (device {saved.get('device') if isinstance(saved, dict) else '?'}) "
                f"does not fit this torch.Generator on {target.device}; create it on the same device")

    def summary(self, state: Any) -> dict[str, Any]:
        return {"device": state.get("device")} if isinstance(state, dict) else {}
