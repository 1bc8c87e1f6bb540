"""S3 requests failing from the Nth on, for every N a save performs (the object-store
counterpart of a disk that fills up mid-save): a clear error, the previous checkpoint still
loads byte-identical, and a restarted job's next save succeeds once the store recovers.

`make test` runs every fourth N; `make test-faults` runs them all.
"""

from __future__ import annotations

import pytest
import s3fs
import step_states
import torch
from faultproxy import Rule
from test_s3 import fast_options

import distckpt


def state_for(step: int) -> dict:
    return step_states.state_for(step, 256)


def blank() -> dict:
    return step_states.blank(256)


def snapshot(s3_server, url: str) -> dict[str, bytes]:
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options())
    return {k: fs.cat_file(k) for k in fs.find(url[5:] + "/step-000000001")}


def count_requests(s3_server, proxy, url: str) -> int:
    direct = fast_options(s3_server.storage_options())
    with distckpt.CheckpointManager(url, storage_options=direct) as mgr:
        mgr.save(1, state_for(1))
    proxy.log.clear()
    with distckpt.CheckpointManager(url, storage_options=fast_options(s3_server.storage_options(proxy.endpoint))) as mgr:
        mgr.load_latest(blank())
        before = len(proxy.log)
        mgr.save(2, state_for(2))
        return len(proxy.log) - before


@pytest.fixture(scope="module")
def save_requests(s3_server):
    from faultproxy import FaultProxy

    p = FaultProxy(s3_server.s3_port).start()
    try:
        return count_requests(s3_server, p, "s3://ckpt/count-requests")
    finally:
        p.stop()


def run_trial(s3_server, s3_url: str, proxy, n: int) -> str:
    """Fail every request from the nth of a save on; returns what happened."""
    direct = fast_options(s3_server.storage_options())
    with distckpt.CheckpointManager(s3_url, storage_options=direct) as mgr:
        mgr.save(1, state_for(1))
    before = snapshot(s3_server, s3_url)

    via_proxy = fast_options(s3_server.storage_options(proxy.endpoint), retries=1)
    with distckpt.CheckpointManager(s3_url, storage_options=via_proxy) as mgr:
        assert mgr.load_latest(blank()).step == 1
        proxy.add(Rule("*", ".", "status", times=10**6, status=500, skip=n - 1))
        try:
            mgr.save(2, state_for(2))
            error = None
        except distckpt.DistCkptError as e:
            error = e
        finally:
            proxy.rules.clear()

    assert snapshot(s3_server, s3_url) == before, f"n={n}: step 1 changed"  # byte for byte
    with distckpt.CheckpointManager(s3_url, storage_options=direct) as mgr:
        state = blank()
        progress = mgr.load_latest(state)
        if error is None:  # only housekeeping after the marker failed (warnings): step 2 is committed
            assert progress.step == 2, f"n={n}: the save succeeded but step 2 is not loadable"
            assert torch.equal(state["model"].weight, state_for(2)["model"].weight)
            return "committed"
        assert isinstance(error, (distckpt.StorageError, distckpt.CoordinationError, distckpt.FencedError)), repr(error)
        assert progress.step == 1, f"n={n}: the save failed ({error}) yet step {progress.step} loads"
        assert torch.equal(state["model"].weight, state_for(1)["model"].weight)
        mgr.save(2, state_for(2))  # the store recovered: the restarted job's save succeeds
        assert mgr.committed_steps()[0] == 2
    return "error"


def test_s3_failing_from_the_nth_request_sampled(s3_server, s3_url, proxy, save_requests):
    outcomes = {n: run_trial(s3_server, f"{s3_url}/n{n}", proxy, n) for n in range(1, save_requests + 1, 13)}
    assert "error" in outcomes.values(), outcomes


@pytest.mark.faults
def test_s3_failing_from_every_nth_request(s3_server, s3_url, proxy, save_requests):
    outcomes = {n: run_trial(s3_server, f"{s3_url}/n{n}", proxy, n) for n in range(1, save_requests + 1)}
    print("S3 failing from request N of", save_requests, outcomes)
    assert list(outcomes.values()).count("error") >= save_requests // 2, outcomes


