"""agreement.module_digest: equal for equal parameters, different for parameters trained apart,
blind to buffers (DDP lets each rank's BatchNorm statistics differ between forwards)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from distckpt.protocol.agreement import module_digest


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Linear(64, 3), nn.Embedding(5, 7))


def _step(model: nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 32)
    (model[2](model[1](model[0](x))).sum() + model[3](torch.tensor([1])).sum()).backward()
    opt.step()


def test_equal_parameters_digest_equal_every_time_and_in_any_wrapper():
    a, b = _model(), _model()
    assert module_digest(a, False) == module_digest(b, False) == module_digest(a, False)
    assert module_digest(torch.compile(a, backend="eager"), False) == module_digest(b, False)
    _step(a, 1)
    _step(b, 1)
    assert module_digest(a, False) == module_digest(b, False)


def test_parameters_trained_on_different_data_digest_differently():
    for seed in range(20):
        a, b = _model(), _model()
        _step(a, 1)
        _step(b, 2 + seed)
        assert module_digest(a, False) != module_digest(b, False)


def test_buffers_and_the_training_flag_are_not_compared():
    a, b = _model(), copy.deepcopy(_model())
    b[1].running_mean += 1.0
    b[1].num_batches_tracked += 3
    b.eval()
    assert module_digest(a, False) == module_digest(b, False)


def test_a_parameter_of_another_shape_or_name_differs():
    a = _model()
    b = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Linear(64, 4), nn.Embedding(5, 7))
    assert module_digest(a, False) != module_digest(b, False)


def test_after_the_first_save_a_window_of_parameters_moves_with_each_save_and_covers_them_all():
    """Every parameter at a manager's first save; later a window of SAMPLED_PARAMETERS moving
    with the save count (the same on every rank), so each parameter is looked at every few saves
    at a bounded cost per save (a 2,000-parameter model cost 16 ms at every save)."""
    from distckpt.protocol.agreement import SAMPLED_PARAMETERS

    count = 3 * SAMPLED_PARAMETERS + 5
    a = nn.ModuleList([nn.Linear(2, 2, bias=False) for _ in range(count)])
    b = copy.deepcopy(a)
    with torch.no_grad():
        b[100].weight += 1.0  # one parameter of many differs
    assert module_digest(a, True, 1) != module_digest(b, True, 1)  # first save: every parameter
    seen = [module_digest(a, False, seq) != module_digest(b, False, seq) for seq in range(2, 2 + 4)]
    assert any(seen) and not all(seen), seen  # found within a few saves, by the window holding it
    assert [module_digest(a, False, seq) for seq in range(2, 6)] == [module_digest(copy.deepcopy(a), False, seq)
                                                                      for seq in range(2, 6)]


def test_the_parameter_list_is_walked_again_so_a_new_parameter_is_looked_at():
    from distckpt.protocol.agreement import REWALK_SAVES

    a = nn.Sequential(nn.Linear(2, 2))
    b = copy.deepcopy(a)
    assert module_digest(a, False, 1) == module_digest(b, False, 1)
    a.add_module("extra", nn.Linear(2, 2))
    b.add_module("extra", nn.Linear(2, 2))  # another value than a's
    assert module_digest(a, False, 1 + REWALK_SAVES) != module_digest(b, False, 1 + REWALK_SAVES)


def test_a_small_parameter_is_compared_whole_so_sparse_updates_are_seen():
    """An embedding of which each rank updated a few rows of its own (no DDP) differed in
    elements a 16-element sample missed: the resume gave every rank rank 0's rows."""
    a = nn.Embedding(1000, 8)  # 32 KiB: taken whole
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.weight[700] += 0.5
    assert module_digest(a, False, 1) != module_digest(b, False, 1)
    assert module_digest(a, False, 7) != module_digest(b, False, 7)
