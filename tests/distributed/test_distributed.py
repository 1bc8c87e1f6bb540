"""The protocol across real processes joined by gloo: agreement, failures, timeouts."""

from __future__ import annotations

import json
import os

import pytest

import distckpt
from distckpt.testing import run_world

W = "dist_workers"


def test_each_rank_restores_its_own_streams(ckpt_dir):
    results = run_world(f"{W}:save_and_resume", 3, url=ckpt_dir)
    for r in results:
        assert r.error is None, r.error
        assert r.value["progress"] == (5, 1)
        assert r.value["got"] == r.value["expected"]
    assert len({tuple(r.value["got"]) for r in results}) == 3  # per-rank streams differ
    manifest = json.load(open(os.path.join(ckpt_dir, "step-000000005", "manifest.json")))
    assert manifest["world_size"] == 3 and [x["rank"] for x in manifest["ranks"]] == [0, 1, 2]
    assert len(manifest["files"]) == 4


def _same_error_everywhere(results, error_type, *needles):
    messages = set()
    for r in results:
        assert r.error_type == error_type, (r.rank, r.error_type, r.error)
        first_line = r.error.splitlines()[0]
        for needle in needles:
            assert needle in first_line, (needle, first_line)
        messages.add(first_line)
    return messages


@pytest.mark.parametrize("asks", [[2, 1], [None, 1], [1, None]])
def test_ranks_asking_for_different_loads_fail_on_every_rank(ckpt_dir, asks):
    """Rank 0 alone chooses the step: a rank asking load(state, 1) while rank 0 asked for step 2
    (or load_latest) was silently given rank 0's step."""
    results = run_world(f"{W}:load_different_steps", 2, url=ckpt_dir, asks=asks)
    name = {None: "load_latest", 1: "load(state, 1)", 2: "load(state, 2)"}
    _same_error_everywhere(results, "RankDisagreementError", f"rank 0: {name[asks[0]]}", f"rank 1: {name[asks[1]]}")


@pytest.mark.parametrize("async_save", [False, pytest.param(True, marks=pytest.mark.faults)], ids=["sync", "async"])
def test_disagreement_on_epoch_fails_on_every_rank(ckpt_dir, async_save):
    results = run_world(f"{W}:save_with_disagreement", 2, url=ckpt_dir, async_save=async_save)
    msgs = _same_error_everywhere(results, "RankDisagreementError", "rank 0: step 5 epoch 1", "rank 1: step 5 epoch 2")
    assert len(msgs) == 1
    assert not os.path.exists(os.path.join(ckpt_dir, "step-000000005"))


def test_an_argument_refused_on_one_rank_is_the_same_config_error_on_every_rank_at_once(ckpt_dir, tmp_path):
    bad = tmp_path / "a-file"
    bad.write_text("x")
    results = run_world(f"{W}:one_rank_refused_at_construction", 2, url=ckpt_dir, bad_local_dir=str(bad))
    assert all(r.error is None for r in results), [r.error for r in results]
    firsts = {r.value["first"] for r in results}
    assert len(firsts) == 1 and firsts.pop().startswith(f"ConfigError: rank 1: local_dir={str(bad)!r} is a file")
    assert all(r.value["seconds"] < 30 for r in results), results  # not the 60 s timeout
    assert os.path.exists(os.path.join(ckpt_dir, "step-000000005", "COMMITTED"))


def test_a_store_unreachable_from_one_rank_is_the_same_storage_error_on_every_rank_at_once(ckpt_dir):
    """The other ranks waited the whole timeout for the failing rank's group."""
    results = run_world(f"{W}:one_rank_refused_at_construction", 2, url=ckpt_dir, bad_url="ftp://127.0.0.1:9/x")
    assert all(r.error is None for r in results), [r.error for r in results]
    firsts = {r.value["first"] for r in results}
    assert len(firsts) == 1 and firsts.pop().startswith("StorageError: rank 1: [Errno 111] ftp://127.0.0.1:9/x")
    assert all(r.value["seconds"] < 30 for r in results), results  # not the 60 s timeout
    assert os.path.exists(os.path.join(ckpt_dir, "step-000000005", "COMMITTED"))


@pytest.mark.parametrize("setting, values", [
    ("async_save", [True, False]), ("keep_last", [2, None]), ("allow_dtype_cast", [False, True]),
    ("missing_entries", ["refuse", "keep"]), ("incremental", [False, True]),
])
def test_ranks_built_with_different_settings_fail_alike_when_built(ckpt_dir, setting, values):
    """Only async_save was compared (at the first save): other retention, load rules or save
    modes on one rank went unnoticed."""
    results = run_world(f"{W}:mixed_settings", 2, url=ckpt_dir, setting=setting, values=values)
    assert all(r.error is None for r in results), [r.error for r in results]
    expected = (f"ConfigError: the ranks built their CheckpointManager with different settings — {setting}: "
                f"rank 0: {values[0]!r}, rank 1: {values[1]!r}; build every rank's manager with the same arguments")
    assert [r.value for r in results] == [expected, expected]
    assert os.path.exists(os.path.join(ckpt_dir, "step-000000005", "COMMITTED"))  # built alike, it works


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_rank_raising_during_capture_fails_every_rank(ckpt_dir, async_save):
    """An async save too: the capture is agreed before save() returns, so the refusal is
    raised by save() itself on every rank, not later."""
    results = run_world(f"{W}:raise_during_save", 2, url=ckpt_dir, async_save=async_save)
    msgs = _same_error_everywhere(results, "UnstorableValueError", "rank(s) [1]", "state['gen']['bad']")
    assert len(msgs) == 1


