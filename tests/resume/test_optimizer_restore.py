"""Optimizer restore: torch's load_state_dict handed group ids with a set lookup.

Optimizer.load_state_dict asks `param_id in group["params"]` for every state tensor, a list scan
that made a load of 20,000 parameters with AdamW spend 4 of its 6 s there. distckpt hands it the
saved ids as stateful._ParamIds (distckpt/state/kinds/stateful.py); these tests hold that the result is the optimizer torch itself
would build, by every optimizer and group layout, and that the scan is gone.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import distckpt
from distckpt.state.kinds import stateful


def _trained(opt_cls, groups: int, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    params = list(model.parameters())
    split = [params[i::groups] for i in range(groups)]
    opt = opt_cls([{"params": p, "lr": 0.01 * (i + 1)} for i, p in enumerate(split)], **kwargs)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(3, 4)).pow(2).sum().backward()
        opt.step()
    return model, opt


def _same(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for name, v in a["state"][k].items():
            w = b["state"][k][name]
            if isinstance(v, torch.Tensor):
                assert v.dtype == w.dtype and v.device == w.device and torch.equal(v, w), (k, name)
            else:
                assert v == w


@pytest.mark.parametrize("opt_cls,kwargs", [
    (torch.optim.AdamW, {}), (torch.optim.AdamW, {"foreach": False}), (torch.optim.Adam, {"amsgrad": True}),
    (torch.optim.SGD, {"momentum": 0.9}), (torch.optim.RMSprop, {"momentum": 0.5}), (torch.optim.Adagrad, {}),
    (torch.optim.NAdam, {}), (torch.optim.Adamax, {}),
])
@pytest.mark.parametrize("groups", [1, 3])
def test_restored_optimizer_equals_torchs_own_load(tmp_path, opt_cls, kwargs, groups) -> None:
    model, opt = _trained(opt_cls, groups, **kwargs)
    with distckpt.CheckpointManager(tmp_path / "ck") as ckpt:
        ckpt.save(0, {"model": model, "opt": opt})
    expected = copy.deepcopy(opt.state_dict())
    model2, opt2 = _trained(opt_cls, groups, **kwargs)
    for _ in range(2):  # the live optimizer moves on, then is loaded back
        opt2.zero_grad()
        model2(torch.randn(3, 4)).sum().backward()
        opt2.step()
    with distckpt.CheckpointManager(tmp_path / "ck") as ckpt:
        ckpt.load_latest({"model": model2, "opt": opt2})
    _same(opt2.state_dict(), expected)
    # what torch's own load of the same dict gives
    model3, opt3 = _trained(opt_cls, groups, **kwargs)
    opt3.load_state_dict(copy.deepcopy(expected))
    _same(opt3.state_dict(), opt2.state_dict())
    # nothing of the lookup class is left in the optimizer
    assert all(type(g["params"]) is list for g in opt2.param_groups)


def test_param_ids_answer_as_a_list_does() -> None:
    for items in ([0, 1, 2, 5], [], ["a", "b"], [0, 0, 3], [1, [2], 3], [True, 2]):
        ids = stateful._ParamIds(items)
        for probe in (0, 1, 2, 3, 5, "a", "c", [2], 1.0, True, None):
            assert (probe in ids) == (probe in list(items)), (items, probe)
        ids.append(7)  # changed after the first lookup: the set is rebuilt
        assert 7 in ids and (7 in items) is False
        assert copy.deepcopy(ids) == ids + [] and ids == items + [7]


def test_load_state_dict_does_not_scan_the_group_list(tmp_path, monkeypatch) -> None:
    """The lookup is a set's: list.__contains__ is never called on the ids for a plain int list
    (with a plain list, load_state_dict scans it once per state tensor)."""
    model, opt = _trained(torch.optim.AdamW, 1)
    with distckpt.CheckpointManager(tmp_path / "ck") as ckpt:
        ckpt.save(0, {"model": model, "opt": opt})
    scans = []
    original = list.__contains__

    class Counting(stateful._ParamIds):
        def __contains__(self, item: object) -> bool:
            result = super().__contains__(item)
            scans.append(self.__dict__["_ids"][1] is None)
            return result

    monkeypatch.setattr(stateful, "_ParamIds", Counting)
    model2, opt2 = _trained(torch.optim.AdamW, 1)
    with distckpt.CheckpointManager(tmp_path / "ck") as ckpt:
        ckpt.load_latest({"model": model2, "opt": opt2})
    assert scans and not any(scans), "every id lookup went through the set"
    assert original is list.__contains__


_ID = st.one_of(st.integers(-3, 40), st.text(max_size=2))


@settings(max_examples=int(os.environ.get("DISTCKPT_HYPOTHESIS_EXAMPLES", "40")) * 5, deadline=None, derandomize=True)
@given(items=st.lists(_ID, max_size=30), probes=st.lists(st.one_of(_ID, st.floats(-2, 41), st.booleans(), st.none()),
                                                        max_size=10), appended=st.lists(_ID, max_size=3))
def test_param_ids_answer_generated_lookups_as_a_list_does(items, probes, appended) -> None:
    ids = stateful._ParamIds(items)
    plain = list(items)
    for probe in probes + items[:3]:
        assert (probe in ids) == (probe in plain), (items, probe)
    ids.extend(appended)
    plain.extend(appended)
    for probe in probes + appended:
        assert (probe in ids) == (probe in plain), (items, appended, probe)
