"""Zombie writers: a superseded incarnation cannot commit, and its late output is never loaded.

Each backend runs the same tests: local disk, and S3 on the real SeaweedFS server.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import time
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distckpt
from distckpt.protocol import fencing
from distckpt.runtime import faults
from distckpt.storage import open_storage
from distckpt.tools.cli import main as cli_main


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path, monkeypatch):
    """(url, storage_options) on local disk or on the real S3 server (whose settings are also
    put in the environment, where the command line reads them)."""
    if request.param == "local":
        return str(tmp_path / "ckpt"), None
    s3 = request.getfixturevalue("s3_server")
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    url = request.getfixturevalue("s3_url")
    return url, s3.storage_options()


def manager(where, **kw):
    url, options = where
    return distckpt.CheckpointManager(url, storage_options=options, **kw)


def value_of(where) -> tuple[int, float]:
    state = {"w": torch.zeros(4)}
    with manager(where) as mgr:
        progress = mgr.load_latest(state)
    return progress.step, float(state["w"][0])


def test_a_superseded_writer_cannot_commit(where):
    old = manager(where)
    old.save(1, {"w": torch.full((4,), 1.0)})
    old.save(2, {"w": torch.full((4,), 2.0)})
    # The job is restarted elsewhere while the old incarnation still runs.
    new = manager(where)
    state = {"w": torch.zeros(4)}
    assert new.load_latest(state).step == 2
    new.save(3, {"w": torch.full((4,), 3.0)})
    with pytest.raises(distckpt.FencedError, match="superseded .* newer incarnation holds generation 2"):
        old.save(4, {"w": torch.full((4,), 99.0)})
    assert new.committed_steps() == [3, 2, 1]
    new.save(4, {"w": torch.full((4,), 4.0)})  # the old one's attempt left nothing in the way
    assert value_of(where) == (4, 4.0)
    new.close()
    old.close()


def test_a_superseded_writer_saving_a_step_the_new_one_committed_is_fenced(where):
    """It was told "step 3 is already committed ... resume with load_latest()", advice for a
    fresh job, not for a zombie that must stop."""
    old = manager(where)
    old.save(1, {"w": torch.full((4,), 1.0)})
    new = manager(where)
    new.load_latest({"w": torch.zeros(4)})
    new.save(3, {"w": torch.full((4,), 3.0)})
    with pytest.raises(distckpt.FencedError, match="by generation 2, newer than this writer's 1"):
        old.save(3, {"w": torch.full((4,), 99.0)})
    assert value_of(where) == (3, 3.0)
    new.close()
    old.close()


def test_an_async_zombie_save_fails_at_the_next_call(where):
    old = manager(where, async_save=True)
    old.save(1, {"w": torch.full((4,), 1.0)})
    old.wait()
    new = manager(where)
    new.load_latest({"w": torch.zeros(4)})
    new.save(2, {"w": torch.full((4,), 2.0)})
    old.save(3, {"w": torch.full((4,), 99.0)})  # staged; the write is fenced in the background
    with pytest.raises(distckpt.AsyncSaveError, match="FencedError"):
        old.wait()
    assert new.committed_steps() == [2, 1]
    new.close()
    old.close()


def test_a_zombie_commit_that_slipped_through_is_never_loaded(where, monkeypatch, capsys):
    """The window between a writer's fence check and its marker: simulate a zombie that passed
    the check just before the new incarnation took over, and committed after."""
    old = manager(where)
    old.save(1, {"w": torch.full((4,), 1.0)})
    new = manager(where)
    new.load_latest({"w": torch.zeros(4)})  # resumes from 1
    new.save(2, {"w": torch.full((4,), 2.0)})
    with monkeypatch.context() as m:
        m.setattr(fencing, "check_current", lambda storage, lease: None)  # the zombie's view
        old.save(5, {"w": torch.full((4,), 99.0)})
    assert 5 in new.committed_steps()  # its marker is there ...
    with pytest.warns(distckpt.CheckpointFallbackWarning, match="superseded writer"):
        assert value_of(where) == (2, 2.0)  # ... but the loader never prefers it
    url, options = where
    assert cli_main(["verify", url, "--step", "5"]) == 1  # named, it is refused, as load(state, 5) refuses it
    assert "superseded writer" in capsys.readouterr().out
    assert cli_main(["verify", url, "--step", "2"]) == 0
    capsys.readouterr()
    for listed in (["--all"], []):  # listed, it is the last resort: its files are checked, not held against it
        assert cli_main(["verify", url, *listed]) == 0
        out = capsys.readouterr().out
        assert "step 5: ok (superseded, loaded only as the last resort" in out and "BAD" not in out
    store = open_storage(url, options) if options else open_storage(url)
    payload = "step-000000005/" + next(n for n in store.list_files("step-000000005") if n.endswith(".safetensors"))
    data = bytearray(store.read_bytes(payload))
    data[-1] ^= 0x01
    store.write_file(payload, [bytes(data)])
    assert cli_main(["verify", url, "--all"]) == 1  # damage to it is still damage
    assert "step 5: BAD" in capsys.readouterr().out
    assert cli_main(["ls", url]) == 0
    listing = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "superseded: " in listing["5"] and "damaged" not in listing["5"]
    assert listing["2"].rstrip().endswith("committed (unverified)")
    assert cli_main(["ls", url, "--verify"]) == 1  # its files read: the superseded step's damage shows
    listing = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "damaged: " in listing["5"] and listing["2"].rstrip().endswith("committed, verified")
    with pytest.raises(distckpt.SupersededCheckpointError, match="superseded writer"):
        with manager(where) as reader:
            reader.load({"w": torch.zeros(4)}, 5)
    new.save(5, {"w": torch.full((4,), 5.0)})  # the live incarnation replaces the zombie's step
    assert value_of(where) == (5, 5.0)
    new.close()
    old.close()


def test_replacing_a_zombies_higher_steps_is_no_branch(where):
    """A zombie committed steps 3 and 4 after the new incarnation loaded step 2; the new one's
    save of step 3 was warned to be "below the newest committed step 4", a superseded writer's
    step that load_latest never resumes from and retention removes."""
    old = manager(where)
    for step in range(3):
        old.save(step, {"w": torch.full((4,), float(step))})
    new = manager(where)
    assert new.load_latest({"w": torch.zeros(4)}).step == 2
    old.save(3, {"w": torch.full((4,), 99.0)})  # before the new incarnation's first save takes the lease
    old.save(4, {"w": torch.full((4,), 99.0)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new.save(3, {"w": torch.full((4,), 3.0)})
    assert not [str(w.message) for w in caught if issubclass(w.category, distckpt.CheckpointWarning)]
    assert value_of(where) == (3, 3.0)
    new.close()
    old.close()


def _save_killed_at(mgr, point: str, step: int) -> None:
    """`mgr.save(step, ...)` failing at the fault point `point`, as a process killed there would."""
    def killed(name, context):
        if name == point:
            raise RuntimeError(f"killed at {point}")

    stop = faults.on_point(killed)
    try:
        with pytest.raises(Exception, match="killed at"):
            mgr.save(step, {"w": torch.full((4,), float(step) + 0.5)})
    finally:
        stop()


def test_a_new_incarnation_stopped_before_its_first_commit_leaves_the_old_writers_newest_step(where):
    """The new incarnation loaded step 20; the old one, still running with keep_last=1, commits 30
    and removes 20; the new one takes its lease (30 is now a superseded writer's) and dies before
    its first commit. Only 30 is left: it is loaded as the last resort, loudly, rather than
    nothing; the next incarnation resumes from it, fences the old writer and goes on."""
    old = manager(where, keep_last=1)
    old.save(10, {"w": torch.full((4,), 10.0)})
    old.save(20, {"w": torch.full((4,), 20.0)})
    new = manager(where, keep_last=1)
    assert new.load_latest({"w": torch.zeros(4)}).step == 20
    old.save(30, {"w": torch.full((4,), 30.0)})  # the old one has not noticed: 20 is removed
    old._pruner.sweeper.drain()

    _save_killed_at(new, "save/manifest-written", 21)  # after its lease, before its first commit
    new.close()
    with pytest.warns(distckpt.CheckpointFallbackWarning, match="last resort"):
        assert value_of(where) == (30, 30.0)
    assert cli_main(["prune", where[0], "--keep-last", "1"]) == 0  # keeps the last resort: nothing else is left
    with pytest.warns(distckpt.CheckpointFallbackWarning, match="last resort"):
        assert value_of(where) == (30, 30.0)
    with pytest.raises(distckpt.SupersededCheckpointError, match="superseded writer"):
        with manager(where) as reader:
            reader.load({"w": torch.zeros(4)}, 30)  # named explicitly: refused, as before
    third = manager(where, keep_last=1)
    with pytest.warns(distckpt.CheckpointFallbackWarning, match="last resort"):
        assert third.load_latest({"w": torch.zeros(4)}).step == 30
    third.save(31, {"w": torch.full((4,), 31.0)})
    with pytest.raises(distckpt.FencedError):
        old.save(40, {"w": torch.full((4,), 40.0)})
    third._pruner.sweeper.drain()
    assert third.committed_steps() == [31]
    assert value_of(where) == (31, 31.0)
    third.close()
    old.close()


def _newer_incarnation_died_before_its_first_commit(where):
    """Generation 1 commits 0-2; generation 2 resumes from 2 and dies in its first save (after
    its lease); generation 1, still running, commits 3 and 4: a superseded writer's output."""
    old = manager(where, keep_last=10)
    for step in range(3):
        old.save(step, {"w": torch.full((4,), float(step))})
    new = manager(where, keep_last=10)
    assert new.load_latest({"w": torch.zeros(4)}).step == 2
    for step in (3, 4):
        old.save(step, {"w": torch.full((4,), 100.0 + step)})
    _save_killed_at(new, "save/gathered", 3)
    new.close()
    return old


def test_an_unreadable_lease_fences_and_never_lets_a_superseded_step_load(where):
    """A damaged lease still names its generation: it fences every older writer, and the older
    writers' steps are not loaded (which one it resumed from cannot be told): a clear error
    instead of the zombie's newest step, and after the lease is restored, the resume point."""
    old = _newer_incarnation_died_before_its_first_commit(where)
    with pytest.warns(distckpt.CheckpointFallbackWarning):
        assert value_of(where) == (2, 2.0)  # the lease intact: the resume point
    storage = open_storage(where[0], where[1])
    intact = storage.read_bytes(fencing.lease_path(2))
    for damage in (b"\x00garbage", b"", b"{}", b'{"floor": "x", "run_id": 1}', b"[1]"):
        storage.remove_file(fencing.lease_path(2))
        storage.create_exclusive(fencing.lease_path(2), damage)
        with pytest.raises(distckpt.CorruptCheckpointError, match="gen-000000002.json .*unreadable|lease is unreadable"):
            value_of(where)
        with pytest.raises(distckpt.FencedError, match="unreadable"):
            old.save(5, {"w": torch.full((4,), 105.0)})
    assert 5 not in old.committed_steps()
    storage.remove_file(fencing.lease_path(2))
    storage.create_exclusive(fencing.lease_path(2), intact)
    with pytest.warns(distckpt.CheckpointFallbackWarning):
        assert value_of(where) == (2, 2.0)
    old.close()


def test_a_lease_the_store_fails_to_read_fails_the_load_and_the_save(where, monkeypatch):
    """Not damage: the store failing (after its retries) on a lease is a StorageError, never a
    lease taken as absent (which let a zombie commit and its steps load)."""
    old = _newer_incarnation_died_before_its_first_commit(where)
    storage_type = type(open_storage(where[0], where[1]))
    read_bytes = storage_type.read_bytes

    def failing(self, path, *args, **kwargs):
        if path == fencing.lease_path(2):
            raise OSError(5, "injected: the store answered 500")
        return read_bytes(self, path, *args, **kwargs)

    monkeypatch.setattr(storage_type, "read_bytes", failing)
    state = {"w": torch.full((4,), 7.0)}
    with manager(where) as reader:
        with pytest.raises(distckpt.StorageError, match="write lease .*gen-000000002.json failed"):
            reader.load_latest(state)
    assert torch.equal(state["w"], torch.full((4,), 7.0))
    with pytest.raises(distckpt.StorageError, match="write lease"):
        old.save(5, {"w": torch.full((4,), 105.0)})
    monkeypatch.undo()
    assert 5 not in old.committed_steps()
    with pytest.warns(distckpt.CheckpointFallbackWarning):
        assert value_of(where) == (2, 2.0)
    old.close()


@pytest.mark.parametrize("point", ["save/gathered", "save/replicated-written", "save/manifest-written"])
def test_a_new_incarnation_killed_while_it_replaces_a_zombies_step_never_leaves_a_silent_fresh_start(where, point,
                                                                                                    capsys):
    """The new incarnation's first save is the step the old one committed after the takeover (the
    only step left: the old one's keep_last=1 removed the resume step). The zombie's commit is taken
    down only once the new save's files are durable, so a death before that leaves it loadable (the
    last resort); a death inside the few operations after it (its marker gone, the new one not yet
    written) leaves nothing committed, and the next load says so instead of starting over."""
    old = manager(where, keep_last=1)
    old.save(1, {"w": torch.full((4,), 1.0)})
    old.save(2, {"w": torch.full((4,), 2.0)})
    new = manager(where, keep_last=1)
    assert new.load_latest({"w": torch.zeros(4)}).step == 2
    old.save(3, {"w": torch.full((4,), 3.0)})
    old._pruner.sweeper.drain()

    _save_killed_at(new, point, 3)
    new.close()
    if point == "save/manifest-written":
        with pytest.raises(distckpt.CorruptCheckpointError, match="had resumed from a committed step"):
            value_of(where)
        assert cli_main(["ls", where[0]]) == 0
        assert "no committed step, but generation 2" in capsys.readouterr().out
    else:
        with pytest.warns(distckpt.CheckpointFallbackWarning, match="last resort"):
            assert value_of(where) == (3, 3.0)
    old.close()


def test_a_reader_never_fences_the_writer(where):
    writer = manager(where)
    writer.save(1, {"w": torch.full((4,), 1.0)})
    for _ in range(2):  # an evaluation job, the CLI: read only
        assert value_of(where) == (1, 1.0)
        assert cli_main(["verify", where[0], "--all"]) == 0
    writer.save(2, {"w": torch.full((4,), 2.0)})
    assert value_of(where) == (2, 2.0)
    writer.close()


def test_a_resumed_job_overwrites_a_damaged_step_it_fell_back_over(where):
    """Resumed from step 1 because step 2 was damaged: the new incarnation's step 2 replaces it."""
    with manager(where) as mgr:
        mgr.save(1, {"w": torch.full((4,), 1.0)})
        mgr.save(2, {"w": torch.full((4,), 2.0)})
    store = open_storage(*where) if where[1] else open_storage(where[0])
    store.write_file("step-000000002/manifest.json", [b"{}"])  # damaged after commit
    state = {"w": torch.zeros(4)}
    with manager(where) as mgr:
        with pytest.warns(distckpt.CheckpointFallbackWarning):
            assert mgr.load_latest(state).step == 1
        mgr.save(2, {"w": torch.full((4,), 22.0)})
    assert value_of(where) == (2, 22.0)


@pytest.mark.parametrize("trial", [0, pytest.param(1, marks=pytest.mark.faults), pytest.param(2, marks=pytest.mark.faults)])
def test_two_concurrent_saves_of_one_step_exactly_one_commits(where, trial):
    url, options = where
    start_at = time.time() + 4.0  # after both processes imported torch
    with cf.ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(_save_at, url, options, who, 7, start_at) for who in (1, 2)]
        results = [f.result(timeout=120) for f in futures]
    winners = [r for r in results if r["ok"]]
    losers = [r for r in results if not r["ok"]]
    assert len(winners) == 1, results
    # the loser either lost the exclusive create, or saw the winner's commit first (it never loaded)
    assert losers[0]["error_type"] in ("FencedError", "CheckpointExistsError", "RunConflictError"), losers
    step, value = value_of(where)
    assert (step, value) == (7, float(winners[0]["who"]))
    assert cli_main(["verify", url, "--all"]) == 0


