"""The public surface of elastic resume, with no processes: the policy value, per_rank's reshard=
(keyword-only, default None), and the doctor's --resize accounting over step records."""

from __future__ import annotations

import inspect

import pytest

import distckpt
from distckpt.config import ManagerConfig
from distckpt.tools.doctor_resize import account, resized_command


def test_the_policy_is_accepted_and_others_are_named():
    assert ManagerConfig(world_size_policy="elastic").world_size_policy == "elastic"
    with pytest.raises(distckpt.ConfigError, match="'elastic'"):
        ManagerConfig(world_size_policy="elastik")


def test_per_rank_takes_a_keyword_only_reshard_rule():
    params = inspect.signature(distckpt.per_rank).parameters
    assert list(params) == ["obj", "reshard"]
    assert params["reshard"].kind is inspect.Parameter.KEYWORD_ONLY and params["reshard"].default is None
    marked = distckpt.per_rank([1], reshard=lambda olds, m: [sum(olds, [])] * m)
    assert marked.reshard([[1], [2]], 3) == [[1, 2]] * 3
    assert distckpt.per_rank(5).reshard is None
    with pytest.raises(distckpt.ConfigError, match="reshard"):
        distckpt.per_rank(5, reshard="sum")
    with pytest.raises(TypeError):
        distckpt.per_rank(5, lambda olds, m: olds)  # keyword-only


def test_elastic_resume_error_is_an_incompatible_checkpoint_error():
    assert issubclass(distckpt.ElasticResumeError, distckpt.IncompatibleCheckpointError)


@pytest.mark.parametrize("command,expected", [
    (["torchrun", "--nproc-per-node", "4", "t.py"], (["torchrun", "--nproc-per-node", "2", "t.py"], 4)),
    (["torchrun", "--nproc_per_node=4", "t.py", "--nproc-per-node", "9"], (["torchrun", "--nproc-per-node=2", "t.py",
                                                                            "--nproc-per-node", "9"], 4)),
])
def test_the_resized_command_changes_torchruns_process_count(command, expected):
    assert resized_command(command, 2) == expected


def test_a_command_without_a_process_count_is_refused():
    with pytest.raises(distckpt.ConfigError, match="--nproc-per-node"):
        resized_command(["python", "t.py"], 2)


def _records(world, steps, epoch_of, ids_of, loss=1.0):
    return [{"step": s, "epoch": epoch_of(s), "samples": ids_of(s, r), "loss": loss, "rank": r}
            for s in steps for r in range(world)]


def test_the_accounting_finds_missed_and_repeated_samples():
    # 16 samples, epoch 0: 4 ranks x 2 steps x 2 samples; the uninterrupted run at 4 ranks
    ref = _records(4, range(4), lambda s: s // 2, lambda s, r: [(s % 2) * 8 + r * 2, (s % 2) * 8 + r * 2 + 1])
    killed = [r for r in ref if r["step"] == 0]  # the first step, killed after its commit
    good = _records(2, [1, 2], lambda s: 0, lambda s, r: [8 + (s - 1) * 4 + r * 2, 9 + (s - 1) * 4 + r * 2])
    good += _records(2, [3, 4, 5, 6], lambda s: 1, lambda s, r: [(s - 3) * 4 + r * 2, (s - 3) * 4 + r * 2 + 1])
    ok = account(ref, killed, good, 0, 4, 2)
    assert ok.exactly_once and ok.epoch == 0 and ok.epoch_samples == 16 and ok.next_epoch_complete
    assert ok.loss_before_equal and ok.loss_max_abs_diff == 0.0
    bad = [dict(r, samples=[0, 1]) if r["step"] == 1 and r["rank"] == 0 else r for r in good]  # 8, 9 lost; 0, 1 twice
    report = account(ref, killed, bad, 0, 4, 2)
    assert not report.exactly_once and report.missed == {8: 1, 9: 1} and report.repeated == {0: 1, 1: 1}
    assert not account(ref, killed, [], 0, 4, 2).records


# -- the loader rule, with loaders built here (no processes: the world is given) -----------------

def _loader(world: int, rank: int, sampler=None, n: int = 40, batch: int = 2):
    from torch.utils.data import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(n))
    sampler = sampler or DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3)
    return StatefulDataLoader(data, batch_size=batch, sampler=sampler)


def _saved(world: int, batches: int, **extra):
    from distckpt.state.elastic import ELASTIC_KEY
    from distckpt.state.elastic_rules import describe

    return [{ELASTIC_KEY: describe(_loader(world, r)), "_num_yielded": batches, "_iterator_finished": False, **extra}
            for r in range(world)]


def test_the_loader_rule_deals_the_rest_and_counts_held_batches_as_not_consumed():
    from distckpt.state.elastic import ElasticContext, Order
    from distckpt.state.elastic_rules import plan_for

    context = ElasticContext(1, 3, 2, 7, b"")
    plan = plan_for("loader", _saved(2, 4), _loader(3, 1), context)
    assert plan is not None and plan.segments[0].consumed == (8, 8) and plan.current_world == 3
    g = Order(40, 2, True, False, 3, 0).global_indices()
    assert [g[p] for p in plan.assigned()[1]] == g[16:][1::3]
    held = plan_for("loader", _saved(2, 4), _loader(3, 1), context, held=[1, 1])
    assert held is not None and held.segments[0].consumed == (6, 6)  # the held batches are dealt again
    assert plan_for("loader", _saved(2, 4, _iterator_finished=True), _loader(3, 1), context) is None


@pytest.mark.parametrize("case", ["random-sampler", "iterable", "old-record", "other-epochs", "wrong-rank"])
def test_the_loader_rule_refuses_what_it_cannot_continue_by_name(case):
    import torch

    from distckpt.state.elastic import ELASTIC_KEY, ElasticContext
    from distckpt.state.elastic_rules import plan_for

    context = ElasticContext(0, 3, 2, 7, b"")
    saved, live, named = _saved(2, 4), _loader(3, 0), ""
    if case == "random-sampler":
        live, named = _loader(3, 0, sampler=torch.utils.data.RandomSampler(range(40))), "RandomSampler"
    elif case == "iterable":
        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                return iter(range(40))
        from torchdata.stateful_dataloader import StatefulDataLoader
        live, named = StatefulDataLoader(Stream(), batch_size=2), "IterableDataset"
    elif case == "old-record":
        saved[1].pop(ELASTIC_KEY)
        named = "old rank 1"
    elif case == "other-epochs":
        saved[1][ELASTIC_KEY]["order"] = {**saved[1][ELASTIC_KEY]["order"], "epoch": 1}
        named = "different epochs"
    else:
        live, named = _loader(3, 2), "rank 2 of 3"
    with pytest.raises(distckpt.ElasticResumeError, match=named):
        plan_for("loader", saved, live, context)