@pytest.mark.parametrize("scope", ["replicated", "per_rank"])
def test_a_users_state_dict_raising_in_any_entry_names_it_on_every_rank(ckpt_dir, scope):
    """In a replicated entry, rank 1's failure (raised while comparing the ranks' values) named
    no entry; the raising rank gets the same CoordinationError, its own exception the cause."""
    results = run_world(f"{W}:users_state_dict_raising", 2, url=ckpt_dir, scope=scope)
    assert all(r.error is None for r in results), [r.error for r in results]
    messages = {r.value["message"] for r in results}
    assert len(messages) == 1 and all(r.value["raised"] == "CoordinationError" for r in results)
    message = messages.pop()
    assert "rank 1: ValueError: the user's own failure" in message and "state['user']" in message, message
    assert results[1].value["cause"] == "ValueError"
    assert not os.path.exists(os.path.join(ckpt_dir, "step-000000005", "COMMITTED"))


def test_a_users_state_dict_raising_on_one_rank_fails_every_rank_naming_the_entry(ckpt_dir):
    results = run_world(f"{W}:raise_during_save", 2, url=ckpt_dir, users_error=True)
    msgs = _same_error_everywhere(results, "CoordinationError", "rank(s) [1]", "ValueError: the user's own failure",
                                  "state['gen']")
    assert len(msgs) == 1


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("on_rank", [pytest.param(0, marks=pytest.mark.faults), 1])  # make test: rank 1, sync and async
def test_a_rank_failing_to_write_its_own_file_fails_every_rank_and_commits_nothing(ckpt_dir, on_rank, async_save):
    """Each rank writes its own rank file and reports it; rank 0 commits only once every report
    is in. A failed write on either rank is the same error on every rank, names that rank, leaves
    the step uncommitted, and the next save commits."""
    results = run_world(f"{W}:raise_during_write", 2, url=ckpt_dir, on_rank=on_rank, async_save=async_save)
    messages = set()
    for r in results:
        assert r.error is None, r.error
        assert r.value["committed"] == [6], r.value
        assert f"rank {on_rank}: OSError: [Errno 28] No space left on device" in r.value["error"], r.value
        messages.add((r.value["error_type"], r.value["error"]))
    assert len(messages) == 1, messages  # the same error on every rank
    assert not os.path.exists(os.path.join(ckpt_dir, "step-000000005", "COMMITTED"))


def test_a_rank_raising_during_load_fails_every_rank(ckpt_dir):
    results = run_world(f"{W}:raise_during_load", 2, url=ckpt_dir)
    _same_error_everywhere(results, "CoordinationError", "rank(s) [1]", "injected read failure on rank 1")


def test_a_rank_killed_during_a_collective_is_an_error_not_a_hang(ckpt_dir):
    results = run_world(f"{W}:die_during_save", 2, timeout=90, url=ckpt_dir, point="save/captured", timeout_s=20)
    assert results[1].died and results[1].exitcode == -9
    assert results[0].error_type == "CoordinationError", results[0].error
    assert "save/capture" in results[0].error and results[0].elapsed < 25
    assert "(the timeout is 20s)" in results[0].error  # failed at once: not "at the timeout"
    assert not os.path.exists(os.path.join(ckpt_dir, "step-000000005", "COMMITTED"))


def test_a_stopped_rank_times_out(ckpt_dir):
    results = run_world(f"{W}:stop_during_save", 2, timeout=60, url=ckpt_dir, timeout_s=5)
    assert results[0].error_type == "CoordinationError", results[0].error
    assert "at the 5s timeout" in results[0].error and results[0].elapsed < 20


def test_another_world_size_is_refused(ckpt_dir):
    assert all(r.error is None for r in run_world(f"{W}:save_only", 2, url=ckpt_dir))
    results = run_world(f"{W}:load_only", 3, url=ckpt_dir)
    _same_error_everywhere(results, "IncompatibleCheckpointError", "written by 2 ranks, this job has 3")
    assert [r.value for r in run_world(f"{W}:load_only", 2, url=ckpt_dir)] == [(5, 0), (5, 0)]


def test_a_background_failure_surfaces_on_every_rank(ckpt_dir):
    results = run_world(f"{W}:async_failure_everywhere", 2, url=ckpt_dir)
    for r in results:
        assert r.error is None, r.error
        assert r.value.startswith("AsyncSaveError") and "Input/output error" in r.value


def test_a_sync_save_makes_two_exchanges(ckpt_dir):
    """The capture's agreement and rank 0's outcome; the files travel to storage from the rank
    that holds them, and only their reports to rank 0 (through the store, not a collective)."""
    results = run_world(f"{W}:count_exchanges_of_saves", 2, url=ckpt_dir, async_save=False)
    for r in results:
        assert r.error is None, r.error
        assert r.value["committed"] == [6, 5]
        assert r.value["phases"] == [("MainThread", "save/capture"), ("MainThread", "save/commit")] * 6, r.value