def _save_at(*args):
    import fence_workers

    return fence_workers.save_at(*args)


def test_leases_of_a_job_restarted_many_times_stay_bounded(where):
    """Each restart takes a lease; the live writer prunes those that can no longer matter."""
    managers = []
    for step in range(1, 15):
        mgr = manager(where, keep_last=2)
        mgr.load_latest({"w": torch.zeros(4)})
        mgr.save(step, {"w": torch.full((4,), float(step))})
        managers.append(mgr)
    store = open_storage(*where) if where[1] else open_storage(where[0])
    assert len(fencing.lease_generations(store)) <= fencing.PRUNE_ABOVE + 1
    assert fencing.lease_generations(store)[-1] == 14
    with pytest.raises(distckpt.FencedError):  # every older incarnation is still fenced
        managers[0].save(99, {"w": torch.zeros(4)})
    with pytest.raises(distckpt.FencedError):
        managers[-2].save(99, {"w": torch.zeros(4)})
    assert value_of(where) == (14, 14.0)
    for mgr in managers:
        mgr.close()


def test_the_commit_index_reads_generations_from_the_listing_as_the_markers_say(tmp_path):
    """Lease pruning takes each committed step's generation from its replicated file's name
    (no marker read per step); it must equal the marker's, and a leftover of an older attempt in
    the same directory may only lower it (which keeps more leases)."""
    import torch

    from distckpt.io import manifest as mf
    from distckpt.protocol.commit import CommitIndex, read_marker
    from distckpt.storage import open_storage

    root = str(tmp_path / "c")
    state = {"w": torch.arange(4.0)}
    for incarnation in range(3):  # three generations, one step each
        with distckpt.CheckpointManager(root) as mgr:
            mgr.load_latest(state)
            mgr.save(incarnation + 1, state)
    storage = open_storage(root)
    index = CommitIndex(storage)
    index.scan()
    steps = index.listing.committed()
    markers = [read_marker(storage, s).generation for s in steps]
    assert index.generations() == markers and len(set(markers)) == 3
    newest = steps[0]
    storage.write_file(f"{mf.step_dir(newest)}/{mf.replicated_file(1)}", [b"leftover of generation 1"])
    index.scan()  # lists only what sorts after the newest step: the file is seen at the next full listing
    assert index.generations()[0] == markers[0]
    fresh = CommitIndex(storage)
    fresh.scan()
    assert fresh.generations()[0] == 1  # lowered, never raised


