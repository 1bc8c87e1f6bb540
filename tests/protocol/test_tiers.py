"""Two tiers: every save commits to a node-local root, every Nth (and the pre-emption and last
saves) also to the durable URL; loads take the newest step that verifies on a tier every rank
can read, falling back across tiers with a warning."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings

import pytest
import step_states
import torch
from faultproxy import Rule
from test_s3 import fast_options

import distckpt
from distckpt.io import manifest as mf
from distckpt.protocol.commit import list_committed
from distckpt.protocol.tiers import DurableUploadWarning
from distckpt.runtime import faults
from distckpt.storage import open_storage
from distckpt.testing import run_world


def steps_at(root: str) -> list[int]:
    return sorted(list_committed(open_storage(root)))


def flip_a_byte(root: str, step: int) -> None:
    base = os.path.join(root, mf.step_dir(step), "replicated")
    path = os.path.join(base, next(n for n in sorted(os.listdir(base)) if n.endswith(".safetensors")))
    data = bytearray(open(path, "rb").read())
    data[-5] ^= 0x40
    open(path, "wb").write(data)


def run_saves(durable: str, local: str, steps: range, **options) -> None:
    with distckpt.CheckpointManager(durable, local_dir=local, **options) as mgr:
        mgr.load_latest(step_states.blank())
        for step in steps:
            mgr.save(step, step_states.state_for(step))


def load(durable: str, local: str | None, **kw) -> tuple[distckpt.Progress, dict]:
    state = step_states.blank()
    with distckpt.CheckpointManager(durable, local_dir=local) as mgr:
        progress = mgr.load(state, **kw) if kw else mgr.load_latest(state)
    return progress, state


def assert_holds(state: dict, step: int) -> None:
    expected = step_states.state_for(step)
    assert torch.equal(state["model"].weight, expected["model"].weight)
    assert torch.equal(state["gen"].get_state(), expected["gen"].get_state())


@pytest.fixture
def roots(tmp_path):
    return str(tmp_path / "durable"), str(tmp_path / "local")


@pytest.mark.parametrize("async_save", [False, True])
def test_every_nth_save_and_the_last_before_close_are_durable(roots, async_save):
    durable, local = roots
    run_saves(durable, local, range(7), durable_every=3, keep_local=2, keep_last=2, async_save=async_save)
    assert steps_at(local) == [5, 6]    # keep_local
    assert steps_at(durable) == [5, 6]  # saves 3 and 6 (steps 2, 5) and the last before close; keep_last=2
    progress, state = load(durable, local)
    assert (progress.step, progress.tier) == (6, "local")
    assert progress.url.startswith(local)
    assert_holds(state, 6)


def test_an_upload_that_ends_after_the_next_local_commit_is_no_branch(roots, monkeypatch):
    """The branch warning compared an upload's step with the newest step of either tier: an
    upload of step 2 ending after the local commit of step 3 was "committed below the newest
    committed step 3" of the URL, which never held step 3 (every two-tier run of a checker)."""
    import threading
    import time

    local_committed = threading.Event()

    def slow_upload(name: str, context: dict) -> None:
        if name == "upload/files-written" and context.get("step", 0) > 0:
            local_committed.wait(10)  # the next local save commits first
            time.sleep(0.2)

    def next_local(name: str, context: dict) -> None:
        if name == "save/committed":
            local_committed.set()

    durable, local = roots
    remove = [faults.on_point(slow_upload), faults.on_point(next_local)]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run_saves(durable, local, range(6), durable_every=2, keep_local=2, keep_last=2)
    finally:
        for undo in remove:
            undo()
    # the branch warning only: a loader some earlier test left mid-pass in this process is said too
    said = [str(w.message) for w in caught if issubclass(w.category, distckpt.CheckpointWarning)
            and "committed below the newest" in str(w.message)]
    assert said == [], said
    assert steps_at(durable)[-1] == 5


def test_the_commit_log_line_names_the_tier_written(roots, caplog):
    """A local-only commit was logged as "committed step N at <the URL>"."""
    import logging

    durable, local = roots
    caplog.set_level(logging.INFO, logger="distckpt")
    run_saves(durable, local, range(2), durable_every=5)
    lines = [r.getMessage() for r in caplog.records if "committed step 1 at" in r.getMessage()]
    assert lines and all(f"committed step 1 at {local} " in line for line in lines), lines


def test_a_local_tier_each_node_lost_resumes_from_the_durable_tier(roots):
    durable, local = roots
    run_saves(durable, local, range(5), durable_every=2)
    assert steps_at(durable) == [1, 3, 4]
    shutil.rmtree(local)  # a replaced node: empty local disk
    progress, state = load(durable, local)
    assert (progress.step, progress.tier) == (4, "durable")
    assert_holds(state, 4)


def test_a_damaged_local_copy_falls_back_to_the_durable_copy_then_to_older_steps(roots):
    durable, local = roots
    run_saves(durable, local, range(4), durable_every=2)  # durable: 1, 3 (and 3 is the last)
    assert steps_at(local) == [0, 1, 2, 3] and steps_at(durable) == [1, 3]
    flip_a_byte(local, 3)
    with pytest.warns(distckpt.CheckpointFallbackWarning, match="step 3 on the local tier .*step 3 from the durable"):
        progress, state = load(durable, local)
    assert (progress.step, progress.tier) == (3, "durable")
    assert_holds(state, 3)
    flip_a_byte(durable, 3)  # both copies of step 3 damaged: the next newest is local step 2
    with pytest.warns(distckpt.CheckpointFallbackWarning):
        progress, state = load(durable, local)
    assert (progress.step, progress.tier) == (2, "local")
    assert_holds(state, 2)