@pytest.mark.parametrize("world", [2, 3])
def test_an_async_save_makes_one_exchange_on_the_training_thread(ckpt_dir, world):
    """Every-step checkpoints: the capture's agreement is the training thread's only exchange;
    the files' reports go through the store and the outcome runs on the writer thread (over its
    own process group): one exchange there too."""
    results = run_world(f"{W}:count_exchanges_of_saves", world, url=ckpt_dir)
    for r in results:
        assert r.error is None, r.error
        assert r.value["committed"] == [6, 5]
        seen = r.value["phases"]
        training = [phase for thread, phase in seen if thread == "MainThread"]
        writer = [phase for thread, phase in seen if thread == "distckpt-writer"]
        assert training == ["save/capture"] * 6, seen
        assert writer == ["save/async-outcome"] * 6, seen
        assert len(seen) == len(training) + len(writer)


@pytest.mark.parametrize("how,cause,needle", [
    ("changed", "SnapshotChangedError", "changed in place"),
    ("rank1-fails", "CoordinationError", "rank 1: OSError: [Errno 28] No space left on device"),
])
def test_an_overlapped_save_failing_on_one_rank_fails_on_every_rank_and_commits_nothing(ckpt_dir, how, cause,
                                                                                          needle):
    """The snapshot's check failing on rank 0, or rank 1's writer failing before the gather: the
    same error class on every rank at wait(), naming the rank, and the step is not committed."""
    results = run_world(f"{W}:overlapped_failures", 2, url=ckpt_dir, how=how)
    for r in results:
        assert r.error is None, r.error
        assert r.value["error"] is not None and needle in r.value["error"], r.value
        assert r.value["cause"] == cause, r.value
        assert r.value["committed"] == [0]


def _rewrite_rank_epoch(ckpt_dir: str, rank: int, epoch: int) -> None:
    """Forge a checkpoint whose files all verify but whose ranks disagree on the epoch."""
    from distckpt.io import manifest as mf
    from distckpt.io.safetensors_format import safetensors_chunks
    from distckpt.io.serialize import encode_tree, load_tree_file

    path = os.path.join(ckpt_dir, "step-000000005", *mf.rank_file(rank, 1).split("/"))
    tree = load_tree_file(open(path, "rb").read(), path)
    tree["epoch"] = epoch
    _reseal_rank_file(ckpt_dir, rank, b"".join(bytes(c) for c in safetensors_chunks(encode_tree(tree))))


def _reseal_rank_file(ckpt_dir: str, rank: int, data: bytes) -> None:
    """Step 5's rank file replaced by `data`, its manifest record and marker made to match."""
    from distckpt.io import manifest as mf
    base = os.path.join(ckpt_dir, "step-000000005")
    open(os.path.join(base, *mf.rank_file(rank, 1).split("/")), "wb").write(data)
    manifest = json.load(open(os.path.join(base, "manifest.json")))
    manifest["files"][mf.rank_file(rank, 1)] = {"size": len(data), "xxh3_64": mf.checksum_of(data)}
    raw = mf.manifest_bytes(manifest)
    open(os.path.join(base, "manifest.json"), "wb").write(raw)
    marker = json.load(open(os.path.join(base, "COMMITTED")))
    open(os.path.join(base, "COMMITTED"), "wb").write(
        mf.Marker(5, mf.checksum_of(raw), marker["run_id"], marker["generation"]).to_bytes())


@pytest.mark.faults  # make test: a rank file of another step resealed, above
def test_a_rank_file_recording_another_epoch_is_damage_on_every_rank(ckpt_dir):
    assert all(r.error is None for r in run_world(f"{W}:save_only", 2, url=ckpt_dir))
    _rewrite_rank_epoch(ckpt_dir, rank=1, epoch=3)
    results = run_world(f"{W}:load_only", 2, url=ckpt_dir)
    # rank 1's file no longer belongs to the step: damage, on every rank alike (nothing older here)
    _same_error_everywhere(results, "CorruptCheckpointError", "no committed checkpoint", "verifies (committed steps tried: [5])")


def test_a_rank_file_of_another_step_resealed_into_a_step_falls_back_on_every_rank(ckpt_dir):
    """Step 1's rank file put in step 5's place, manifest and marker re-sealed: rank 1 resumed step
    1's RNG streams and per-rank state under a step-5 resume, silently, when the epochs matched."""
    from distckpt.io import manifest as mf
    assert all(r.error is None for r in run_world(f"{W}:save_steps_1_and_5", 2, url=ckpt_dir))
    older = os.path.join(ckpt_dir, "step-000000001", *mf.rank_file(1, 1).split("/"))
    _reseal_rank_file(ckpt_dir, 1, open(older, "rb").read())
    for r in run_world(f"{W}:load_mine_with_warnings", 2, url=ckpt_dir):
        assert r.error is None, r.error
        assert r.value["step"] == 1 and r.value["mine"] == {"n": 1}, r.value
        assert any("records step 1 epoch 0, the manifest step 5" in w for w in r.value["warned"]), r.value


