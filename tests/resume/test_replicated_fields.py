"""A replicated entry refused at save because the ranks hold different values names the fields
that differ: `state['scheduler'].metric` (timm's scheduler keeps each rank's running loss there),
`state['stats']['best']` (a dict value's key), not only the entry."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distckpt.errors import UnstorableValueError
from distckpt.protocol.agreement import check_replicated_agree, replicated_digests
from distckpt.state.capture import Entry
from distckpt.testing import run_world


class Schedule:
    """An object with state_dict/load_state_dict whose state_dict keys are its attributes."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.__dict__.update(fields)

    def state_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _refusal(per_rank: list[dict[str, Any]], as_object: bool) -> str:
    digests = []
    for fields in per_rank:
        target = Schedule(fields) if as_object else fields
        digests.append(replicated_digests([Entry("sched", "replicated", "stateful" if as_object else "value", target)]))
    with pytest.raises(UnstorableValueError) as refused:
        check_replicated_agree(digests, "save of step 3")
    return str(refused.value)


_VALUES = st.one_of(st.integers(-5, 5), st.floats(allow_nan=False, width=32), st.text(max_size=3),
                    st.lists(st.integers(0, 3), max_size=3), st.builds(lambda n: torch.arange(float(n)), st.integers(0, 4)))


@settings(max_examples=int(os.environ.get("DISTCKPT_HYPOTHESIS_EXAMPLES", "30")), deadline=None, derandomize=True)
@given(fields=st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True), _VALUES, min_size=1, max_size=8),
       data=st.data(), as_object=st.booleans(), world=st.integers(2, 3))
def test_the_fields_that_differ_are_named_and_no_other(fields, data, as_object, world):
    names = sorted(fields)
    differing = data.draw(st.lists(st.sampled_from(names), min_size=1, unique=True), label="differing")
    others = []
    for rank in range(1, world):
        mine = dict(fields)
        for name in differing:
            mine[name] = ("rank", rank, repr(fields[name]))  # a value no strategy above makes
        others.append(mine)
    said = _refusal([fields, *others], as_object)
    assert f"state['sched'] differs on rank(s) {list(range(1, world))} from rank 0's in " in said, said
    shown = [f"state['sched'].{n}" if as_object else f"state['sched'][{n!r}]" for n in sorted(differing)]
    listed = said.split(" from rank 0's in ", 1)[1].split(". A replicated", 1)[0]
    more = f" and {len(shown) - 4} more" if len(shown) > 4 else ""
    assert listed == ", ".join(shown[:4]) + more, (listed, shown)


def test_a_schedulers_per_rank_metric_is_named_in_a_two_rank_save(tmp_path):
    """The real protocol: two gloo ranks, a scheduler whose `metric` is each rank's own loss."""
    results = run_world("test_replicated_fields:_save_a_scheduler_with_a_metric_of_each_rank", 2, url=str(tmp_path))
    said = {r.value for r in results}
    assert len(said) == 1, said
    message = said.pop()
    assert "state['scheduler'] differs on rank(s) [1] from rank 0's in state['scheduler'].metric." in message, message
    assert "distckpt.per_rank" in message


def _save_a_scheduler_with_a_metric_of_each_rank(rank: int, world: int, url: str) -> str:
    import distckpt

    state = {"scheduler": Schedule({"t": 4, "base_lr": 0.1, "metric": 1.0 + rank})}
    with distckpt.CheckpointManager(url) as mgr:
        try:
            mgr.save(1, state)
        except UnstorableValueError as e:
            return str(e)
    return "saved"