@pytest.mark.parametrize("keep_last", [1, 2])
def test_retention_never_counts_or_keeps_a_zombies_steps(where, monkeypatch, keep_last):
    """A zombie's slipped-through commit is never loaded, so it counts toward no keep_last: not
    in the zombie's own retention (which would delete the live job's only steps) nor in the live
    job's; the live job's retention removes it."""
    old = manager(where, keep_last=keep_last)
    old.save(1, {"w": torch.full((4,), 1.0)})
    new = manager(where, keep_last=keep_last)
    new.load_latest({"w": torch.zeros(4)})  # resumes from 1
    new.save(2, {"w": torch.full((4,), 2.0)})
    with monkeypatch.context() as m:
        m.setattr(fencing, "check_current", lambda storage, lease: None)  # the zombie's view
        old.save(5, {"w": torch.full((4,), 99.0)})
        old.save(6, {"w": torch.full((4,), 98.0)})
    old._pruner.sweeper.drain()
    # The live job's newest step survives the zombie's retention: a crash now resumes from it.
    with pytest.warns(distckpt.CheckpointFallbackWarning, match="superseded writer"):
        assert value_of(where) == (2, 2.0)
    new.save(3, {"w": torch.full((4,), 3.0)})
    new._pruner.sweeper.drain()
    live = [3, 2, 1][:keep_last]
    assert new.committed_steps() == live  # the zombie's steps are gone, the live ones counted alone
    assert value_of(where) == (3, 3.0)
    new.close()
    old.close()