def test_the_fallback_warning_names_the_step_loaded_when_the_other_copy_never_committed(roots):
    """An upload cut off leaves the durable step directory without its marker: with the local copy
    of that step damaged, the warning said "loading step 3 from the durable tier" while an older
    local step was loaded. Each warning now names what is loaded instead."""
    durable, local = roots
    run_saves(durable, local, range(4), durable_every=1)
    for name in (mf.MARKER, "manifest.json"):  # what a kill a few ms into the upload of step 3 leaves
        os.remove(os.path.join(durable, mf.step_dir(3), name))
    flip_a_byte(local, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        progress, state = load(durable, local)
    assert (progress.step, progress.tier) == (2, "local")
    assert_holds(state, 2)
    messages = [str(w.message) for w in caught if issubclass(w.category, distckpt.CheckpointFallbackWarning)]
    assert len(messages) == 1 and "step 3 on the local tier" in messages[0], messages
    assert messages[0].endswith("loading step 2 from the local tier instead"), messages[0]
    flip_a_byte(local, 2)
    flip_a_byte(durable, 2)
    flip_a_byte(local, 1)
    flip_a_byte(durable, 1)
    flip_a_byte(local, 0)
    flip_a_byte(durable, 0)
    with pytest.warns(distckpt.CheckpointFallbackWarning, match="no other committed checkpoint verifies"):
        with pytest.raises(distckpt.CorruptCheckpointError, match=r"committed steps tried: \['3 \(local\)', '2 \(local\)'"):
            load(durable, local)


@pytest.mark.parametrize("async_save", [False, True])
def test_with_keep_best_a_save_with_a_metric_reaches_the_url_and_the_best_is_kept(roots, async_save):
    """keep_best judges the URL's steps, and keep_local dropped the local-only ones: saves with
    a metric that were not every durable_every-th vanished with the best of them (best_step()
    went 1 -> None -> 4 -> None; after close() only a metric-less step was left)."""
    durable, local = roots
    metrics = [5.0, 1.0, None, None, 4.0, None, None]
    with distckpt.CheckpointManager(durable, local_dir=local, durable_every=3, keep_local=1, keep_last=1,
                                    keep_best=1, async_save=async_save) as mgr:
        mgr.load_latest(step_states.blank())
        for step, metric in enumerate(metrics):
            mgr.save(step, step_states.state_for(step), metric=metric)
            mgr.wait()
            if step >= 1:
                assert mgr.best_step() == 1, (step, mgr.best_step())
    assert steps_at(durable) == [1, 6]  # the best and the newest (the last save before close())
    assert mgr.best_step() == 1
    progress, state = load(durable, None, step=1)
    assert progress.metric == 1.0
    assert_holds(state, 1)


def test_an_explicit_step_falls_back_only_to_the_other_copy_of_that_step(roots):
    durable, local = roots
    run_saves(durable, local, range(4), durable_every=2)
    flip_a_byte(local, 1)
    with pytest.warns(distckpt.CheckpointFallbackWarning):
        progress, state = load(durable, local, step=1)
    assert (progress.step, progress.tier) == (1, "durable")
    assert_holds(state, 1)
    flip_a_byte(local, 2)  # step 2 is local only: no other copy, so no fallback
    with pytest.raises(distckpt.CorruptCheckpointError):
        load(durable, local, step=2)
    with pytest.raises(distckpt.IncompatibleCheckpointError, match="step 9 is not committed"):
        load(durable, local, step=9)


def test_the_durable_root_alone_loads_what_was_uploaded(roots):
    durable, local = roots
    run_saves(durable, local, range(3), durable_every=2)
    progress, state = load(durable, None)  # e.g. an evaluation job elsewhere
    assert (progress.step, progress.tier) == (2, "durable")
    assert_holds(state, 2)


def test_damaged_local_bytes_are_never_uploaded(roots):
    durable, local = roots

    def damage(name: str, context: dict) -> None:
        if name == "upload/started" and context["step"] == 0:
            flip_a_byte(local, 0)

    remove = faults.on_point(damage)
    try:
        with distckpt.CheckpointManager(durable, local_dir=local, durable_every=1) as mgr:
            mgr.save(0, step_states.state_for(0))
            with pytest.warns(DurableUploadWarning, match="step\\(s\\) \\[0\\].*checksum"):
                mgr.wait()
            assert steps_at(durable) == []
            mgr.save(1, step_states.state_for(1))
    finally:
        remove()
    assert steps_at(durable) == [1]


def test_while_the_url_fails_a_save_does_not_wait_for_the_retry_in_flight(roots):
    """With the URL failing, every save is a durable one (the retry) and each waited for the
    upload before it to fail: a 2-rank job whose S3 connections were cut ran ~70 s for 14 steps
    instead of ~3 s. Now a save finding a retry still in flight puts its own upload off to the
    next save; once the URL works again the newest step reaches it, and close() makes the last
    one durable."""
    import threading
    import time

    durable, local = roots
    release = threading.Event()
    calls = {"n": 0}

    def failing_store(name: str, context: dict) -> None:
        if name != "upload/started":
            return
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(5, "the object store went away")
        if calls["n"] == 2:
            release.wait(30)  # a retry hanging on a store that accepts and never answers
            raise OSError(110, "timed out")

    remove = faults.on_point(failing_store)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DurableUploadWarning)
            with distckpt.CheckpointManager(durable, local_dir=local, durable_every=1) as mgr:
                mgr.load_latest(step_states.blank())
                mgr.save(0, step_states.state_for(0))
                mgr.wait()  # upload of step 0 failed: reported, the next save is the retry
                mgr.save(1, step_states.state_for(1))  # its upload hangs
                start = time.monotonic()
                for step in range(2, 6):
                    mgr.save(step, step_states.state_for(step))
                assert time.monotonic() - start < 10  # not waiting for the hung retry (30 s)
                assert steps_at(local)[-1] == 5 and steps_at(durable) == []
                release.set()
                mgr.wait()
                mgr.save(6, step_states.state_for(6))  # the URL works again: uploaded
                mgr.wait()
                assert 6 in steps_at(durable)
                mgr.save(7, step_states.state_for(7))
    finally:
        release.set()
        remove()
    assert steps_at(durable)[-1] == 7  # close() made the last save durable


