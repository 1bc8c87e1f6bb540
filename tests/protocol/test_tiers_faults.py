"""The two tiers' fault matrix, at 2 ranks of real gloo worlds, on the SeaweedFS server.

Each row is a fault of the durable tier met by a two-tier job, and the promise after it:

* "durable tier unreachable at close, then back": close() raises AsyncSaveError on every rank and
  the manager stays open; close() again while the URL is still down raises again; once the URL is
  back close() uploads the newest local step, and a job reading the URL alone resumes from it.
* "unreachable at the pre-emption save, then back": the pre-emption save raises on every rank;
  close() once the URL is back uploads that step.
* "a superseded node returns": node X's incarnation dies with steps on its local tier only; node
  Y's resumes from the URL and goes on; X comes back while the URL cannot be read and resumes from
  its own local tier: its first save, with the URL back, raises FencedError on every rank and
  writes nothing; restarted, X resumes the run's line from the URL.

The fault proxy runs in rank 0's process, so rank 0 cuts the URL off and brings it back at exact
points between the ranks' calls (barriers on the default group, not the manager's).
"""

from __future__ import annotations

import os
import signal
import warnings

import pytest
import step_states
import torch
import torch.distributed as dist
from test_s3 import fast_options

import distckpt
from distckpt.testing import run_world


def _state(step: int, rank: int) -> dict:
    state = step_states.state_for(step)
    state["sampler"] = distckpt.per_rank({"pos": 1000 * step + rank})
    return state


def _blank(rank: int) -> dict:
    state = step_states.blank()
    state["sampler"] = distckpt.per_rank({"pos": -1})
    return state


def _holds(state: dict, step: int, rank: int) -> bool:
    expected = _state(step, rank)
    return (torch.equal(state["model"].weight, expected["model"].weight)
            and torch.equal(state["gen"].get_state(), expected["gen"].get_state())
            and state["sampler"].obj == expected["sampler"].obj)


class _Cut:
    """The fault proxy in rank 0's process; every rank reaches the URL through it."""

    def __init__(self, rank: int, s3_port: int) -> None:
        from faultproxy import FaultProxy

        self.rank = rank
        self.proxy = FaultProxy(s3_port).start() if rank == 0 else None
        endpoint = [self.proxy.endpoint if self.proxy is not None else None]
        dist.broadcast_object_list(endpoint, src=0)
        self.endpoint: str = endpoint[0]

    def options(self, keys: dict) -> dict:
        from seaweed import options_for

        return fast_options(options_for(self.endpoint, keys["key"], keys["secret"]), retries=1)

    def down(self) -> None:
        from faultproxy import Rule

        if self.proxy is not None:
            self.proxy.add(Rule("*", ".", "status", times=10**6, status=500))
        dist.barrier()

    def back(self) -> None:
        if self.proxy is not None:
            self.proxy.rules.clear()
        dist.barrier()


def _raised(call, *args) -> str | None:
    try:
        call(*args)
    except distckpt.DistCkptError as e:
        return f"{type(e).__name__}: {e}"
    return None


def close_then_back(rank: int, world: int, url: str, local: str, s3_port: int, keys: dict, ending: str) -> dict:
    """Saves 0-2 (none durable), then the URL goes down at close() or at the pre-emption save."""
    os.environ["DISTCKPT_NODE"] = "node-x"  # both ranks on one node: one local tier
    cut = _Cut(rank, s3_port)
    mgr = distckpt.CheckpointManager(url, local_dir=local, durable_every=100, timeout=60,
                                     storage_options=cut.options(keys), preemption_signals=(signal.SIGUSR1,))
    mgr.load_latest(_blank(rank))
    for step in range(3):
        mgr.save(step, _state(step, rank))
    out: dict = {}
    warnings.simplefilter("ignore", distckpt.DurableUploadWarning)
    if ending == "pre-emption":
        mgr.preemption_requested()  # armed
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        dist.barrier()
        out["asked"] = mgr.preemption_requested()
        cut.down()
        out["first"] = _raised(mgr.save, 3, _state(3, rank))
    else:
        cut.down()
        out["first"] = _raised(mgr.close)
    out["again"] = _raised(mgr.close)  # still down
    cut.back()
    out["back"] = _raised(mgr.close)
    out["after"] = _raised(mgr.close)  # closed: returns at once
    return out


def resume_from(rank: int, world: int, url: str, keys: dict, s3_port: int, local: str | None = None,
                save: int | None = None) -> dict:
    """A job resuming from `url` (and `local`, when given) that saves `save` if asked."""
    from seaweed import options_for

    os.environ["DISTCKPT_NODE"] = "node-x"
    options = fast_options(options_for(f"http://127.0.0.1:{s3_port}", keys["key"], keys["secret"]))
    state = _blank(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distckpt.CheckpointManager(url, local_dir=local, storage_options=options, timeout=60) as mgr:
            progress = mgr.load_latest(state)
            holds = progress is not None and _holds(state, progress.step, rank)
            if save is not None:
                mgr.save(save, _state(save, rank))
    return {"step": progress.step if progress else None, "tier": progress.tier if progress else None,
            "holds": holds, "warned": [str(w.message) for w in caught if issubclass(w.category, distckpt.DistCkptWarning)]}


def incarnation(rank: int, world: int, url: str, local: str, node: str, keys: dict, s3_port: int,
                steps: list[int], durable_every: int, dies: bool) -> dict:
    """An incarnation of the job on `node`: resumes, saves `steps`, then closes or dies (SIGKILL)."""
    from seaweed import options_for

    os.environ["DISTCKPT_NODE"] = node
    options = fast_options(options_for(f"http://127.0.0.1:{s3_port}", keys["key"], keys["secret"]))
    mgr = distckpt.CheckpointManager(url, local_dir=local, durable_every=durable_every, storage_options=options,
                                     timeout=60)
    progress = mgr.load_latest(_blank(rank))
    for step in steps:
        mgr.save(step, _state(step, rank))
    mgr.wait()
    if dies:
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)  # a lost node: nothing more is uploaded
    mgr.close()
    return {"resumed": progress.step if progress else None}


