"""Small states whose every value is a function of the step, shared by the fault tests."""

from __future__ import annotations

import torch
from torch import nn


def state_for(step: int, width: int = 64) -> dict:
    torch.manual_seed(step)
    return {"model": nn.Linear(width, width // 4), "gen": torch.Generator().manual_seed(step),
            "config": {"step": step}}


def blank(width: int = 64) -> dict:
    """A state of the same shape holding none of any step's weights."""
    state = state_for(0, width)
    with torch.no_grad():
        state["model"].weight.zero_()
    return state