def test_an_upload_stopped_half_way_is_not_committed_and_the_next_save_catches_up(roots):
    durable, local = roots
    failing = {"on": True}

    def stop(name: str, context: dict) -> None:
        if name == "upload/files-written" and failing["on"]:
            raise OSError(5, "the object store went away mid-upload")

    remove = faults.on_point(stop)
    try:
        mgr = distckpt.CheckpointManager(durable, local_dir=local, durable_every=10)
        mgr.load_latest(step_states.blank())
        for step in range(10):  # step 9 is the 10th save: durable, and its upload stops half-way
            mgr.save(step, step_states.state_for(step))
        with pytest.warns(DurableUploadWarning, match="step\\(s\\) \\[9\\]"):
            mgr.wait()
        assert steps_at(durable) == []                      # files written, no marker: not committed
        assert os.path.isdir(os.path.join(durable, mf.step_dir(9)))
        failing["on"] = False
        mgr.save(10, step_states.state_for(10))             # not a 10th save, but made durable: catch-up
        mgr.wait()
        assert steps_at(durable) == [10]
        failing["on"] = True
        mgr.save(11, step_states.state_for(11))
        with pytest.raises(distckpt.AsyncSaveError, match="newest checkpoint is not durable"):
            mgr.close()                                     # the last save's upload fails: loud
    finally:
        remove()
    assert steps_at(local)[-1] == 11 and steps_at(durable) == [10]
    progress, state = load(durable, local)
    assert (progress.step, progress.tier) == (11, "local")
    assert_holds(state, 11)


def test_tier_arguments_are_checked(roots, tmp_path):
    durable, local = roots
    bad = [dict(durable_every=5), dict(keep_local=2), dict(local_dir=local, durable_every=0),
           dict(local_dir=local, durable_every=True), dict(local_dir=local, keep_local=0),
           dict(local_dir=local, keep_local="2"), dict(local_dir="s3://bucket/x"), dict(local_dir=""),
           dict(local_dir=durable), dict(local_dir=3)]
    for kwargs in bad:
        name = next(k for k in ("durable_every", "keep_local", "local_dir") if k in kwargs and
                    (k != "local_dir" or len(kwargs) == 1))
        with pytest.raises(distckpt.ConfigError, match=name):
            distckpt.CheckpointManager(durable, **kwargs)
    assert not os.path.exists(durable) or steps_at(durable) == []


def test_a_new_run_refuses_a_durable_root_holding_another_runs_steps(roots, tmp_path):
    durable, local = roots
    run_saves(durable, local, range(2), durable_every=1)
    with distckpt.CheckpointManager(durable, local_dir=str(tmp_path / "other-local")) as mgr:
        with pytest.raises(distckpt.RunConflictError):
            mgr.save(0, step_states.state_for(0))  # never loaded: it would interleave with that run


@pytest.mark.faults  # make test: the retried-upload cases
def test_s3_down_during_uploads_local_saves_continue_and_the_next_durable_save_catches_up(
        tmp_path, s3_server, s3_url, proxy):
    local = str(tmp_path / "local")
    options = fast_options(s3_server.storage_options(proxy.endpoint), retries=1)
    with distckpt.CheckpointManager(s3_url, local_dir=local, durable_every=2, storage_options=options) as mgr:
        mgr.load_latest(step_states.blank())
        mgr.save(0, step_states.state_for(0))
        mgr.save(1, step_states.state_for(1))  # durable
        mgr.wait()
        proxy.add(Rule("*", ".", "status", times=10**6, status=500))  # the store is down
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(2, 6):
                mgr.save(step, step_states.state_for(step))   # never raises: the local tier commits
            mgr.wait()
        assert any(issubclass(w.category, DurableUploadWarning) for w in caught)
        fence = [w for w in caught if "fence" in str(w.message) and "cannot be checked" in str(w.message)]
        assert len(fence) == 1, [str(w.message) for w in caught]  # said once, not retried at every save
        assert steps_at(local)[-1] == 5
        proxy.rules.clear()  # the store is back
        mgr.save(6, step_states.state_for(6))  # catch-up after the failure: durable
        mgr.wait()
        durable_steps = mgr.committed_steps()
    direct = fast_options(s3_server.storage_options())
    with distckpt.CheckpointManager(s3_url, storage_options=direct) as reader:
        assert reader.committed_steps()[0] == 6 and 1 in reader.committed_steps()
        assert not {3, 5} & set(reader.committed_steps())
        state = step_states.blank()
        assert reader.load_latest(state).step == 6
    assert_holds(state, 6)
    assert durable_steps[0] == 6
    shutil.rmtree(local)
    state = step_states.blank()
    with distckpt.CheckpointManager(s3_url, local_dir=local, storage_options=direct) as mgr:
        progress = mgr.load_latest(state)
    assert (progress.step, progress.tier) == (6, "durable")


def test_local_saves_do_not_ask_an_unreachable_url_again_until_an_upload_succeeds(tmp_path, s3_server, s3_url, proxy):
    """Once the URL failed, local saves (local retention included) send it nothing: local
    retention listed the URL's leases at every save, and a hung store held each local save for
    its call timeout (270 s at the default, in an independent check)."""
    local = str(tmp_path / "local")
    options = fast_options(s3_server.storage_options(proxy.endpoint), retries=1)
    with distckpt.CheckpointManager(s3_url, local_dir=local, durable_every=100, keep_local=2, keep_last=2,
                                    storage_options=options) as mgr:
        mgr.load_latest(step_states.blank())
        mgr.save(0, step_states.state_for(0))  # durable: takes the lease
        mgr.wait()
        down = Rule("*", ".", "status", times=10**6, status=500)
        proxy.add(down)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mgr.save(1, step_states.state_for(1))  # finds the URL down
            asked = down.hits
            for step in range(2, 6):
                mgr.save(step, step_states.state_for(step))
        assert asked > 0 and down.hits == asked, (asked, down.hits)
        assert steps_at(local) == [4, 5]  # local retention went on
        proxy.rules.clear()


