"""world_size_policy="elastic" under real torchrun: a DDP job (gloo) over 96 samples,
DistributedSampler(shuffle=True) + StatefulDataLoader, saved mid-epoch 0 and SIGKILLed one step
later at N ranks, resumed at M. Every sample of the interrupted epoch is consumed exactly once
across the two runs, in the epoch's global order; the next epoch is a full permutation at M."""

from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys
import time

import pytest
from elastic_runs import LOOP, ROOT, Elastic, chain_consumed, read_log, run_chain, run_elastic

from distckpt.state.elastic import Order

pytestmark = pytest.mark.slow


def _expected(order: Order, save_at: int, batch: int, new: int) -> list[int]:
    """The interrupted epoch as the killed run consumed it up to the checkpoint (lockstep: every
    rank `save_at + 1` batches), then the rest dealt to `new` ranks, with DistributedSampler's
    padding (drop_last=False) or cut (drop_last=True) when the rest does not divide by `new`."""
    g = order.global_indices()
    share = len(g) // order.num_replicas
    k = min((save_at + 1) * batch, share)
    rest = g[k * order.num_replicas:]
    if rest and len(rest) % new:
        rest = rest[: len(rest) // new * new] if order.drop_last else \
            rest + [rest[i % len(rest)] for i in range(new - len(rest) % new)]
    return g[: k * order.num_replicas] + rest


def _check(result: Elastic, *, old: int, new: int, save_at: int, items: int = 96, batch: int = 2,
           shuffle: bool = True, drop_last: bool = False) -> None:
    assert result.rc[1] == 0, result.output
    assert sorted(result.resumed.events) == list(range(new))
    for rank, events in result.resumed.events.items():
        assert any(e.startswith(f"resumed from step {save_at} epoch 0 world {new}") for e in events), events
        assert any("world_size_policy='elastic'" in e for e in events), events
        rederived = next(e for e in events if e.startswith("resumed")).split("rederived ")[1].split(" tally")[0]
        # new ranks past the old world seed their streams afresh; the others take their old rank's
        assert (rederived != "") == (rank >= old), (rank, rederived)
    order = Order(items, old, shuffle, drop_last, 7, 0)
    consumed = result.consumed(0, save_at)
    assert consumed == _expected(order, save_at, batch, new)  # exactly once, in the global order
    if not drop_last:
        assert set(consumed) == set(range(items))  # none lost
    # the next epoch: the new world's own DistributedSampler, a full permutation
    nxt = collections.Counter(result.epoch_ids(1))
    full = Order(items, new, shuffle, drop_last, 7, 1).global_indices()
    assert nxt == collections.Counter(full)
    steps_per_rank = collections.Counter(s.rank for s in result.resumed.steps)
    assert len(set(steps_per_rank.values())) == 1  # every rank the same number of steps (DDP)


@pytest.mark.parametrize("old,new,workers", [(4, 2, 0), pytest.param(2, 4, 2, marks=pytest.mark.faults)])
def test_elastic_resume_continues_the_epoch_exactly_once(tmp_path, old, new, workers):
    result = run_elastic(str(tmp_path), old, new, save_at=5, extra=["--workers", str(workers)])
    _check(result, old=old, new=new, save_at=5)
    if 96 // old > 12:  # the reshard policy's measured loss: samples repeated; here none
        assert collections.Counter(result.consumed(0, 5)).most_common(1)[0][1] == 1


@pytest.mark.faults  # make test-faults: the other cells of the 4 <-> 2 matrix
@pytest.mark.parametrize("old,new,workers", [(4, 2, 2), (2, 4, 0)])
def test_elastic_resume_other_workers(tmp_path, old, new, workers):
    result = run_elastic(str(tmp_path), old, new, save_at=5, extra=["--workers", str(workers)])
    _check(result, old=old, new=new, save_at=5)


# uneven lengths, batch sizes, kill steps, drop_last and shuffle: bounded matrix, each case
# chosen so the rest of the epoch does not divide by the new world (padding or cut applies)
_MATRIX = [
    (2, 3, 61, 3, 4, False, True, 0),
    pytest.param(3, 2, 50, 3, 2, True, True, 0, marks=pytest.mark.faults),
    pytest.param(2, 3, 37, 1, 7, False, False, 2, marks=pytest.mark.faults),
    pytest.param(3, 2, 96, 5, 2, True, False, 0, marks=pytest.mark.faults),
]


@pytest.mark.parametrize("old,new,items,batch,save_at,drop_last,shuffle,workers", _MATRIX)
def test_elastic_resume_matrix(tmp_path, old, new, items, batch, save_at, drop_last, shuffle, workers):
    extra = ["--items", str(items), "--batch", str(batch), "--workers", str(workers)]
    extra += ["--drop-last"] if drop_last else []
    extra += [] if shuffle else ["--no-shuffle"]
    result = run_elastic(str(tmp_path), old, new, save_at=save_at, extra=extra)
    _check(result, old=old, new=new, save_at=save_at, items=items, batch=batch, shuffle=shuffle,
           drop_last=drop_last)


@pytest.mark.faults  # make test-faults (make test: 4->2 and the refusals)
def test_elastic_resume_async_on_s3(tmp_path, s3_server, s3_url):
    result = run_elastic(str(tmp_path), 2, 3, save_at=4, extra=["--async", "--items", "48"], ckpt=s3_url,
                         env=s3_server.env())
    _check(result, old=2, new=3, save_at=4, items=48)


@pytest.mark.faults
def test_elastic_resume_of_an_fsdp2_job_2_to_4(tmp_path):
    result = run_elastic(str(tmp_path), 2, 4, save_at=5, extra=["--fsdp"])
    _check(result, old=2, new=4, save_at=5)


@pytest.mark.faults  # make test: tests/unit/test_elastic_api.py refuses it in process
def test_a_custom_sampler_is_refused_by_name(tmp_path):
    result = run_elastic(str(tmp_path), 2, 1, save_at=2, extra=["--sampler", "custom"])
    assert result.rc[1] != 0
    refused = [e for e in result.resumed.events[0] if e.startswith("refused")]
    assert refused and "ElasticResumeError" in refused[0] and "CustomSampler" in refused[0], result.resumed.events
    assert "world_size_policy='reshard'" in refused[0]
    assert not result.resumed.steps


@pytest.mark.faults  # make test-faults (tests/unit/test_elastic_api.py covers the rule in process)
def test_per_rank_values_need_a_reshard_rule(tmp_path):
    refused = run_elastic(str(tmp_path / "plain"), 2, 3, save_at=3, extra=["--tally", "plain", "--items", "48"])
    assert refused.rc[1] != 0 and not refused.resumed.steps
    for rank in range(3):  # the same refusal on every rank, naming the entry and the way out
        message = next(e for e in refused.resumed.events[rank] if e.startswith("refused"))
        assert "state['tally']" in message and "reshard=" in message, message
    applied = run_elastic(str(tmp_path / "rule"), 2, 3, save_at=3, extra=["--tally", "reshard", "--items", "48"])
    _check(applied, old=2, new=3, save_at=3, items=48)
    seen = (3 + 1) * 2 * 2  # 4 steps of 2 samples on 2 ranks before the save
    tallies = [int(next(e for e in applied.resumed.events[r] if e.startswith("resumed")).split("tally ")[1])
               for r in range(3)]
    assert sum(tallies) == seen and max(tallies) - min(tallies) <= 1


@pytest.mark.parametrize("worlds", [pytest.param([2, 3, 2], marks=pytest.mark.faults),
                                    pytest.param([2, 3, 3], marks=pytest.mark.faults)])
def test_an_epoch_resized_twice_or_resumed_exactly_in_its_rest(tmp_path, worlds):
    """A save in the middle of an epoch's rest: resumed at yet another size (the rest of the rest,
    dealt again) or at the same size (exact: torchdata's position inside the rest)."""
    saves, batch = [3, 6], 2
    logs, codes = run_chain(str(tmp_path), worlds, saves, extra=["--items", "48"])
    assert codes[-1] == 0
    g = Order(48, worlds[0], True, False, 7, 0).global_indices()
    expected, rest = [], g
    for i, world in enumerate(worlds):
        if i:  # the rest dealt to this world: padded with its head to a multiple of it
            rest = rest + [rest[j % len(rest)] for j in range((-len(rest)) % world)]
        if i < len(saves):
            steps = saves[i] - (saves[i - 1] if i else -1)
            taken = steps * batch * world
            expected, rest = expected + rest[:taken], rest[taken:]
    expected += rest
    assert chain_consumed(logs, saves) == expected
    assert set(expected) == set(range(48))
    nxt = collections.Counter(i for s in logs[-1].steps if s.epoch == 1 for i in s.ids)
    assert nxt == collections.Counter(Order(48, worlds[-1], True, False, 7, 1).global_indices())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(node: int, port: int, args: list[str], out) -> subprocess.Popen:
    """One torchrun agent ("node") of a --nnodes 1:2 job on loopback; node 0 hosts the rendezvous."""
    conf = "join_timeout=120,last_call_timeout=3" + ("" if node == 0 else ",is_host=false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
           "--max-restarts", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "elastic-test", "--rdzv-conf", conf, "--monitor-interval", "0.5", LOOP, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and every process under it (its workers may run in sessions of their own)."""
    import psutil

    try:
        top = psutil.Process(agent.pid)
        processes = [*top.children(recursive=True), top]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    agent.wait()


def _reached(records: str, step: int) -> bool:
    return os.path.isdir(records) and any(
        line.split(" ", 1)[0] == str(step) for name in os.listdir(records)
        for line in open(os.path.join(records, name)) if not line.startswith("#"))


@pytest.mark.faults  # make test-faults: two torchrun agents, one killed whole
def test_a_node_that_does_not_return_torchrun_elastic(tmp_path):
    """torchrun --nnodes 1:2 with two agents on loopback (2 ranks each): saved mid-epoch at 4
    ranks, one node is SIGKILLed whole and never returns; the other's agent restarts its workers
    at 2 ranks, which resume elastically."""
    records, port = str(tmp_path / "records"), _free_port()
    args = ["--ckpt", str(tmp_path / "ckpt"), "--records", records, "--save-at", "5", "--step-sleep", "0.3"]
    with open(tmp_path / "node0.txt", "w") as out0, open(tmp_path / "node1.txt", "w") as out1:
        first = _agent(0, port, args, out0)
        time.sleep(2)  # node 0 hosts the rendezvous store: it must outlive node 1
        second = _agent(1, port, args, out1)
        try:
            deadline = time.monotonic() + 240
            while not _reached(records, 7) and time.monotonic() < deadline and first.poll() is None:
                time.sleep(0.2)
            assert _reached(records, 7), open(tmp_path / "node0.txt").read()[-3000:]
            _kill_node(second)  # the whole node: its workers and its agent
            assert first.wait(timeout=400) == 0, open(tmp_path / "node0.txt").read()[-3000:]
        finally:
            for agent in (first, second):
                if agent.poll() is None:
                    _kill_node(agent)
    result = Elastic(read_log(records), read_log(records + "-restart1"), (0, 0), "")
    _check(result, old=4, new=2, save_at=5)