def returns_while_unreachable(rank: int, world: int, url: str, local: str, s3_port: int, keys: dict) -> dict:
    """Node X comes back while the URL cannot be read, resumes from its local tier, then saves
    with the URL back."""
    os.environ["DISTCKPT_NODE"] = "node-x"
    cut = _Cut(rank, s3_port)
    mgr = distckpt.CheckpointManager(url, local_dir=local, durable_every=3, timeout=60,
                                     storage_options=cut.options(keys))
    cut.down()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        progress = mgr.load_latest(_blank(rank))
    cut.back()
    out = {"step": progress.step, "tier": progress.tier,
           "warned": any(issubclass(w.category, distckpt.CheckpointFallbackWarning) for w in caught),
           "saves": [_raised(mgr.save, 5, _state(5, rank)) for _ in range(2)]}
    mgr.close()
    return out


def _ok(results) -> list:
    assert all(r.error is None and r.exitcode is None for r in results), [(r.error, r.exitcode) for r in results]
    return [r.value for r in results]


def _unreachable_at_close_then_back(tmp_path, s3_server, url: str, keys: dict, ending: str) -> None:
    local = str(tmp_path / "node-x")
    out = _ok(run_world("test_tiers_faults:close_then_back", 2, url=url, local=local, s3_port=s3_server.s3_port,
                        keys=keys, ending=ending))
    newest = 3 if ending == "pre-emption" else 2
    for value in out:
        assert value.get("asked", True)
        assert value["first"] is not None and value["first"].startswith("AsyncSaveError"), value
        assert value["again"] is not None and f"step(s) [{newest}]" in value["again"], value  # raises again while down
        assert value["back"] is None and value["after"] is None, value  # uploaded once back, then closed
    read = _ok(run_world("test_tiers_faults:resume_from", 2, url=url, keys=keys, s3_port=s3_server.s3_port))
    assert [(v["step"], v["holds"]) for v in read] == [(newest, True), (newest, True)], read


def _superseded_node_returns(tmp_path, s3_server, url: str, keys: dict, ending: str) -> None:
    node_x, node_y = str(tmp_path / "node-x"), str(tmp_path / "node-y")
    common = {"url": url, "keys": keys, "s3_port": s3_server.s3_port, "durable_every": 3}
    gen1 = run_world("test_tiers_faults:incarnation", 2, local=node_x, node="node-x", steps=list(range(5)),
                     dies=True, **common)
    assert [r.exitcode for r in gen1] == [-signal.SIGKILL] * 2, gen1
    gen2 = _ok(run_world("test_tiers_faults:incarnation", 2, local=node_y, node="node-y", steps=[3, 4], dies=False,
                         **common))
    assert [v["resumed"] for v in gen2] == [2, 2]  # from the URL: X's 3 and 4 never reached it
    returned = _ok(run_world("test_tiers_faults:returns_while_unreachable", 2, url=url, local=node_x,
                             s3_port=s3_server.s3_port, keys=keys))
    for value in returned:
        assert (value["step"], value["tier"], value["warned"]) == (4, "local", True), value
        assert all(s is not None and s.startswith("FencedError") and "superseded" in s for s in value["saves"]), value
    again = _ok(run_world("test_tiers_faults:resume_from", 2, url=url, keys=keys, s3_port=s3_server.s3_port,
                          local=node_x, save=5))
    assert [(v["step"], v["tier"], v["holds"]) for v in again] == [(4, "durable", True)] * 2, again
    read = _ok(run_world("test_tiers_faults:resume_from", 2, url=url, keys=keys, s3_port=s3_server.s3_port))
    assert [(v["step"], v["holds"]) for v in read] == [(5, True), (5, True)], read


TIER_FAULTS = {
    "durable tier unreachable at close, then back": (_unreachable_at_close_then_back, "close"),
    "unreachable at the pre-emption save, then back": (_unreachable_at_close_then_back, "pre-emption"),
    "a superseded node returns": (_superseded_node_returns, ""),
}


# make test: the durable tier unreachable at close, then back; make test-faults every row
@pytest.mark.parametrize("fault", [f if "at close" in f else pytest.param(f, marks=pytest.mark.faults)
                                   for f in TIER_FAULTS])
def test_two_tier_faults_at_two_ranks(fault, tmp_path, s3_server, s3_url):
    scenario, ending = TIER_FAULTS[fault]
    keys = {"key": s3_server.access_key, "secret": s3_server.secret_key}
    scenario(tmp_path, s3_server, s3_url, keys, ending)