@pytest.mark.faults  # make test: test_another_world_size_is_refused and the sharded reshards
def test_another_world_size_with_the_replicated_only_policy(ckpt_dir):
    assert all(r.error is None for r in run_world(f"{W}:save_only", 2, url=ckpt_dir))
    results = run_world(f"{W}:load_replicated_only", 3, url=ckpt_dir)
    for r in results:
        assert r.error is None, r.error
        assert r.value["progress"] == (5, 0) and r.value["weights_restored"]
        assert "written by 2 ranks and is loaded by 3" in r.value["warning"]
        assert "per-rank entries ['gen']" in r.value["warning"]


@pytest.mark.parametrize("async_save", [False, pytest.param(True, marks=pytest.mark.faults)])
def test_split_writes_spread_the_replicated_payload_across_ranks(ckpt_dir, async_save):
    results = run_world(f"{W}:split_save_and_load", 3, url=ckpt_dir, async_save=async_save)
    for r in results:
        assert r.error is None, r.error
        assert r.value["step"] == 3 and r.value["model_equal"] and r.value["opt_equal"]
        assert r.value["table"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    manifest = json.load(open(os.path.join(ckpt_dir, "step-000000003", "manifest.json")))
    shard_bytes = [manifest["files"][f"shards/rank-0000{r}.g000001.safetensors"]["size"] for r in range(3)]
    assert min(shard_bytes) > 0.5 * max(shard_bytes)  # every rank wrote a comparable share
    assert all(len(e["chunks"]) == 1 for e in manifest["sharded"].values())  # each tensor whole, once


def test_split_writes_bring_back_every_generated_tree_identical(ckpt_dir):
    """Split writes kept values but lost Parameter-ness, requires_grad and layout
    (transposed, channels_last) of replicated tensors."""
    examples = max(8, int(os.environ.get("DISTCKPT_HYPOTHESIS_EXAMPLES", "40")) // 4)
    results = run_world(f"{W}:split_writes_round_trip_generated_trees", 2, timeout=300, url=ckpt_dir,
                        examples=examples)
    for r in results:
        assert r.error is None, r.error
        assert r.value["examples"] >= examples // 2


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("how", ["epoch", "load", "metric", "state_save", "state_load"])
def test_an_argument_refused_on_one_rank_is_the_same_config_error_on_every_rank(ckpt_dir, how, async_save):
    """epoch=-1 (or load step=-3, or a state with a non-str key) on rank 1 only: was ConfigError
    there and CoordinationError on rank 0 (or the timeout, when rank 1 stayed alive)."""
    results = run_world(f"{W}:an_argument_refused_on_one_rank", 2, url=ckpt_dir, how=how, async_save=async_save)
    for r in results:
        assert r.error is None, r.error
        if how == "metric":  # rank 0's metric is the one used; anything elsewhere
            assert [o[0] for o in r.value["outcomes"]] == ["ok", "ok"]
            assert r.value["steps"] == [5, 3, 2, 1]
            continue
        for kind, seconds, message in r.value["outcomes"]:
            expected = "its key 3 is a int" if how.startswith("state") else "must be an int >= 0"
            assert kind in ("ConfigError", "StateArgumentError") and "rank 1" in message and expected in message, message
            assert seconds < 10  # at once, not at the 20 s timeout
        assert r.value["steps"] == [5, 1]


@pytest.mark.parametrize("saver", [0, 1])
def test_ranks_in_different_manager_calls_get_the_same_clear_error(ckpt_dir, saver):
    """One rank in save while the other is in load_latest: raw TypeError / AttributeError from
    each other's objects, a different one on each rank."""
    results = run_world(f"{W}:ranks_in_different_calls", 2, url=ckpt_dir, saver=saver)
    for r in results:
        assert r.error is None, r.error
        first = r.value["first"]
        assert first.startswith("RankDisagreementError") and "'save/capture'" in first and "'load/request'" in first
        assert r.value["seconds"] < 10 and r.value["then"] == 1 and r.value["steps"] == [1, 3]
        assert r.value["save seconds"] < 10, r.value  # it waited out the 20 s timeout, then failed


@pytest.mark.faults  # ~30 s: the late rank's gloo connect gives up ~20 s after it arrives (make test-faults)
def test_a_rank_reaching_the_manager_after_the_timeout_is_a_coordination_error_on_every_rank(ckpt_dir):
    """Raw DistStoreError / gloo RuntimeError before (the group's creation was not wrapped)."""
    for r in run_world(f"{W}:a_rank_reaching_the_manager_late", 2, url=ckpt_dir, manager_timeout=4.0):
        assert r.error is None, r.error
        assert r.value.startswith("CoordinationError") and "creating distckpt's gloo group failed" in r.value, r.value


def test_ranks_loading_into_states_of_different_entries_all_refuse(ckpt_dir):
    for r in run_world(f"{W}:a_rank_loading_into_a_state_without_an_entry", 2, url=ckpt_dir):
        assert r.error is None, r.error
        assert r.value["first"].startswith("RankDisagreementError") and "different entries" in r.value["first"], r.value
        assert "rank 1: ['gen', 'model', 'optimizer']" in r.value["first"], r.value
        assert r.value["unchanged"] and r.value["again"] == 1


def test_objects_larger_than_a_slot_take_one_more_message():
    results = run_world(f"{W}:exchange_objects_larger_than_a_slot", 3)
    assert all(r.error is None for r in results), [r.error for r in results]
    from distckpt.protocol.coord import SLOT_BYTES

    for r in results:
        assert r.value["all_gather"] == [10, 3 * SLOT_BYTES, 10]
        assert r.value["broadcast"] == 2 * SLOT_BYTES
        assert r.value["small broadcast"] == {"from": 0}
    assert results[0].value["gather"] == [(0, b"\0", 10), (1, b"\1", 3 * SLOT_BYTES), (2, b"\2", 10)]
    assert results[1].value["gather"] is None and results[2].value["gather"] is None


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_rank_failing_before_its_large_object_is_an_error_within_the_timeout(how):
    results = run_world(f"{W}:fail_before_sending_a_large_object", 2, timeout=60, timeout_s=5, how=how)
    if how == "killed":
        assert results[1].died and results[1].exitcode == -9
    assert results[0].error_type == "CoordinationError", results[0].error
    assert "test/gather" in results[0].error and results[0].elapsed < 20


def test_coordination_messages_round_trip_without_pickle():
    from distckpt.protocol.coord import Outcome, decode_message, encode_message

    msg = [Outcome(1, "StorageError", "disk full", {"step": 5, "files": ["a", "b"]}), b"\x00\xff" * 10,
           {"nested": [b"", bytearray(b"xy"), None, 1.5, True]}]
    back = decode_message(encode_message(msg))
    assert back == [msg[0], msg[1], {"nested": [b"", b"xy", None, 1.5, True]}]
    with pytest.raises(TypeError, match="cannot carry object"):
        encode_message(object())


@pytest.mark.parametrize("async_save", [False, pytest.param(True, marks=pytest.mark.faults)], ids=["sync", "async"])
def test_rank_0_slower_than_the_timeout_is_said_as_it_is_and_the_manager_then_refuses(ckpt_dir, async_save):
    """A rank that stops waiting for rank 0's outcome cannot know it: its error says the step may
    or may not be committed (rank 0 may finish its commit after). After a failed exchange the
    manager's group is not trusted again: the next save fails on every rank and commits nothing
    (a half-working group once let rank 0 commit a save every rank was told had failed); a new
    manager works."""
    results = run_world(f"{W}:rank_0_slower_than_the_timeout", 2, timeout=120, url=ckpt_dir, async_save=async_save)
    for r in results:
        assert r.error is None, r.error
    waiting = results[1].value
    assert "may or may not be committed" in waiting["save 1"], waiting
    for r in results:
        assert r.value["save 2"] is not None and "CoordinationError" in r.value["save 2"], r.value
        assert r.value["committed"][0] == 3 and 2 not in r.value["committed"], r.value


def test_rank_0_waits_for_a_stuck_background_write_a_bounded_time(ckpt_dir):
    """A write hung below Python (a stuck NFS call) held rank 0 in its next save's wait forever
    while the other ranks raised at the timeout. Rank 0 now gives up timeout + min(timeout, 60 s)
    after the save, says the step may or may not be committed, and every later call of that
    manager fails at once, on every rank."""
    results = run_world(f"{W}:rank_0_writer_stuck", 2, timeout=120, url=ckpt_dir)
    for r in results:
        assert r.error is None, r.error
    zero, one = results[0].value, results[1].value
    assert zero["wait"] is not None and "AsyncSaveError" in zero["wait"], zero
    assert "did not finish within" in zero["wait"] and "may or may not be committed" in zero["wait"], zero
    assert zero["waited_s"] < 10, zero  # bound: 2 + 2 s after the save
    assert one["wait"] is not None and "may or may not be committed" in one["wait"], one
    for r in (zero, one):
        assert r["save 2"] is not None and "CoordinationError" in r["save 2"], r
        assert r["close"] is None, r


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("exc_name", ["KeyboardInterrupt", "SystemExit"])
def test_an_interrupt_raised_in_one_ranks_capture_fails_that_save_everywhere_at_once(ckpt_dir, exc_name, async_save):
    """A KeyboardInterrupt or SystemExit out of rank 1's state_dict() left rank 1 out of the
    capture's exchange: rank 0 waited in it, and rank 1's retry of the save paired with it under
    another save's key (both ranks at the whole timeout, step 1 lost, the manager untrusted).
    Rank 1 now tells the others before it raises: rank 0's save fails at once naming rank 1,
    rank 1 gets its own exception back, and the retried save commits."""
    results = run_world(f"{W}:interrupted_in_capture_on_one_rank", 2, timeout=120, url=ckpt_dir, exc_name=exc_name,
                        async_save=async_save)
    for r in results:
        assert r.error is None, r.error
    zero, one = results[0].value, results[1].value
    assert zero["first"].startswith("CoordinationError") and f"rank 1: {exc_name}" in zero["first"], zero
    assert one["first"].startswith(exc_name), one
    for r in (zero, one):
        assert r["first_s"] < 10 and r["retry_s"] < 10, r  # the timeout is 20 s
        assert r["committed"] == [1, 0], r


def test_run_world_starts_again_when_another_process_took_its_free_port(ckpt_dir, monkeypatch):
    """distckpt.testing.run_world picks a free port, then the world's store binds it; another
    process may take it in between (EADDRINUSE): the world is started again on another port."""
    import socket

    from distckpt import testing

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = testing.free_port
    monkeypatch.setattr(testing, "free_port", lambda: ports.pop() if ports else real())
    try:
        results = run_world(f"{W}:count_exchanges_of_saves", 2, url=ckpt_dir, async_save=False)
    finally:
        taken.close()
    assert not ports  # the taken port was tried first
    assert [r.error for r in results] == [None, None]
    assert results[0].value["committed"] == [6, 5]


_DIFFERING = ["float", "negative-zero", "nan-payload", "big-int", "str", "list-length", "tuple-vs-list",
              "int-vs-float", "dict-value", "tensor-bits", "tensor-dtype", "nested-tensor", "numpy",
              "requires-grad", "parameter", "tie", "dim-order", "ordered-dict-order", "stateful-ema", "stateful-plateau"]


@pytest.mark.parametrize("case, async_save", [*[(c, False) for c in [*_DIFFERING, "equal", "equal-in-another-order", "equal-stateful"]],
                                             ("float", True), ("nested-tensor", True), ("equal", True),
                                             ("stateful-ema", True)])
def test_a_replicated_value_that_differs_between_ranks_is_refused_at_save_on_every_rank(ckpt_dir, case, async_save):
    """A replicated entry is written from rank 0 and every rank gets rank 0's copy back, so a
    value each rank holds for itself (nanoGPT's best_val_loss) would come back wrong on the others:
    refused by save() itself (async too) on every rank, naming the entry; per_rank values and
    equal replicated ones save and come back. Most cases are == in Python yet not the same bits
    (-0.0, NaN payloads, 1 vs 1.0, dtypes); the digest itself is checked on generated trees in
    tests/unit/test_roundtrip_property.py."""
    world = 3 if case in ("float", "tensor-bits") else 2
    results = run_world(f"{W}:replicated_values_by_rank", world, url=ckpt_dir, case=case, async_save=async_save)
    if case.startswith("equal"):  # a plain dict's order is not compared (set-built dicts differ in it by
        # rank), ties included; an OrderedDict's is
        assert [r.value["own"] for r in results] == [{"rank": r, "loss": 1.0 + r} for r in range(world)]
        return
    msgs = _same_error_everywhere(results, "UnstorableValueError", "state['v'] differs on rank(s) "
                                  f"{list(range(1, world))}", "distckpt.per_rank")
    assert len(msgs) == 1 and "state['own']" not in msgs.pop()
    assert not os.path.exists(os.path.join(ckpt_dir, "step-000000001"))


@pytest.mark.parametrize("case", ["per-rank", "module", "generator", "value", "kind"])
def test_entries_held_by_some_ranks_only_are_refused_at_save_on_every_rank(ckpt_dir, case):
    # A module or per_rank entry only rank 1 held was silently left out of the checkpoint (every
    # load then refused it); a value only rank 1 held was named as "differs" instead.
    results = run_world(f"{W}:entries_on_some_ranks", 2, url=ckpt_dir, case=case)
    assert all(r.error is None for r in results), [r.error for r in results]
    outcomes = {r.value["outcome"] for r in results}
    assert len(outcomes) == 1, outcomes
    outcome = outcomes.pop()
    assert outcome.startswith("RankDisagreementError") and "ranks save different entries" in outcome, outcome
    assert ("missing on rank(s) [0]" if case != "kind" else "by different ranks") in outcome, outcome
    assert all(r.value["committed"] == [2] for r in results)


def test_a_ctrl_c_inside_an_exchange_on_one_rank_is_a_clear_error_on_every_rank(ckpt_dir):
    """Rank 0 interrupted inside load_latest()'s exchange goes on to save(): its manager refuses
    at once (the exchange was left part-way; pairing the save's exchange with rank 1's rest of the
    load's gave raw KeyErrors on both ranks), and rank 1 gets a CoordinationError in its timeout."""
    results = run_world(f"{W}:interrupted_inside_an_exchange", 2, timeout=90, url=ckpt_dir)
    assert all(r.error is None for r in results), [r.error for r in results]
    rank0, rank1 = results[0].value, results[1].value
    assert rank0["load_latest"] == "KeyboardInterrupt", rank0
    assert rank0["save"] == "CoordinationError" and "interrupted (KeyboardInterrupt)" in rank0["save says"], rank0
    assert rank1["load_latest"] == "CoordinationError", rank1


@pytest.mark.parametrize("async_save", [False, True])
def test_a_metric_given_on_rank_0_only_is_the_checkpoints(ckpt_dir, async_save):
    results = run_world(f"{W}:metric_on_rank_0_only", 2, url=ckpt_dir, async_save=async_save)
    assert [r.value for r in results] == [{"kept": [3, 1], "metric": 1.0}] * 2, results


def test_ranks_that_do_not_see_one_storage_are_told_so_not_given_a_fresh_start(ckpt_dir):
    """A step rank 0 reads and rank 1 finds uncommitted, at every read: not a race with a writer
    (that changes from one read to the next), so not skipped as uncommitted (that would end in a
    fresh start): RankDisagreementError on both ranks, naming the shared storage."""
    results = run_world(f"{W}:split_view_load", 2, url=ckpt_dir)
    assert [r.error for r in results] == [None, None], results
    for r in results:
        assert r.value.startswith("RankDisagreementError") and "must see the same storage" in r.value, r.value


def test_a_load_warns_nothing_that_fails_a_run_under_warnings_as_errors(ckpt_dir):
    """Before: the search for a bare module's DDP wrapper touched torch.distributed.reduce_op and
    raised its FutureWarning, so load_latest failed under -W error::FutureWarning."""
    results = run_world(f"{W}:load_with_future_warnings_as_errors", 2, url=ckpt_dir)
    assert [(r.value, r.error) for r in results] == [("ok", None)] * 2, results


@pytest.mark.parametrize("wrap_after_load", [False, True])
def test_the_ddp_warmup_leaves_no_trace_in_streams_statistics_or_gradients(ckpt_dir, wrap_after_load):
    """The warm-up runs the loop's own training forward (keyword arguments included) once more
    and puts back every stream it drew from, the modules' generators, buffers and gradients."""
    for r in run_world(f"{W}:one_step_with_and_without_the_warmup", 2, url=ckpt_dir, wrap_after_load=wrap_after_load):
        assert r.error is None, r.error
        assert r.value == "ok"


def test_the_watch_for_a_wrapper_built_later_ends_at_the_first_optimizer_step(ckpt_dir):
    (r,) = run_world(f"{W}:the_wrapper_watch_ends_at_the_first_optimizer_step", 1, url=ckpt_dir)
    assert r.error is None, r.error
    assert r.value["watching"] == (r.value["before"][0] + 1, r.value["before"][1] + 1), r.value
    assert r.value["after"] == r.value["before"] and r.value["ema_hooks"] == 0, r.value


def test_the_ddp_warmup_back_propagates_through_a_dataclass_output(ckpt_dir):
    for r in run_world(f"{W}:the_warmup_backward_reaches_a_dataclass_output", 2, url=ckpt_dir):
        assert r.error is None, r.error
        assert r.value == {"backward_passes": 2}, r.value  # the warm-up's and the step's


@pytest.mark.parametrize("async_save", [False, True])
def test_close_joins_the_managers_gloo_threads(ckpt_dir, async_save):
    """close() ends the threads of the manager's gloo groups: left to the interpreter's exit, one
    of them could release a collective's tensors after finalization began and abort the process
    ("terminate called without an active exception", SIGABRT at the exit of ~1 job in 20-40)."""
    results = run_world(f"{W}:native_threads_around_a_manager", 2, url=ckpt_dir, async_save=async_save)
    for r in results:
        assert r.error is None, r.error
        counts = r.value
        assert counts["during"] > counts["before"], counts  # the groups' threads exist: the check can fail
        assert counts["after"] == counts["before"], counts


UNCLOSED_MANAGER = r"""
import atexit, os, sys, threading, time

def native_threads():
    return len(os.listdir("/proc/self/task")) - len(threading.enumerate())

def report():  # registered before distckpt is imported, so it runs after distckpt's exit hook
    with open(os.path.join(sys.argv[2], f"rank-{os.environ['RANK']}"), "w") as f:
        f.write(f"{BEFORE} {DURING} {native_threads()} {CHILD}")

atexit.register(report)
import torch, torch.distributed as dist, distckpt
dist.init_process_group("gloo")
BEFORE = native_threads()
mgr = distckpt.CheckpointManager(sys.argv[1], timeout=30)
mgr.save(1, {"x": torch.ones(4)})
DURING = native_threads()
pid = os.fork()
if pid == 0:  # a forked child runs distckpt's exit hook (sys.exit itself hangs there, in torch's
    from distckpt.protocol import coord  # own default group, so the hook is called and the child leaves)
    coord._close_open_groups()
    os._exit(0)
for _ in range(200):
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    time.sleep(0.1)
else:
    os.kill(pid, 9)
    status = "hung"
CHILD = f"child-{status}"
mgr.save(2, {"x": torch.ones(4)})  # the parent's group is untouched by the child's hook
# no close(), no destroy_process_group(): the job just ends
"""


def test_a_manager_never_closed_has_its_gloo_threads_joined_at_exit(tmp_path):
    """Left to the interpreter's exit, a gloo thread could release a collective's tensors after
    finalization began and abort the process; an exit hook closes the manager first. The hook
    also runs in a forked child, whose copy of the group has none of the parent's threads:
    joining them there hung the child."""
    import subprocess
    import sys

    script = tmp_path / "unclosed.py"
    script.write_text(UNCLOSED_MANAGER)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", str(script), str(tmp_path / "ckpt"), str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(2):
        before, during, after, child = (out / f"rank-{rank}").read_text().split()
        assert int(during) > int(before) and int(after) == int(before), (rank, before, during, after)
        assert child == "child-0", (rank, child)
    assert os.path.exists(tmp_path / "ckpt" / "step-000000002" / "COMMITTED")


def test_a_per_rank_value_may_be_a_tensor_on_one_rank_and_a_float_on_another(ckpt_dir):
    """Refused as "ranks save different entries ... wrap it in distckpt.per_rank" although it was:
    the README's own recipe for nanoGPT's best_val_loss failed at the first save after an evaluation."""
    results = run_world(f"{W}:per_rank_kinds_differ", 2, url=ckpt_dir)
    assert all(r.error is None for r in results), [r.error for r in results]
    assert [r.value for r in results] == [{"step": 0, "back": 0.5, "is_tensor": True},
                                          {"step": 0, "back": 1e9, "is_tensor": False}]
    assert os.path.exists(os.path.join(ckpt_dir, "step-000000001", "COMMITTED"))


def test_a_constructor_failure_keeps_its_distckpt_type_on_every_rank_and_any_other_is_a_coordination_error():
    from distckpt.protocol.settings import refusal_on_every_rank as _refusal_on_every_rank

    storage = _refusal_on_every_rank([(1, "StorageError", "s3://b/x: unreachable"), (2, "ConfigError", "keep_last=0")])
    assert type(storage) is distckpt.StorageError
    assert str(storage) == "rank 1: s3://b/x: unreachable; rank 2: keep_last=0"
    other = _refusal_on_every_rank([(0, "KeyError", "'region'")])
    assert type(other) is distckpt.CoordinationError and str(other) == "rank 0: KeyError: 'region'"
    assert type(_refusal_on_every_rank([(0, "Exception", "x")])) is distckpt.CoordinationError


def test_a_reshard_says_whose_batchnorm_statistics_every_rank_gets(ckpt_dir):
    """Each rank saves its own buffers; under world_size_policy='reshard' every rank got rank 0's
    and neither the warning nor Progress said so."""
    import torch
    from torch import nn

    assert all(r.error is None for r in run_world(f"{W}:save_rank_own_batchnorm", 2, url=ckpt_dir))
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with distckpt.CheckpointManager(ckpt_dir, world_size_policy="reshard") as mgr:
        with pytest.warns(distckpt.ReshardWarning, match=r"persistent buffers of \['model'\] .* rank 0's") as caught:
            assert mgr.load_latest({"model": net}).step == 3
    # its own class, still a CheckpointFallbackWarning for filters written before it had one
    assert all(issubclass(w.category, distckpt.CheckpointFallbackWarning) for w in caught)
    assert torch.equal(net[1].running_mean, torch.full((4,), 1.0))  # rank 0's, as said


@pytest.mark.parametrize("case, async_save", [("bare", False), ("bare", True), ("ddp", False), ("ddp", True),
                                              ("per-rank", False), ("untrained", False)])
def test_a_module_each_rank_trained_on_its_own_is_refused_at_save_on_every_rank(ckpt_dir, case, async_save):
    """A replicated module is written from rank 0 and every rank gets its weights back: one that
    each rank trained on its own batch without DDP resumed every rank with rank 0's, silently. Its
    parameters are now compared (a sample of each) in the capture's exchange; DDP's equal ones,
    with each rank's own BatchNorm statistics, save, as do a per_rank model and an untrained one."""
    results = run_world(f"{W}:modules_trained_by_rank", 2, url=ckpt_dir, case=case, async_save=async_save)
    assert all(r.error is None for r in results), [r.error for r in results]
    outcomes = [r.value["outcome"] for r in results]
    if case == "bare":
        assert len(set(outcomes)) == 1, outcomes
        assert outcomes[0].startswith("UnstorableValueError") and "state['model'] differs on rank(s) [1]" in outcomes[0]
        assert "DistributedDataParallel" in outcomes[0] and "state['opt']" not in outcomes[0], outcomes[0]
        assert all(r.value["committed"] == [] for r in results)
    else:
        assert outcomes == ["committed", "committed"], outcomes
        assert all(r.value["committed"] == [1] for r in results)


@pytest.mark.parametrize("consolidate,async_save", [("stale", False), ("none", True), ("fresh", False)])
def test_zero_redundancy_optimizer_resumes_exactly_however_it_was_consolidated(ckpt_dir, consolidate, async_save):
    """ZeroRedundancyOptimizer.state_dict() is what its last consolidate_state_dict() gathered: a
    loop that consolidated at step 2 and saved at step 4 resumed with step 2's moments, silently
    (and one that never consolidated failed the save). The save consolidates it on every rank."""
    results = run_world(f"{W}:zero_optimizer_resume", 2, url=ckpt_dir, consolidate=consolidate, async_save=async_save)
    assert all(r.error is None for r in results), [r.error for r in results]
    for r in results:
        assert r.value["resumed"] == r.value["reference"], r.value


def test_zero_redundancy_optimizer_in_per_rank_is_refused_on_every_rank(ckpt_dir):
    results = run_world(f"{W}:zero_optimizer_per_rank", 2, url=ckpt_dir)
    assert all(r.error is None for r in results), [r.error for r in results]
    for r in results:
        assert "ZeroRedundancyOptimizer inside per_rank" in r.value and "state['optimizer']" in r.value, r.value


def test_an_unstorable_replicated_entry_is_said_to_be_every_ranks(ckpt_dir):
    # Only rank 0 encodes replicated entries, so the refusal said "failed on rank(s) [0]", which
    # read as if the other ranks' copies were fine.
    results = run_world(f"{W}:unstorable_replicated_entry", 2, url=ckpt_dir)
    outcomes = {r.value["outcome"] for r in results}
    assert len(outcomes) == 1, outcomes
    outcome = outcomes.pop()
    assert outcome.startswith("UnstorableValueError") and "state['config']['schedule']" in outcome, outcome
    assert "every rank holds it, rank 0 checks and writes it for all" in outcome, outcome
