"""The optimizer under a framework's optimizer wrapper: the one whose step hooks run.

Hugging Face Accelerate's `AcceleratedOptimizer` (and DeepSpeed's wrappers) subclass
`torch.optim.Optimizer` without running its `__init__`: they have no hook dictionaries of their
own, and their `step()` calls the wrapped optimizer's, which runs the hooks. A step hook is
registered on the innermost optimizer that has them (Lightning Fabric's wrapper shares its
optimizer's dictionaries, so it is its own answer).

This module never touches storage or torch.distributed.
"""

from __future__ import annotations

from typing import Any

import torch

_HOOKS = "_optimizer_step_pre_hooks"  # set by Optimizer.__init__ (with its post-hook twin)


def stepping_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose step hooks run when `optimizer` steps: `optimizer` itself, or the one
    a wrapper that never ran Optimizer.__init__ holds as `.optimizer` (followed down)."""
    current: Any = optimizer
    seen: set[int] = set()
    while _HOOKS not in vars(current) and id(current) not in seen:
        seen.add(id(current))
        inner = vars(current).get("optimizer")
        if not isinstance(inner, torch.optim.Optimizer):
            break
        current = inner
    return current  # type: ignore[no-any-return]
