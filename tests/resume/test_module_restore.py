"""A module's load: torch's load_state_dict is skipped only where it would do nothing after
distckpt copied every tensor in place (no hooks, no extra state, no module that saves or loads
anything else); every other module goes through it. Either way the module comes back exactly:
its state dict bit for bit, its hooks and extra state honoured, its forward identical."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import distckpt
from distckpt.state.capture import loads_by_copy_alone


class WithExtraState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.calls = 0

    def get_extra_state(self):
        return {"calls": self.calls}

    def set_extra_state(self, state):
        self.calls = state["calls"]

    def forward(self, x):
        return self.fc(x) * (self.calls + 1)


class Scale(nn.Module):
    def forward(self, w):
        return w * 2


def _hooked() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
    model.loaded = 0
    model.register_load_state_dict_post_hook(lambda module, keys: setattr(module, "loaded", module.loaded + 1))
    return model


def _parametrized() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 3))
    parametrize.register_parametrization(model[0], "weight", Scale())
    return model


BUILDERS = {
    "many children": (lambda: nn.Sequential(*[nn.Linear(3, 3) for _ in range(300)]), True),
    "batchnorm": (lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.LayerNorm(4)), True),
    "lstm": (lambda: nn.LSTM(3, 3, num_layers=2), True),
    "attention": (lambda: nn.MultiheadAttention(4, 2), True),
    "parametrized": (_parametrized, True),
    "extra state": (WithExtraState, False),
    "load hook": (_hooked, False),
}


def _forward(name: str, model: nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if name == "lstm":
        return model(torch.randn(2, 1, 3, generator=g))[0]
    if name == "attention":
        x = torch.randn(2, 1, 4, generator=g)
        return model(x, x, x)[0]
    return model(torch.randn(2, 3, generator=g))


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_module_comes_back_exactly(tmp_path, name):
    build, plain = BUILDERS[name]
    assert loads_by_copy_alone(build()) is plain
    torch.manual_seed(1)
    saved = build()
    if name == "extra state":
        saved.calls = 3
    if name == "batchnorm":
        saved.train()
        saved(torch.randn(8, 3))  # running statistics move
        saved[1].eval()
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"model": saved})
    torch.manual_seed(2)
    live = build()
    live.train()
    with distckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.load_latest({"model": live})
    expected, got = saved.state_dict(), live.state_dict()
    assert expected.keys() == got.keys()
    for key in expected:
        if isinstance(expected[key], torch.Tensor):
            assert torch.equal(expected[key], got[key]), key
        else:
            assert expected[key] == got[key], key
    assert [m.training for m in live.modules()] == [m.training for m in saved.modules()]
    if name == "load hook":
        assert live.loaded == 1  # torch's load_state_dict ran, with its hook
    if name == "extra state":
        assert live.calls == 3
    saved.eval()
    live.eval()
    assert torch.equal(_forward(name, saved), _forward(name, live))
