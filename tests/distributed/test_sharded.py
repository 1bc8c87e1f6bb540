"""Sharded state (FSDP2 fully_shard on CPU, real gloo worlds): one commit over every rank's
shards, exact resume, resharding across world sizes, and the crash between shards and marker."""

from __future__ import annotations

import json
import os

import pytest

import distckpt
from distckpt.testing import run_world

W = "sharded_workers"
STEP_DIR = "step-000000003"


def _ok(results):
    for r in results:
        assert r.error is None, f"rank {r.rank}: {r.error}"
    return [r.value for r in results]


def _manifest(ckpt_dir, step_dir=STEP_DIR):
    return json.load(open(os.path.join(ckpt_dir, step_dir, "manifest.json")))


def test_every_rank_writes_its_shards_under_one_commit(ckpt_dir):
    _ok(run_world(f"{W}:save_after_training", 2, url=ckpt_dir))
    manifest = _manifest(ckpt_dir)
    shard_files = sorted(f for f in manifest["files"] if f.startswith("shards/"))
    assert shard_files == ["shards/rank-00000.g000001.safetensors", "shards/rank-00001.g000001.safetensors"]
    table = manifest["sharded"]
    weight = next(v for k, v in table.items() if k.endswith("body.0.weight"))
    assert weight["shape"] == [9, 6]
    assert sorted((c["offsets"], c["shape"]) for c in weight["chunks"]) == [([0, 0], [5, 6]), ([5, 0], [4, 6])]
    exp_avg = [k for k in table if k.endswith("exp_avg")]
    assert len(exp_avg) == 9  # every parameter's optimizer moment is sharded too
    assert os.listdir(os.path.join(ckpt_dir, STEP_DIR)).count("COMMITTED") == 1
    # the shard files open with the standard safetensors reader, and the CLI verifies them
    from safetensors.torch import load_file

    from distckpt.tools.cli import main

    pieces = load_file(os.path.join(ckpt_dir, STEP_DIR, "shards/rank-00001.g000001.safetensors"))
    weight = next(v for k, v in pieces.items() if k.endswith("body.0.weight"))
    assert weight.shape == (4, 6)  # rank 1's rows 5..8 of the 9x6 weight
    assert main(["verify", ckpt_dir]) == 0


def test_exact_resume_at_the_same_world_size(ckpt_dir):
    saved = _ok(run_world(f"{W}:save_after_training", 2, url=ckpt_dir))
    loaded = _ok(run_world(f"{W}:load_and_report", 2, url=ckpt_dir, train_after=3))
    for s, lo in zip(saved, loaded):
        assert lo["step"] == 3 and lo["rederived"] == ()
        assert lo["values"] == s["values"]          # every model and optimizer value, exactly
        assert lo["losses"] == s["more"]            # the next 3 losses, bit for bit


def test_a_validation_pass_before_a_save_or_a_load_changes_nothing(ckpt_dir):
    """After an eval-mode no_grad forward the FSDP2 root's parameters are unsharded: the save
    refused the optimizer ('no module holds all of them'). Now saved and resumed exactly."""
    saved = _ok(run_world(f"{W}:save_after_training", 2, url=ckpt_dir, eval_pass=True))
    loaded = _ok(run_world(f"{W}:load_and_report", 2, url=ckpt_dir, train_after=3, eval_pass=True))
    for s, lo in zip(saved, loaded):
        assert lo["step"] == 3 and lo["values"] == s["values"] and lo["losses"] == s["more"]


def test_async_save_snapshots_the_shards(ckpt_dir):
    saved = _ok(run_world(f"{W}:save_after_training", 2, url=ckpt_dir, async_save=True))
    loaded = _ok(run_world(f"{W}:load_and_report", 2, url=ckpt_dir))
    assert loaded[0]["values"] == saved[0]["values"]  # the +1.0 made after save() returned is absent


