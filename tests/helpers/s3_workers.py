"""Rank functions for multi-process S3 tests."""

from __future__ import annotations

import torch

import distckpt


def save_once(rank: int, world: int, url: str, options: dict) -> None:
    with distckpt.CheckpointManager(url, storage_options=options, timeout=60) as mgr:
        mgr.save(1, {"w": torch.ones(10), "g": torch.Generator().manual_seed(rank)})


def save_with_default_split(rank: int, world: int, url: str, options: dict, local_world: str) -> dict:
    """A replicated state saved with split_writes left at its default, as a rank of a job whose
    nodes hold `local_world` ranks each (torchrun's LOCAL_WORLD_SIZE); the shard files written."""
    import json
    import os

    import s3fs

    os.environ["LOCAL_WORLD_SIZE"] = local_world
    state = {"w": torch.arange(4096.0), "b": torch.ones(1024)}
    with distckpt.CheckpointManager(url, storage_options=options, timeout=60) as mgr:
        mgr.save(1, state)
        split = mgr.split_writes
    target = {"w": torch.zeros(4096), "b": torch.zeros(1024)}
    with distckpt.CheckpointManager(url, storage_options=options, timeout=60) as mgr:
        mgr.load_latest(target)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    manifest = json.loads(fs.cat_file(f"{url}/step-000000001/manifest.json"))
    shards = sorted(int(name.split("-")[1].split(".")[0]) for name in manifest["files"] if name.startswith("shards/"))
    return {"split_writes": split, "restored": all(torch.equal(target[k], state[k]) for k in state),
            "shard_files": shards}