@pytest.mark.parametrize("mode", ["standard", pytest.param("legacy", marks=pytest.mark.faults)])
def test_a_retried_request_never_moves_the_global_random_stream(s3_server, s3_url, proxy, mode):
    """botocore draws its retry jitter from Python's global `random`: one 503 retried inside a
    save moved the stream the checkpoint had just recorded, and a failed load moved it too
    (storage/jitter.py points that jitter at a private generator)."""
    import random

    options = fast_options(s3_server.storage_options(proxy.endpoint))
    options["config_kwargs"]["retries"] = {"max_attempts": 3, "mode": mode}
    url = f"{s3_url}-{mode}"
    state = {"w": torch.arange(10.0), "n": 1}
    with distckpt.CheckpointManager(url, storage_options=options) as mgr:
        mgr.load_latest(state)
        failing = Rule("PUT", r"/step-\d+/replicated/", "status", times=1, status=503)
        proxy.add(failing)
        random.seed(1234)
        before = random.getstate()
        mgr.save(1, state)
        assert failing.hits == 1  # the request was failed, and retried
        assert random.getstate() == before
    proxy.add(Rule("*", ".", "status", times=10**6, status=503))
    random.seed(99)
    before = random.getstate()
    target = {"w": torch.zeros(10), "n": 0}
    with pytest.raises((distckpt.DistCkptError, OSError)):
        distckpt.CheckpointManager(url, storage_options=options).load_latest(target)
    assert random.getstate() == before and target["n"] == 0 and not target["w"].any()
    proxy.rules.clear()


@pytest.mark.parametrize("which", ["replicated", "ranks"])
@pytest.mark.parametrize("size", ["small", "multipart"])
def test_one_corrupted_transfer_is_read_again_not_taken_for_a_damaged_step(s3_server, s3_url, proxy, which, size):
    """One byte flipped in one GET response (the object intact): the newest step was taken for
    damaged and the load fell back (a multipart object: checksum mismatch), or raised outright
    (a single-PUT object: botocore's FlexibleChecksumError). It is read again and loads."""
    import warnings

    direct = fast_options(s3_server.storage_options())
    url = f"{s3_url}-{which}-{size}"
    big = {"w": torch.arange(4 * 1024 * 1024, dtype=torch.float32)} if size == "multipart" else {}
    with distckpt.CheckpointManager(url, storage_options=direct) as mgr:
        mgr.save(1, {**state_for(1), "big": {k: v + 1 for k, v in big.items()}})
        mgr.save(2, {**state_for(2), "big": big})
    flip = Rule("GET", rf"/step-000000002/{which}/", "flip", times=1)
    proxy.add(flip)
    state = {**blank(), "big": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("error", distckpt.CheckpointFallbackWarning)
        progress = distckpt.CheckpointManager(url, storage_options=fast_options(
            s3_server.storage_options(proxy.endpoint))).load_latest(state)
    proxy.rules.clear()
    assert flip.hits == 1  # the transfer was corrupted once
    assert progress.step == 2 and torch.equal(state["model"].weight, state_for(2)["model"].weight)
    assert all(torch.equal(state["big"][k], v) for k, v in big.items())


def test_a_commit_marker_that_may_still_land_is_said_to_be_unknown(s3_server, s3_url, proxy):
    """The marker's PUT held past call_timeout: save() raised a plain timeout, and the step was
    committed seconds later when the held request reached the server."""
    import time

    url = f"{s3_url}-late-marker"
    options = fast_options(s3_server.storage_options(proxy.endpoint), call_timeout=3)
    options["config_kwargs"]["retries"] = {"max_attempts": 1, "mode": "standard"}
    late = Rule("PUT", r"/step-000000002/COMMITTED", "late", times=1, delay=6)
    with distckpt.CheckpointManager(url, storage_options=options) as mgr:
        mgr.load_latest(blank())
        mgr.save(1, state_for(1))
        proxy.add(late)
        with pytest.raises(distckpt.StorageError, match="may or may not be committed") as raised:
            mgr.save(2, state_for(2))
        assert "committed_steps()" in str(raised.value)
        deadline = time.monotonic() + 30
        while mgr.committed_steps()[0] != 2 and time.monotonic() < deadline:  # the held request lands
            time.sleep(0.5)
        proxy.rules.clear()
        assert late.hits == 1 and mgr.committed_steps()[0] == 2
        with pytest.raises(distckpt.CheckpointExistsError):
            mgr.save(2, state_for(2))
