"""What a training framework's own bookkeeping says about the job, read at save and load without
importing the framework (it is loaded already when `state` holds its objects).

Hugging Face Accelerate keeps its view of the world in a process-wide shared state: a job
started by torchrun on a CPU host without `Accelerator(cpu=True)` is, to Accelerate, one process
(`DistributedType.NO`): every rank trains its own copy of the model on its own data and no
gradient is averaged, while the manager sees the whole world and writes rank 0's model as every
rank's. Such a save or load is refused on every rank, naming the fix.
"""

from __future__ import annotations

import sys
from typing import Any

from distckpt.errors import ConfigError
from distckpt.state.capture import Entry
from distckpt.state.kinds import classify

ACCELERATE_MODULES = ("accelerate.",)


def classify_in_world(state: dict[str, Any], world_size: int) -> list[Entry]:
    """`classify(state)`, then refuse a framework whose world is not the manager's (ConfigError)."""
    entries = classify(state)
    refuse_a_framework_world_apart(entries, world_size)
    return entries


def refuse_a_framework_world_apart(entries: list[Entry], world_size: int) -> None:
    """ConfigError when `state` holds objects Accelerate prepared and Accelerate counts another
    number of processes than the manager's world."""
    prepared = [e.key for e in entries if _from_accelerate(e.target)]
    seen = accelerate_processes()
    if not prepared or seen is None or seen == world_size:
        return
    raise ConfigError(
        f"state[{prepared[0]!r}] was prepared by Hugging Face Accelerate, which sees {seen} process(es), and this "
        f"job has a world of {world_size} (torchrun): each rank trains its own copy on its own data, with no "
        "gradient averaged across ranks, and a checkpoint would hold rank 0's copy as every rank's. On a host "
        "without GPUs build Accelerator(cpu=True) (or set ACCELERATE_USE_CPU=1), or build it with "
        "distckpt.integrations.accelerate.make_accelerator(), which does that and starts the process group "
        "the restart-safe way")


def accelerate_processes() -> int | None:
    """The number of processes Accelerate's shared state counts, None when it was never set up."""
    module = sys.modules.get("accelerate.state")
    shared = getattr(getattr(module, "PartialState", None), "_shared_state", None)
    count = shared.get("num_processes") if isinstance(shared, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def accumulation_steps() -> int | None:
    """Accelerate's gradient_accumulation_steps when an Accelerator is set up, else None."""
    module = sys.modules.get("accelerate.state")
    shared = getattr(getattr(module, "GradientState", None), "_shared_state", None)
    kwargs = shared.get("plugin_kwargs") if isinstance(shared, dict) else None
    steps = kwargs.get("num_steps") if isinstance(kwargs, dict) else None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def negative_step_refusal(step: int) -> ConfigError:
    """The refusal of save(step) with step < 0, saying where saves belong. A negative step is
    nearly always `save(completed_steps - 1)` reached before the first optimizer step: a check run
    on every micro-batch with gradient accumulation (Hugging Face's no_trainer scripts)."""
    steps = accumulation_steps()
    accumulating = f" (Accelerate accumulates gradients over {steps} batches here)" if steps and steps > 1 else ""
    return ConfigError(
        f"step={step}: must be an int >= 0. A negative step usually comes from a save checked on every batch "
        f"before the first optimizer step has run{accumulating}: save after an optimizer step, with the number "
        "of optimizer steps taken so far minus one (with Accelerate, only where accelerator.sync_gradients is "
        "True), so that a resume starts at the step after it")


def _from_accelerate(obj: Any) -> bool:
    # type(), not obj.__class__: Accelerate's prepared loader answers __class__ with its base loader's
    return any(c.__module__.startswith(ACCELERATE_MODULES) for c in type(obj).__mro__)