def test_a_resume_from_the_local_tier_works_while_the_durable_root_is_unreachable(tmp_path, s3_server, s3_url, proxy):
    local = str(tmp_path / "local")
    direct = fast_options(s3_server.storage_options())
    run_saves(s3_url, local, range(3), durable_every=2, storage_options=direct)
    proxy.add(Rule("*", ".", "status", times=10**6, status=500))
    state = step_states.blank()
    options = fast_options(s3_server.storage_options(proxy.endpoint), retries=1)
    with distckpt.CheckpointManager(s3_url, local_dir=local, storage_options=options) as mgr:
        progress = mgr.load_latest(state)
        proxy.rules.clear()
    assert (progress.step, progress.tier) == (2, "local")
    assert_holds(state, 2)


def two_nodes(rank: int, world: int, root: str, wipe_node: int | None) -> dict:
    """Each rank plays a node of its own (its own local_dir, its own node name)."""
    os.environ["DISTCKPT_NODE"] = f"node-{rank}"
    local = os.path.join(root, f"local-{rank}")
    durable = os.path.join(root, "durable")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    state = {"model": model, "gen": torch.Generator().manual_seed(rank), "sampler": distckpt.per_rank({"pos": rank})}
    if wipe_node is None:
        with distckpt.CheckpointManager(durable, local_dir=local, durable_every=3, timeout=30) as mgr:
            mgr.load_latest(state)
            for step in range(4):
                with torch.no_grad():
                    model.weight.add_(1.0)
                torch.rand(1, generator=state["gen"])
                mgr.save(step, state)
        return {"local": steps_at(local), "weight": float(model.weight.sum()),
                "gen": state["gen"].get_state().tolist()}
    if rank == wipe_node:
        shutil.rmtree(local)
    with torch.no_grad():
        model.weight.zero_()
    state["gen"].manual_seed(12345)
    with distckpt.CheckpointManager(durable, local_dir=local, timeout=30) as mgr:
        progress = mgr.load_latest(state)
    return {"step": progress.step, "tier": progress.tier, "weight": float(model.weight.sum()),
            "gen": state["gen"].get_state().tolist()}


@pytest.mark.slow
def test_two_nodes_each_hold_their_local_tier_and_a_lost_node_resumes_all_from_durable(tmp_path):
    root = str(tmp_path)
    saved = run_world("test_tiers:two_nodes", 2, root=root, wipe_node=None)
    assert all(r.error is None for r in saved), [r.error for r in saved]
    assert [r.value["local"] for r in saved] == [[0, 1, 2, 3], [0, 1, 2, 3]]  # shipped to node 1
    assert steps_at(os.path.join(root, "durable")) == [2, 3]
    both = run_world("test_tiers:two_nodes", 2, root=root, wipe_node=-1)
    assert all(r.error is None for r in both), [r.error for r in both]
    assert [(r.value["step"], r.value["tier"]) for r in both] == [(3, "local"), (3, "local")]
    back = run_world("test_tiers:two_nodes", 2, root=root, wipe_node=1)
    assert all(r.error is None for r in back), [r.error for r in back]
    assert [(r.value["step"], r.value["tier"]) for r in back] == [(3, "durable"), (3, "durable")]
    for before, after in zip(saved, back):
        assert after.value["weight"] == before.value["weight"] and after.value["gen"] == before.value["gen"]


@pytest.mark.slow
def test_torchrun_job_killed_resumes_from_the_local_tier_bit_for_bit(tmp_path):
    from demo import run_pair

    durable, local = str(tmp_path / "ckpt-killed"), str(tmp_path / "local")
    # Saves at steps 20 and 40; every 3rd is durable, so when rank 1 is SIGKILLed at step 53 both
    # are on the local tier only: the relaunch must take step 40 from it, and match bit for bit.
    result, resumes = run_pair(str(tmp_path), nproc=2, steps=70, kill_at="step:53:1", workers=0,
                               killed_extra=["--local-dir", local, "--durable-every", "3"])
    assert resumes == ["resumed from step 40 epoch 1 (local tier)"]
    assert result.identical, result.table
    # Saves 20, 40 (first incarnation) and 60 (after the resume) are none a 3rd save; 60 is the
    # last before close(), so it alone is durable.
    assert steps_at(durable) == [60] and steps_at(local) == [20, 40, 60]


@pytest.mark.slow
@pytest.mark.faults  # make test-faults; make test: SIGTERM in test_preemption.py
def test_sigterm_pre_emption_save_reaches_the_durable_tier(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from demo import HERE
    from test_preemption import max_step

    durable, local, logs = str(tmp_path / "durable"), str(tmp_path / "local"), str(tmp_path / "log")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(HERE)}
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
                              os.path.join(HERE, "train.py"), "--ckpt", durable, "--loss-log", logs,
                              "--steps", "200", "--ckpt-every", "5", "--workers", "0",
                              "--local-dir", local, "--durable-every", "100"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while max_step(logs) < 22 and time.monotonic() < deadline and agent.poll() is None:
        time.sleep(0.05)
    assert agent.poll() is None, agent.stdout.read()[-3000:]
    agent.send_signal(signal.SIGTERM)
    out, _ = agent.communicate(timeout=60)
    preempted = [line for line in open(os.path.join(logs, "rank-0.txt")) if line.startswith("# pre-empted")]
    assert preempted, out[-3000:]
    step = int(preempted[0].split()[-1])
    assert step % 5 != 0  # the pre-emption save itself, not a scheduled one
    assert steps_at(durable) == [step]  # no scheduled save was durable (every 100th): only this one
    assert steps_at(local)[-1] == step


