"""Exact resume under real torchrun: SIGKILL a real worker, let torchrun restart the job,
and compare every step's loss with an uninterrupted run, bit for bit."""

from __future__ import annotations

import os

import pytest
from demo import read_losses, run_pair

pytestmark = pytest.mark.slow


# Without loader workers is in make test-faults: with 2 workers covers the same path and more.
# make test-faults runs both; make test covers this path with the loop zoo's 2-worker DDP case and
# `make demo` runs it as the main job.
@pytest.mark.parametrize("workers", [pytest.param(0, marks=pytest.mark.faults), pytest.param(2, marks=pytest.mark.faults)])
def test_two_ranks_killed_between_checkpoints(tmp_path, workers):
    # Steps 0-32 are epoch 0 (33 steps per epoch): the resume lands mid-epoch 1 and then
    # crosses two epoch boundaries.
    result, resumes = run_pair(str(tmp_path), nproc=2, steps=110, kill_at="step:53:1", workers=workers)
    assert resumes == ["resumed from step 40 epoch 1"]
    assert result.identical, result.table
    assert result.steps == 2 * 110


@pytest.mark.faults  # make test-faults; make test kills a torchrun job during a save on S3 below
def test_two_ranks_killed_during_a_save(tmp_path):
    # Rank 0 dies after writing step 40's data and manifest but before its COMMITTED marker:
    # step 40 must not count, the job resumes from step 20 and still matches bit for bit.
    result, resumes = run_pair(str(tmp_path), nproc=2, steps=70, kill_at="save/manifest-written:40:0",
                               workers=2)
    assert resumes == ["resumed from step 20 epoch 0"]
    assert result.identical, result.table


@pytest.mark.faults  # make test-faults; make test: the 4-rank zoo loop (bare module, no_sync)
def test_four_ranks_killed_between_checkpoints(tmp_path):
    # With 4 ranks DDP's bucket order matters: without the warm-up the first step after a
    # resume reduces gradients in another order.
    result, resumes = run_pair(str(tmp_path), nproc=4, steps=45, kill_at="step:27:2", workers=0,
                               extra=["--batch", "8", "--ckpt-every", "10"])
    assert resumes == ["resumed from step 20 epoch 0"]  # then crosses into epoch 1 at step 33
    assert result.identical, result.table
    losses = read_losses(os.path.join(str(tmp_path), "log-killed"))
    assert sorted(losses) == [0, 1, 2, 3]


def test_two_ranks_on_s3_killed_during_a_save(tmp_path, s3_server, s3_url):
    # The killed run checkpoints to S3 (credentials and endpoint from the AWS_* environment);
    # rank 0 dies after step 40's data and manifest are uploaded, before the conditional commit.
    result, resumes = run_pair(str(tmp_path), nproc=2, steps=50, kill_at="save/manifest-written:40:0",
                               workers=2, ckpt_url=s3_url, env=s3_server.env())  # resumed run crosses epoch 1
    assert resumes == ["resumed from step 20 epoch 0"]
    assert result.identical, result.table


@pytest.mark.faults  # make test-faults; make test: the FSDP2 zoo loop (BatchNorm in eval)
def test_fsdp2_two_ranks_killed_between_checkpoints(tmp_path):
    # FSDP2: every rank writes its own shards of the parameters and AdamW moments.
    result, resumes = run_pair(str(tmp_path), nproc=2, steps=60, kill_at="step:47:1", workers=2,
                               extra=["--fsdp"])
    assert resumes == ["resumed from step 40 epoch 1"]
    assert result.identical, result.table
    manifest = _newest_manifest(os.path.join(str(tmp_path), "ckpt-killed"))
    assert sorted(f for f in manifest["files"] if f.startswith("shards/")) == [
        "shards/rank-00000.g000001.safetensors", "shards/rank-00001.g000001.safetensors"]
    assert manifest["sharded"]  # the chunk table: parameters and moments, not a replicated copy


@pytest.mark.faults  # make test-faults; make test covers this point in tests/distributed/test_sharded.py
def test_fsdp2_rank_killed_after_its_shards_before_the_marker(tmp_path):
    # Rank 1 dies once its shard file of step 40 is durable, before rank 0 could commit.
    result, resumes = run_pair(str(tmp_path), nproc=2, steps=50, kill_at="save/shards-written:40:1",
                               workers=0, extra=["--fsdp"])
    assert resumes == ["resumed from step 20 epoch 0"]
    assert result.identical, result.table


def _newest_manifest(root: str) -> dict:
    import json

    step = max(d for d in os.listdir(root) if d.startswith("step-")
               and os.path.exists(os.path.join(root, d, "COMMITTED")))
    return json.load(open(os.path.join(root, step, "manifest.json")))
