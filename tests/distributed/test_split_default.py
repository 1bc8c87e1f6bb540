"""The split_writes default (None): on for remote storage across several nodes, off on local disk,
on one node, with incremental saves or a local tier; True and False kept as given. The decision
as a function over every combination, then for real: a 2-rank job on S3 whose ranks say they
are on two nodes (LOCAL_WORLD_SIZE=1, as torchrun sets it there) spreads the replicated payload
over both ranks' files, and the same job on one node (LOCAL_WORLD_SIZE=2) writes it from rank 0."""

from __future__ import annotations

import itertools

import pytest

import distckpt
from distckpt.config import ManagerConfig
from distckpt.protocol.split_default import resolve_split_writes, spans_several_nodes
from distckpt.testing import run_world

W = "s3_workers"
URLS = {"/ckpt/run": False, "s3://b/run": True, "gs://b/run": True, "az://c/run": True, "memory://run": True}
ENVS = {  # torchrun's variables -> several nodes?
    "outside torchrun": ({}, False),
    "one node, 2 ranks": ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, False),
    "2 nodes x 1 rank": ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}, True),
    "4 nodes x 2 ranks": ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2"}, True),
    "1 rank": ({"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}, False),
    "malformed": ({"WORLD_SIZE": "eight", "LOCAL_WORLD_SIZE": "2"}, False),
    "no local size": ({"WORLD_SIZE": "8"}, False),
}


@pytest.mark.parametrize(("url", "env", "incremental", "local_dir", "given"),
                         list(itertools.product(URLS, ENVS, [False, True], [None, "/nvme/run"], [None, False, True])))
def test_the_default_is_on_exactly_for_remote_storage_across_nodes(url, env, incremental, local_dir, given):
    config = ManagerConfig(split_writes=given, incremental=incremental)
    resolved = resolve_split_writes(config, url, local_dir, ENVS[env][0]).split_writes
    if given is not None:
        assert resolved is given
    else:
        assert resolved is (URLS[url] and ENVS[env][1] and not incremental and local_dir is None)
    assert spans_several_nodes(ENVS[env][0]) is ENVS[env][1]


def test_none_is_accepted_and_anything_else_but_a_bool_refused():
    assert ManagerConfig().split_writes is None
    for bad in (1, 0, "yes", "auto"):
        with pytest.raises(distckpt.ConfigError, match="split_writes=.*True or False.*or None"):
            ManagerConfig(split_writes=bad)


@pytest.mark.parametrize(("local_world", "split"), [("1", True), ("2", False)])
def test_a_job_on_two_nodes_splits_its_s3_writes_by_default(s3_server, s3_url, local_world, split):
    results = run_world(f"{W}:save_with_default_split", 2, url=s3_url, options=s3_server.storage_options(),
                        local_world=local_world)
    for r in results:
        assert r.error is None, r.error
        assert r.value["split_writes"] is split
        assert r.value["restored"]
    shards = results[0].value["shard_files"]
    assert (sorted(shards) == [0, 1]) if split else shards == [], shards


def test_a_memory_tier_across_nodes_keeps_whole_files_by_default(tmp_path, monkeypatch):
    """memory_tier=True on remote storage across nodes: the default is not split writes (a memory
    copy holds whole files), where the default would otherwise be on; split_writes=True is refused."""
    from distckpt.protocol.settings import Settings

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("DISTCKPT_MEMORY_DIR", str(tmp_path / "shm"))
    url = "memory://split-default-memory"
    plain = Settings.check(url, None, None, None, None, ManagerConfig())
    assert plain.config.split_writes is True
    with_memory = Settings.check(url, None, None, None, None, ManagerConfig(), (True, None, None))
    assert with_memory.config.split_writes is False and with_memory.memory.enabled
    with pytest.raises(distckpt.ConfigError, match="memory_tier=True with split_writes=True"):
        Settings.check(url, None, None, None, None, ManagerConfig(split_writes=True), (True, None, None))