def test_the_command_line_shows_and_verifies_both_tiers(roots, capsys):
    import json

    from distckpt.tools.cli import main

    durable, local = roots
    run_saves(durable, local, range(3), durable_every=2)  # durable: 1, 2; local: 0, 1, 2
    assert main(["ls", durable, "--local-dir", local, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["tier"]) for r in rows] == [(0, "local"), (1, "durable"), (1, "local"),
                                                     (2, "durable"), (2, "local")]
    flip_a_byte(local, 1)
    assert main(["verify", durable, "--local-dir", local, "--all", "--json"]) == 1
    bad = [(r["step"], r["tier"]) for r in json.loads(capsys.readouterr().out) if not r["ok"]]
    assert bad == [(1, "local")]
    assert main(["inspect", durable, "--local-dir", local, "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert (described["manifest"]["step"], described["tier"]) == (2, "local")
    assert main(["inspect", durable, "--local-dir", local, "--step", "0"]) == 0  # the text says which tier too
    assert "(local tier)" in capsys.readouterr().out.splitlines()[0]
    assert main(["ls", durable, "--json"]) == 0  # without --local-dir: the URL alone, as before
    assert [r["step"] for r in json.loads(capsys.readouterr().out)] == [1, 2]


def test_a_local_tier_left_by_another_job_is_never_loaded_as_this_jobs(tmp_path):
    local = str(tmp_path / "local")
    run_saves(str(tmp_path / "exp1"), local, range(3), durable_every=100)  # close(): step 2 durable
    run_saves(str(tmp_path / "exp2"), str(tmp_path / "local2"), range(1), durable_every=1)
    # exp2's job is relaunched with exp1's scratch dir: its local steps 0-2 are exp1's.
    with pytest.warns(distckpt.CheckpointFallbackWarning, match="written by another job"):
        progress, state = load(str(tmp_path / "exp2"), local)
    assert (progress.step, progress.tier) == (0, "durable")
    assert_holds(state, 0)


def _upload_under_cut(tmp_path, k: int | None):
    """Steps 1 and 2 committed locally, step 1 uploaded; then step 2's upload under a power cut
    at its k-th durability operation. Returns (the cut, whether the upload finished)."""
    from powercut import PowerCut, PowerCutNow

    from distckpt.protocol.tiers import upload_step

    durable, local = str(tmp_path / f"durable{k}"), str(tmp_path / f"local{k}")
    mgr = distckpt.CheckpointManager(durable, local_dir=local, durable_every=100)
    mgr.load_latest(step_states.blank())
    mgr.save(1, step_states.state_for(1))
    mgr.save(2, step_states.state_for(2))
    lease = mgr._leases.lease
    assert mgr.local is not None and lease is not None
    upload_step(mgr.local, mgr.storage, 1, lease)
    cut = PowerCut(durable) if k is None else PowerCut(durable, at=k)
    finished = True
    with cut:
        try:
            upload_step(mgr.local, mgr.storage, 2, lease)
        except PowerCutNow:
            finished = False
    mgr._uploads.last_local = None  # close() must not upload step 2 again: the image is taken below
    mgr.close()
    return cut, finished, durable


def test_a_power_cut_at_every_operation_of_an_upload_leaves_the_durable_tier_loadable(tmp_path):
    cut, finished, _ = _upload_under_cut(tmp_path, None)
    total = cut.ops
    assert finished and total >= 5
    outcomes = []
    for k in range(1, total + 2):
        cut, finished, durable = _upload_under_cut(tmp_path, k)
        assert finished == (k == total + 1)
        found = str(tmp_path / f"after{k}")
        cut.image(found)
        progress, state = load(found, None)  # the durable tier alone, as a replaced node sees it
        assert progress.step in (1, 2) and (progress.step == 2 or not finished)
        assert_holds(state, progress.step)
        from distckpt.tools.cli import main as cli_main

        assert cli_main(["verify", found, "--all"]) == 0
        outcomes.append(progress.step)
        shutil.rmtree(found)
    assert outcomes[0] == 1 and outcomes[-1] == 2, outcomes


def test_a_job_restarted_more_often_than_durable_every_still_reaches_the_durable_tier(roots):
    durable, local = roots
    for _incarnation in range(3):  # each incarnation resumes and saves 2 steps, durable_every=4
        state = step_states.blank()
        mgr = distckpt.CheckpointManager(durable, local_dir=local, durable_every=4)
        progress = mgr.load_latest(state)
        start = progress.step + 1 if progress else 0
        for step in range(start, start + 2):
            mgr.save(step, step_states.state_for(step))
        mgr.wait()
        mgr._uploads.last_local = None  # a crash: nothing more is uploaded at close
        mgr.close()
    # the first save after each resume from the local tier is made durable
    assert steps_at(durable) == [2, 4]


def test_a_new_job_in_another_jobs_local_dir_starts_fresh_and_removes_its_steps(tmp_path):
    local = str(tmp_path / "local")
    run_saves(str(tmp_path / "jobA"), local, range(4), durable_every=100)
    run_saves(str(tmp_path / "jobB"), str(tmp_path / "elsewhere"), range(1), durable_every=1)  # B's URL has a lease
    with pytest.warns(distckpt.CheckpointFallbackWarning, match="written by another job"):
        with distckpt.CheckpointManager(str(tmp_path / "jobB"), local_dir=local) as mgr:
            progress = mgr.load_latest(step_states.blank())  # B's own step 0, not A's newer step 3
            assert (progress.step, progress.tier) == (0, "durable")
            mgr.save(1, step_states.state_for(1))
            mgr.save(2, step_states.state_for(2))
    assert steps_at(local) == [1, 2]  # job A's 0-3 gone, job B's in their place
    progress, state = load(str(tmp_path / "jobB"), local)
    assert (progress.step, progress.tier) == (2, "local")
    assert_holds(state, 2)
    # A URL holding no lease at all (a new job, or a mount that is missing): nothing is taken for
    # another job's and nothing removed; the job is told what to check.
    with distckpt.CheckpointManager(str(tmp_path / "jobC"), local_dir=local) as mgr:
        with pytest.raises(distckpt.RunConflictError, match="holds no lease at all"):
            mgr.load_latest(step_states.blank())
        with pytest.raises(distckpt.RunConflictError, match="holds no lease at all"):
            mgr.save(0, step_states.state_for(0))
    assert steps_at(local) == [1, 2]


def test_a_superseded_writer_is_fenced_on_the_local_tier_too(roots):
    durable, local = roots
    old = distckpt.CheckpointManager(durable, local_dir=local, durable_every=2)
    old.load_latest(step_states.blank())
    old.save(0, step_states.state_for(0))
    old.save(1, step_states.state_for(1))
    old.wait()
    with distckpt.CheckpointManager(durable, local_dir=local, durable_every=2) as new:
        assert new.load_latest(step_states.blank()).step == 1
        new.save(2, step_states.state_for(2))
    with pytest.raises(distckpt.FencedError):
        old.save(3, step_states.state_for(3))  # refused before anything is committed, locally too
    old._uploads.last_local = None
    old.close()
    assert 3 not in steps_at(local) and 3 not in steps_at(durable)


def test_an_unreadable_durable_root_is_a_warning_on_load(tmp_path):
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    run_saves(durable, local, range(2), durable_every=100)
    shutil.rmtree(durable)
    open(durable, "w").write("not a directory")  # the URL cannot be listed
    with pytest.warns(distckpt.CheckpointFallbackWarning, match="cannot be read"):
        progress, state = load(durable, local)
    assert (progress.step, progress.tier) == (1, "local")


def test_a_missing_local_dir_on_the_command_line_is_an_error(roots, capsys):
    from distckpt.tools.cli import main

    durable, local = roots
    run_saves(durable, local, range(1), durable_every=1)
    assert main(["ls", durable, "--local-dir", str(local) + "-typo"]) == 2
    assert "no such directory" in capsys.readouterr().err
    with pytest.raises(distckpt.ConfigError, match="local_dir"):
        distckpt.CheckpointManager(durable, local_dir=local + "\0x")


@pytest.mark.parametrize("value", ["s3://bucket/x", "s3:/bucket/x", "gs:/b", "file://", "", "file://otherhost/x"])
def test_a_local_dir_that_is_a_url_or_looks_like_one_names_local_dir(tmp_path, value):
    with pytest.raises(distckpt.ConfigError, match="local_dir="):
        distckpt.CheckpointManager(str(tmp_path / "durable"), local_dir=value)


def _saves_then_dies(durable: str, local: str, steps: int) -> None:
    """A first incarnation (it never resumed) that commits `steps` saves locally, none durable yet,
    and ends without close(): a node lost between uploads."""
    code = (f"import os, sys; sys.path.insert(0, {os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'helpers')!r}); import step_states, distckpt\n"
            f"m = distckpt.CheckpointManager({durable!r}, local_dir={local!r}, durable_every=10)\n"
            "m.load_latest(step_states.blank())\n"
            f"for s in range({steps}): m.save(s, step_states.state_for(s))\n"
            "os._exit(0)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_first_incarnation_lost_with_its_local_disk_starts_over_with_a_warning(roots):
    durable, local = roots
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a new run: nothing to warn about
        assert load(durable, local)[0] is None
    _saves_then_dies(durable, local, 3)
    assert steps_at(local) == [0, 1, 2] and steps_at(durable) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load(durable, local)[0].step == 2  # the node came back: its local tier resumes
    shutil.rmtree(local)  # a replaced node: the only copies are gone
    with pytest.warns(distckpt.CheckpointFallbackWarning, match=r"generation 1 .*began saving.*gone with that disk"):
        assert load(durable, local)[0] is None


def test_a_first_save_while_the_url_is_unreachable_says_why_nothing_was_committed(tmp_path, s3_server, s3_url, proxy):
    """The incarnation's first save takes the lease at the URL; the local files are named with its
    generation, so while the URL cannot be reached nothing can be committed locally either: a clear
    StorageError (not a bare listing timeout), and the next save after the URL is back commits."""
    local = str(tmp_path / "local")
    run_saves(s3_url, local, range(3), durable_every=2, storage_options=fast_options(s3_server.storage_options()))
    options = fast_options(s3_server.storage_options(proxy.endpoint), retries=1, call_timeout=3)
    state = step_states.blank()
    with distckpt.CheckpointManager(s3_url, local_dir=local, storage_options=options) as mgr:
        proxy.add(Rule("*", ".", "status", times=10**6, status=500))
        with pytest.warns(distckpt.CheckpointFallbackWarning):
            assert mgr.load_latest(state).step == 2
        with pytest.raises(distckpt.StorageError, match="first save takes the write lease at .* nothing was committed"):
            mgr.save(3, step_states.state_for(3))
        assert steps_at(local) == [0, 1, 2]
        proxy.rules.clear()
        mgr.save(3, step_states.state_for(3))
        assert 3 in steps_at(local)


def test_a_full_local_disk_says_how_many_checkpoints_it_must_hold(roots, monkeypatch):
    """The step being uploaded is kept on the local tier besides keep_local: the sizing the error
    gives counts it (it said keep_local + 1, one checkpoint short)."""
    from test_manager_local import FullDisk

    from distckpt.storage import local as storage_mod

    durable, local = roots
    with distckpt.CheckpointManager(durable, local_dir=local, keep_local=2, durable_every=2) as mgr:
        mgr.load_latest(step_states.blank())
        mgr.save(0, step_states.state_for(0))
        monkeypatch.setattr(storage_mod, "open", FullDisk(1).open, raising=False)
        with pytest.raises(distckpt.StorageError, match=r"keep_local \+ the one being uploaded \+ 1 = 4 checkpoints"):
            mgr.save(1, step_states.state_for(1))
        monkeypatch.setattr(storage_mod, "open", open, raising=False)


def test_a_named_step_on_neither_tier_lists_what_is_committed(roots):
    durable, local = roots
    run_saves(durable, local, range(4), durable_every=2)  # durable: 1, 3; local: 0-3
    with pytest.raises(distckpt.IncompatibleCheckpointError,
                       match=r"step 7 is not committed at .* \(committed: \[3, 1\]\) nor on every node's local tier "
                             r"\(common: \[3, 2, 1, 0\]\)"):
        load(durable, local, step=7)


def test_a_restart_trims_the_local_tier_to_keep_local_before_it_writes(roots):
    """A local disk sized for keep_local + 1 checkpoints, found holding keep_local + 1 (the step an
    upload spared, another incarnation's keep_local): the steps keep_local no longer keeps go before
    the write, so the save fits (they went only after the commit: ENOSPC at every save, for good)."""
    durable, local = roots
    run_saves(durable, local, range(3), durable_every=10)  # keep_local unset: 0, 1, 2 stay
    seen: list = []

    def during_write(name: str, context: dict) -> None:
        if name == "save/rank-files-written":
            seen.append((steps_at(local), sorted(os.listdir(local))))

    undo = faults.on_point(during_write)
    try:
        with distckpt.CheckpointManager(durable, local_dir=local, keep_local=2, durable_every=10) as mgr:
            assert mgr.load_latest(step_states.blank()).step == 2
            mgr.save(3, step_states.state_for(3))
    finally:
        undo()
    committed, names = seen[0]
    assert committed == [1, 2] and mf.step_dir(0) not in names, seen
    assert steps_at(local) == [2, 3]
    assert load(durable, local)[0].step == 3


# -- a durable tier unreachable at close(), then back; a superseded node that returns ----------------


def _durable_only(s3_server, s3_url: str) -> tuple[distckpt.Progress | None, dict]:
    """What a fresh job that reads the URL alone (no local tier) resumes from."""
    state = step_states.blank()
    with distckpt.CheckpointManager(s3_url, storage_options=fast_options(s3_server.storage_options())) as reader:
        return reader.load_latest(state), state


# make test runs the reported case (a retried close()); make test-faults every ending, sync and async
@pytest.mark.parametrize("ending, async_save", [
    ("close", False), pytest.param("close", True, marks=pytest.mark.faults),
    pytest.param("wait", False, marks=pytest.mark.faults), pytest.param("wait", True, marks=pytest.mark.faults),
    pytest.param("pre-emption", False, marks=pytest.mark.faults),
    pytest.param("pre-emption", True, marks=pytest.mark.faults)])
def test_an_upload_that_failed_is_retried_by_the_next_call_never_skipped(tmp_path, s3_server, s3_url, proxy, caplog,
                                                                        async_save, ending):
    """The durable tier unreachable when the newest local step is to be uploaded (at close(), at a
    durable save then wait(), at the pre-emption save), then back: the retried call uploads it
    (saying so in the log), and fails again while the URL is still down. A close() that failed
    once returned at once when retried, and a second wait() said nothing: the newest steps stayed
    on node-local disk only."""
    import logging
    import signal

    local = str(tmp_path / "local")
    options = fast_options(s3_server.storage_options(proxy.endpoint), retries=1)
    mgr = distckpt.CheckpointManager(s3_url, local_dir=local, durable_every=3, async_save=async_save,
                                     storage_options=options, preemption_signals=(signal.SIGUSR1,))
    mgr.load_latest(step_states.blank())
    for step in range(2):  # the first takes the lease at the URL; neither is durable (every 3rd)
        mgr.save(step, step_states.state_for(step))
    mgr.wait()
    down = Rule("*", ".", "status", times=10**6, status=500)
    proxy.add(down)
    newest = 3 if ending == "pre-emption" else 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DurableUploadWarning)
        mgr.save(2, step_states.state_for(2))  # durable: its upload fails
        if ending == "close":
            with pytest.raises(distckpt.AsyncSaveError, match=r"close\(\) again uploads it"):
                mgr.close()
        elif ending == "wait":
            with pytest.warns(DurableUploadWarning, match=r"step\(s\) \[2\]"):
                mgr.wait()
        else:
            assert not mgr.preemption_requested()  # armed: the signal is heard from here on
            os.kill(os.getpid(), signal.SIGUSR1)
            assert mgr.preemption_requested()
            with pytest.raises(distckpt.AsyncSaveError, match="not durable"):
                mgr.save(3, step_states.state_for(3))  # the pre-emption save: its upload fails
        assert steps_at(local)[-1] == newest
        # still down: the call again fails again, never returning as if it were done
        asked = down.hits
        if ending == "wait":
            with pytest.warns(DurableUploadWarning, match=rf"step\(s\) \[{newest}\]"):
                mgr.wait()
        else:
            with pytest.raises(distckpt.AsyncSaveError, match=rf"step\(s\) \[{newest}\]"):
                mgr.close()
        assert down.hits > asked  # it asked the URL again
    proxy.rules.clear()  # the store is back
    with caplog.at_level(logging.INFO, logger="distckpt"):
        if ending == "wait":
            mgr.wait()
        mgr.close()
    assert any(f"step {newest} is committed on the local tier" in r.getMessage() and "uploading it again" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    progress, state = _durable_only(s3_server, s3_url)
    assert progress.step == newest
    assert_holds(state, newest)


def test_a_failed_background_save_at_close_still_makes_the_previous_step_durable(tmp_path, s3_server, s3_url):
    """close() whose save in flight fails raises that failure, after the newest step committed
    before it reached the URL (close() shut the manager down at the failure: that step stayed on
    node-local disk, and close() again returned at once)."""
    local = str(tmp_path / "local")
    options = fast_options(s3_server.storage_options())

    def fail_the_copy(name: str, context: dict) -> None:
        if name == "save/snapshot-copy" and context["step"] == 3:
            raise OSError("the copy failed")

    mgr = distckpt.CheckpointManager(s3_url, local_dir=local, durable_every=100, async_save=True,
                                     storage_options=options)
    mgr.load_latest(step_states.blank())
    for step in range(3):
        mgr.save(step, step_states.state_for(step))
    undo = faults.on_point(fail_the_copy)
    try:
        mgr.save(3, step_states.state_for(3))
        with pytest.raises(distckpt.AsyncSaveError, match="background save of step 3 failed"):
            mgr.close()
    finally:
        undo()
    mgr.close()  # closed: nothing is left to do
    assert steps_at(local) == [0, 1, 2]
    progress, state = _durable_only(s3_server, s3_url)
    assert progress.step == 2
    assert_holds(state, 2)


def test_a_commit_record_that_could_not_be_written_is_written_at_the_next_commit(tmp_path, s3_server, s3_url, proxy):
    """The record of an incarnation's first commit at the URL (fencing.record_commit) is best
    effort; one that failed was never tried again, so a load finding every step removed later
    took the run for a fresh start."""
    from distckpt.protocol import fencing

    options = fast_options(s3_server.storage_options(proxy.endpoint), retries=1)
    with distckpt.CheckpointManager(s3_url, storage_options=options) as mgr:
        mgr.load_latest(step_states.blank())
        proxy.add(Rule("PUT", "committed-gen", "status", times=10**6, status=500))
        mgr.save(0, step_states.state_for(0))
        durable = open_storage(s3_url, fast_options(s3_server.storage_options()))
        assert fencing.newest_commit_record(durable) is None
        proxy.rules.clear()
        mgr.save(1, step_states.state_for(1))
    assert fencing.newest_commit_record(durable)["step"] == 1


def _incarnation(s3_url: str, local: str, options: dict, steps: list[int], durable_every: int, ending: str) -> None:
    """One incarnation in a process of its own on the node whose local tier is `local`: it resumes,
    saves `steps`, and then closes; or dies after them ("dies": a lost node, nothing more uploaded);
    or dies in its first save just after taking the write lease ("dies-with-the-lease")."""
    code = (f"import os, sys; sys.path.insert(0, {os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'helpers')!r}); import step_states, distckpt\n"
            "from distckpt.runtime import faults\n"
            f"m = distckpt.CheckpointManager({s3_url!r}, local_dir={local!r}, durable_every={durable_every}, "
            f"storage_options={options!r})\n"
            "m.load_latest(step_states.blank())\n"
            f"for s in {steps!r}: m.save(s, step_states.state_for(s))\n"
            "m.wait()\n"
            f"ending = {ending!r}\n"
            "if ending == 'dies': os._exit(0)\n"
            "if ending == 'dies-with-the-lease':\n"
            "    faults.on_point(lambda name, context: os._exit(0) if name == 'save/captured' else None)\n"
            "    m.save(99, step_states.state_for(99))\n"
            "m.close()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# gen 1 on node X saves 0-4 (every durable_every-th reaches the URL) and dies; gen 2 on node Y
# resumes from the URL, saves `later` and closes (or dies having taken its lease, `later` empty).
# (durable_every, later, whether X's first save after it returns is refused)
RETURNS = {
    "superseded": (3, [3, 4], True),  # gen 2 resumed from 2 and closed at 4: X's 3, 4 are a zombie's
    "overtaken": (5, [5, 6], True),  # gen 2 resumed from X's own step 4 and went on to 6
    "took-over-from-4-and-died": (5, [], False),  # nothing of gen 2's committed: X may go on from 4
    "never-replaced": (3, None, False),  # no gen 2: X's own branch
}


@pytest.mark.parametrize("case", [c if c == "superseded" else pytest.param(c, marks=pytest.mark.faults)  # make test: superseded
                                  for c in sorted(RETURNS)])
def test_a_node_whose_branch_was_superseded_returns_while_the_url_is_unreachable(tmp_path, s3_server, s3_url, proxy,
                                                                                   case):
    """Node X comes back while the URL cannot be read and resumes from its own local tier (a
    warning): its first save checks the URL's leases and steps once it reaches them, and refuses to
    continue a branch a newer incarnation superseded or went past, naming it and what to do. It took
    a new lease instead, and silently made the newer incarnation's steps a zombie's."""
    durable_every, later, refused = RETURNS[case]
    direct = fast_options(s3_server.storage_options())
    node_x, node_y = str(tmp_path / "node-x"), str(tmp_path / "node-y")
    _incarnation(s3_url, node_x, direct, list(range(5)), durable_every, "dies")
    if later is not None:
        _incarnation(s3_url, node_y, direct, later, durable_every, "close" if later else "dies-with-the-lease")
    before = steps_at_url(s3_server, s3_url)
    via_proxy = fast_options(s3_server.storage_options(proxy.endpoint), retries=1)
    mgr = distckpt.CheckpointManager(s3_url, local_dir=node_x, durable_every=durable_every, storage_options=via_proxy)
    proxy.add(Rule("*", ".", "status", times=10**6, status=500))
    with pytest.warns(distckpt.CheckpointFallbackWarning, match="cannot be read"):
        progress = mgr.load_latest(step_states.blank())
    assert (progress.step, progress.tier, progress.generation) == (4, "local", 1)
    proxy.rules.clear()  # the URL is back before the first save
    if not refused:
        mgr.save(5, step_states.state_for(5))
        mgr.close()
        progress, state = _durable_only(s3_server, s3_url)
        assert progress.step == 5
        assert_holds(state, 5)
        return
    for _attempt in range(2):  # refused at every save, not only the first
        with pytest.raises(distckpt.FencedError, match=r"resumed from step 4 of the local tier .* generation 1\) while "
                                                       r".* could not be read.*Restart the job"):
            mgr.save(5, step_states.state_for(5))
    mgr.close()
    assert steps_at_url(s3_server, s3_url) == before and 5 not in steps_at(node_x)
    # the restart the error asks for: load_latest reads the URL and resumes the run's line
    state = step_states.blank()
    with distckpt.CheckpointManager(s3_url, local_dir=node_x, storage_options=direct) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", distckpt.CheckpointFallbackWarning)  # X's superseded steps skipped
            progress = mgr.load_latest(state)
        assert (progress.step, progress.tier) == (later[-1], "durable")
        assert_holds(state, later[-1])
        mgr.save(later[-1] + 1, step_states.state_for(later[-1] + 1))
    assert _durable_only(s3_server, s3_url)[0].step == later[-1] + 1


def steps_at_url(s3_server, s3_url: str) -> list[int]:
    return sorted(list_committed(open_storage(s3_url, fast_options(s3_server.storage_options()))))