def test_prune_counts_a_zombies_step_toward_nothing_and_removes_it(where, monkeypatch, capsys):
    old = manager(where)
    old.save(1, {"w": torch.full((4,), 1.0)})
    new = manager(where)
    new.load_latest({"w": torch.zeros(4)})
    new.save(2, {"w": torch.full((4,), 2.0)})
    with monkeypatch.context() as m:
        m.setattr(fencing, "check_current", lambda storage, lease: None)  # the zombie's view
        old.save(5, {"w": torch.full((4,), 99.0)})
    url = where[0]
    assert cli_main(["prune", url, "--keep-last", "1", "--dry-run"]) == 0
    assert capsys.readouterr().out.split() == "would remove step 1 would remove step 5".split()
    assert cli_main(["prune", url, "--keep-last", "1"]) == 0
    assert new.committed_steps() == [2]
    assert value_of(where) == (2, 2.0)
    new.close()
    old.close()


_EXAMPLES = int(os.environ.get("DISTCKPT_HYPOTHESIS_EXAMPLES", "40"))


@settings(max_examples=max(10, _EXAMPLES // 2), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keep_last=st.integers(1, 3), keep_best=st.sampled_from([None, 1]),
       ops=st.lists(st.tuples(st.sampled_from(["save", "save", "zombie", "restart"]), st.integers(0, 40)),
                    min_size=1, max_size=14))
def test_housekeeping_never_loses_the_live_jobs_newest_step(tmp_path_factory, keep_last, keep_best, ops):
    """Random sequences of the live job's saves, restarts (the old incarnation lives on) and a
    superseded incarnation's commits slipping past the fence (at any free step number, metric
    better than everything), under keep_last / keep_best: after each, a fresh load returns the
    live job's newest step with exactly its values."""
    root = str(tmp_path_factory.mktemp("housekeeping"))
    kw = {"keep_last": keep_last, "keep_best": keep_best, "best_mode": "min"}
    live = distckpt.CheckpointManager(root, **kw)
    zombie = None
    newest: tuple[int, float] | None = None  # the live job's newest step and its value
    step = 0
    leased = {"live": False, "zombie": False}  # a writer takes its lease at its first save
    for op, number in ops:
        if op == "save":
            step += 1
            live.save(step, {"w": torch.full((4,), float(step))}, metric=float(100 - step))
            newest, leased["live"] = (step, float(step)), True
        elif op == "restart":
            if zombie is not None:
                zombie.close()
            zombie, live = live, distckpt.CheckpointManager(root, **kw)
            leased = {"live": False, "zombie": leased["live"]}
            state = {"w": torch.zeros(4)}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", distckpt.CheckpointFallbackWarning)
                progress = live.load_latest(state)
            assert (progress and (progress.step, float(state["w"][0]))) == (newest or None)
        elif zombie is not None and leased["zombie"] and leased["live"] and number not in live.committed_steps():
            # Superseded: both hold leases, the live one's the newer (before the live job's first
            # save after its resume, the old incarnation is still the directory's writer).
            with pytest.MonkeyPatch.context() as m:
                m.setattr(fencing, "check_current", lambda storage, lease: None)  # the zombie's view
                try:
                    zombie.save(number, {"w": torch.full((4,), -1.0)}, metric=-1000.0)
                except (distckpt.CheckpointExistsError, distckpt.FencedError):
                    pass  # the live job took that step meanwhile
        live._pruner.sweeper.drain()
        if newest is not None:
            state = {"w": torch.zeros(4)}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", distckpt.CheckpointFallbackWarning)
                with distckpt.CheckpointManager(root) as reader:
                    progress = reader.load_latest(state)
            assert progress is not None and (progress.step, float(state["w"][0])) == newest, (op, number)
    live.close()
    if zombie is not None:
        zombie.close()


@pytest.mark.parametrize("second", ["none", "resumed-without-saving"])
def test_a_run_whose_every_step_was_removed_is_never_started_over_silently(where, second, capsys):
    """A first run committed steps 1-3 (its lease: resumed from nothing) and every step directory
    was removed afterwards (by hand, a bucket's lifecycle rule); also after a second incarnation
    that resumed but never saved (it takes no lease). The next load started the run over without
    a word. Its first commit's record says the root held a commit: refused now, and `ls` says so;
    removing fence/ (starting over on purpose) is a fresh start again."""
    url, options = where
    with manager(where) as first:
        for step in (1, 2, 3):
            first.save(step, {"w": torch.full((4,), float(step))})
    if second == "resumed-without-saving":
        assert value_of(where) == (3, 3.0)
    storage = open_storage(url, options)
    for step in (1, 2, 3):
        storage.remove_tree(f"step-{step:09d}")
    with pytest.raises(distckpt.CorruptCheckpointError, match="generation 1 of a job committed step 1 "):
        value_of(where)
    assert cli_main(["ls", url]) == 0
    assert "no committed step, but generation 1 committed one here" in capsys.readouterr().out
    storage.remove_tree(fencing.FENCE_DIR)
    with manager(where) as mgr:
        assert mgr.load_latest({"w": torch.zeros(4)}) is None


def test_one_record_of_a_first_commit_stays_however_many_incarnations_commit(where):
    url, options = where
    for generation in (1, 2, 3):
        with manager(where) as mgr:
            mgr.load_latest({"w": torch.zeros(4)})
            mgr.save(10 * generation, {"w": torch.full((4,), float(generation))})
            mgr.save(10 * generation + 1, {"w": torch.full((4,), float(generation))})
    storage = open_storage(url, options)
    assert fencing.commit_record_generations(storage) == [3]
    assert fencing.newest_commit_record(storage)["step"] == 30


def test_a_record_that_cannot_be_written_fails_no_save(tmp_path, monkeypatch, caplog):
    def full_disk(generation: int) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fencing, "record_path", full_disk)
    with distckpt.CheckpointManager(str(tmp_path / "c")) as mgr:
        mgr.save(1, {"w": torch.ones(4)})
        assert mgr.committed_steps() == [1]
    assert "could not record the first commit of generation 1" in caplog.text


def test_a_damaged_commit_record_still_says_the_root_held_a_commit(tmp_path):
    url = str(tmp_path / "c")
    with distckpt.CheckpointManager(url) as mgr:
        mgr.save(4, {"w": torch.ones(4)})
    storage = open_storage(url, None)
    record = fencing.record_path(1)
    with open(os.path.join(url, record), "wb") as f:
        f.write(b"\x00not json")
    storage.remove_tree("step-000000004")
    with pytest.raises(distckpt.CorruptCheckpointError, match="generation 1 of a job committed there"):
        with distckpt.CheckpointManager(url) as mgr:
            mgr.load_latest({"w": torch.zeros(4)})