def test_reshard_2_to_4_to_2_round_trips_and_training_continues(ckpt_dir):
    saved = _ok(run_world(f"{W}:save_after_training", 2, url=ckpt_dir))
    for r in run_world(f"{W}:load_and_report", 4, url=ckpt_dir):  # refused by default
        assert r.error_type == "IncompatibleCheckpointError", r.error
        assert "written by 2 ranks, this job has 4" in r.error and "world_size_policy='reshard'" in r.error
    at4 = _ok(run_world(f"{W}:load_and_report", 4, url=ckpt_dir, policy="reshard", train_after=2, save_step=5))
    for v in at4:
        assert v["values"] == saved[0]["values"]
        assert "written by 2 ranks and is loaded by 4" in v["warnings"][0]
        assert "per-rank entries ['gen']" in v["warnings"][0]
        assert v["rederived"] == ("rng", "gen")
        assert all(float.fromhex(x) == float.fromhex(x) for x in v["losses"]) and len(v["losses"]) == 2
    assert at4[0]["after"] != saved[0]["values"]  # training moved on at 4 ranks
    assert len(_manifest(ckpt_dir, "step-000000005")["ranks"]) == 4
    back = _ok(run_world(f"{W}:load_and_report", 2, url=ckpt_dir, policy="reshard"))
    for v in back:
        assert v["step"] == 5 and v["values"] == at4[0]["after"]


def test_sharded_checkpoint_loads_whole_into_a_plain_model_in_one_process(ckpt_dir):
    import sharded_workers as sw

    saved = _ok(run_world(f"{W}:save_after_training", 2, url=ckpt_dir))
    state = sw.build(123, shard=False)
    state.pop("gen")  # per-rank: not restored across world sizes
    with pytest.warns(distckpt.CheckpointFallbackWarning, match="written by 2 ranks and is loaded by 1"):
        with distckpt.CheckpointManager(ckpt_dir, world_size_policy="reshard") as mgr:
            assert mgr.load_latest(state).step == 3
    assert sw.full_values(state) == saved[0]["values"]


def test_a_rank_killed_after_its_shards_before_the_marker_leaves_no_commit(ckpt_dir):
    results = run_world(f"{W}:kill_after_shards", 2, url=ckpt_dir, victim=1)
    assert results[1].exitcode == -9
    assert results[0].value["error"] == "CoordinationError", results[0].value
    assert results[0].elapsed < 30  # bounded by the 8 s timeout, not a hang
    assert not os.path.exists(os.path.join(ckpt_dir, "step-000000002", "COMMITTED"))
    loaded = _ok(run_world(f"{W}:load_and_report", 2, url=ckpt_dir))
    assert [v["step"] for v in loaded] == [1, 1]


def test_rank_zero_killed_after_its_shards_leaves_no_commit(ckpt_dir):
    results = run_world(f"{W}:kill_after_shards", 2, url=ckpt_dir, victim=0)
    assert results[0].exitcode == -9
    assert results[1].value["error"] in ("CoordinationError", "StorageError"), results[1].value
    assert not os.path.exists(os.path.join(ckpt_dir, "step-000000002", "COMMITTED"))
    loaded = _ok(run_world(f"{W}:load_and_report", 2, url=ckpt_dir))
    assert [v["step"] for v in loaded] == [1, 1]


def test_a_flipped_byte_in_a_shard_file_is_caught_on_load(ckpt_dir, capsys):
    _ok(run_world(f"{W}:save_after_training", 2, url=ckpt_dir))
    path = os.path.join(ckpt_dir, STEP_DIR, "shards/rank-00001.g000001.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0xFF
    open(path, "wb").write(bytes(data))
    results = run_world(f"{W}:load_and_report", 2, url=ckpt_dir)
    for r in results:  # the only commit is damaged: nothing to fall back to, on every rank
        assert r.error_type == "CorruptCheckpointError", r.error
        assert "no committed checkpoint" in r.error and "committed steps tried: [3]" in r.error
    from distckpt.tools.cli import main

    assert main(["verify", ckpt_dir]) != 0
    out = capsys.readouterr().out
    assert "rank-00001.g000001.safetensors" in out and "checksum" in out


def test_a_dtensor_outside_a_sharded_module_is_refused_with_its_key(ckpt_dir):
    results = run_world(f"{W}:save_stray_dtensor", 2, url=ckpt_dir)
    for r in results:
        assert r.error_type == "UnstorableValueError", r.error
        assert "state['extra']" in r.error and "DTensor" in r.error


@pytest.mark.faults  # make test: the local 2 -> 4 -> 2 reshard
def test_on_s3_shards_from_2_ranks_load_into_4(s3_server, s3_url):
    options = s3_server.storage_options()
    saved = _ok(run_world(f"{W}:save_after_training", 2, url=s3_url, options=options))
    loaded = _ok(run_world(f"{W}:load_and_report", 4, url=s3_url, options=options, policy="reshard"))
    assert all(v["values"] == saved[0]["values"] for v in loaded)


def test_on_s3_a_rank_whose_shard_upload_fails_fails_the_save_everywhere(s3_server, s3_url, proxy):
    from faultproxy import Rule
    from test_s3 import via

    proxy.add(Rule("PUT", r"shards/rank-00001", "status", times=1000, status=500))
    results = run_world(f"{W}:save_after_training", 2, url=s3_url, options=via(proxy, s3_server))
    for r in results:
        assert r.error_type == "StorageError", (r.rank, r.error)
        assert "writing the ranks' own files failed on rank(s) [1]" in r.error and "shards/rank-00001" in r.error
    assert not any("COMMITTED" in k for k in _objects(s3_server, s3_url))


def _objects(s3_server, url):
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options())
    return fs.find(url)


def test_split_writes_store_one_ranks_buffers_together(ckpt_dir):
    """Split writes spread the replicated tensors over the ranks, module buffers too: the stored
    model held rank 0's running_mean beside rank 1's running_var, a pair no rank ever had, which a
    reshard load, load_weights and export then gave back. Now rank 0 writes every buffer."""
    from sharded_workers import _bn_model

    ranks = _ok(run_world(f"{W}:split_writes_with_own_buffers", 2, url=ckpt_dir))
    assert ranks[0] != ranks[1]  # each rank's own statistics
    whole = _bn_model()
    distckpt.load_weights(ckpt_dir, whole)
    assert {k: whole[1].get_buffer(k).tolist() for k in ("running_mean", "running_var")} == ranks[0]


def test_a_partial_placement_is_refused_at_save_naming_the_users_key_path(ckpt_dir):
    """It named our tree's path, state['replicated']['entries']['model']['state']['state_dict']['w']."""
    for message in _ok(run_world(f"{W}:a_partial_placement_is_refused_by_the_users_key_path", 2, url=ckpt_dir)):
        assert "state['model']" in message and "['replicated']" not in message and "Partial" in message, message


def test_saves_and_loads_of_an_optimizer_without_state_leave_it_without_state(ckpt_dir):
    for r in _ok(run_world(f"{W}:saves_before_the_first_step_change_nothing", 2, url=ckpt_dir)):
        assert r == {"same": True, "hooks_fired": 3, "state_after_load": 0, "resumed_same": True, "refused": True,
                     "state_after_failed_load": 0, "after_failed_same": True}, r


def test_a_layer_frozen_mid_run_stays_frozen_after_a_resume(ckpt_dir):
    for frozen in _ok(run_world(f"{W}:a_layer_frozen_mid_run_stays_frozen", 2, url=ckpt_dir)):
        assert frozen == ["head.weight", "head.bias"], frozen


def test_tensor_parallel_on_part_of_the_mesh_saves_one_copy_and_loads_exactly(ckpt_dir):
    for r in _ok(run_world(f"{W}:tensor_parallel_on_part_of_the_mesh", 2, url=ckpt_dir)):
        assert "error" not in r, r
        assert r["loaded"] == r["saved"]
    table = _manifest(ckpt_dir, "step-000000001")["sharded"]
    assert all(len(entry["chunks"]) == 1 for entry in table.values()), table  # one copy of each piece


def test_tensor_parallel_copies_that_differ_are_refused_naming_the_ranks(ckpt_dir):
    for r in _ok(run_world(f"{W}:tensor_parallel_on_part_of_the_mesh", 2, url=ckpt_dir, diverge=True)):
        assert "ranks 0 and 1 hold the same piece of" in r["error"] and "body.0.weight" in r["error"], r
    assert distckpt.CheckpointManager(ckpt_dir).committed_steps() == []


def test_a_partly_tensor_parallel_checkpoint_loads_into_the_fully_sharded_model(ckpt_dir):
    for r in _ok(run_world(f"{W}:partly_tensor_parallel_into_fully_sharded", 2, url=ckpt_dir)):
        assert any(k.startswith("opt.") for k in r["expected"]) and r["loaded"] == r["expected"]


def test_a_failed_load_leaves_the_sharded_model_and_optimizer_as_they_were(ckpt_dir):
    for r in _ok(run_world(f"{W}:a_failed_load_leaves_the_sharded_model_as_it_was", 2, url=ckpt_dir)):
        assert "refused by the user's object" in r["error"] and r["unchanged"], r


@pytest.mark.parametrize("differ", [True, False])
def test_a_tensor_parallel_models_plain_parameters_differing_between_ranks_are_refused(ckpt_dir, differ):
    for said in _ok(run_world(f"{W}:a_tensor_parallel_model_whose_plain_head_differs", 2, url=ckpt_dir,
                              differ=differ)):
        assert ("parameters differ between ranks" in said) if differ else said == "saved", said
