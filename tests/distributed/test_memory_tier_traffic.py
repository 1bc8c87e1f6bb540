"""The memory tier's bytes between ranks: 4 ranks on 2 simulated nodes (GROUP_RANK and
DISTCKPT_MEMORY_DIR set per rank, 2 ranks each), counted by the coordinator's instrumentation.

A save sends each rank's own files to its partner node once (point to point), never to every
rank; a lost node's restore moves its files from the partner's leader to its own leader only.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import distckpt
from distckpt.io import manifest as mf
from distckpt.io.checksums import verify_file
from distckpt.protocol import coord as coordination
from distckpt.protocol.commit import read_marker, read_verified_manifest
from distckpt.storage import open_storage

NODE_RANKS = 2  # ranks per simulated node
WORDS = 1 << 20  # each rank's own tensor: 4 MiB, so the rank files dwarf the coordination messages


def _as_node(rank: int, memory: str, chunk: int | None = None) -> int:
    if chunk is not None:  # smaller messages: each file in several rounds of isend/irecv
        coordination.P2P_CHUNK_BYTES = chunk
    node = rank // NODE_RANKS
    os.environ["GROUP_RANK"] = str(node)
    os.environ["DISTCKPT_MEMORY_DIR"] = os.path.join(memory, f"node{node}")
    return node


def _state(rank: int, fill: float | None = None) -> dict:
    value = float(rank + 1) if fill is None else fill
    return {"w": torch.arange(64.0) if fill is None else torch.zeros(64),
            "mine": distckpt.per_rank({"t": torch.full((WORDS,), value)})}


def _sizes(url: str, step: int, world: int) -> tuple[list[int], int]:
    """Each rank's own bytes in the committed step, and the replicated file's."""
    storage = open_storage(url)
    manifest = read_verified_manifest(storage, step, read_marker(storage, step))
    own = [sum(r["size"] for name, r in manifest.files.items() if f"rank-{rank:05d}." in name) for rank in range(world)]
    replicated = sum(r["size"] for name, r in manifest.files.items() if name.startswith("replicated/"))
    return own, replicated


def _counts() -> dict:
    c = coordination.P2P_COUNTS
    return {"sent": dict(c.sent), "received": dict(c.received), "objects": c.objects}


def save_counted(rank: int, world: int, url: str, memory: str, async_save: bool = False,
                 chunk: int | None = None) -> dict:
    _as_node(rank, memory, chunk)
    with distckpt.CheckpointManager(url, memory_tier=True, timeout=60, async_save=async_save) as mgr:
        mgr.save(1, _state(rank))  # the plan's shapes, groups made: the next save alone is counted
        mgr.wait()
        coordination.P2P_COUNTS.reset()
        mgr.save(2, _state(rank))
        mgr.wait()  # async_save: the copies run on the writer's thread and group
        counts = _counts()
    own, replicated = _sizes(url, 2, world)
    return {"counts": counts, "own": own, "replicated": replicated}


def restore_counted(rank: int, world: int, url: str, memory: str, chunk: int | None = None) -> dict:
    _as_node(rank, memory, chunk)
    state = _state(rank, fill=-1.0)
    with distckpt.CheckpointManager(url, memory_tier=True, timeout=60) as mgr:
        coordination.P2P_COUNTS.reset()
        progress = mgr.load_latest(state)
        counts = _counts()
    assert torch.equal(state["mine"].obj["t"], torch.full((WORDS,), float(rank + 1)))
    assert torch.equal(state["w"], torch.arange(64.0))
    return {"counts": counts, "step": progress.step, "tier": progress.tier}


@pytest.mark.parametrize("async_save, chunk", [(False, None), (True, None), (False, 1 << 20)])
def test_a_save_sends_each_ranks_files_once_to_its_partner_node_not_to_every_rank(ckpt_dir, tmp_path, async_save,
                                                                                  chunk):
    from distckpt.testing import run_world

    world, memory = 4, str(tmp_path / "shm")
    results = run_world("test_memory_tier_traffic:save_counted", world, url=ckpt_dir, memory=memory,
                        async_save=async_save, chunk=chunk)
    assert all(r.error is None for r in results), results
    own, replicated = results[0].value["own"], results[0].value["replicated"]
    assert min(own) >= 4 * WORDS  # the files are what the counts are made of
    for rank, result in enumerate(results):
        counts, node = result.value["counts"], rank // NODE_RANKS
        leader, partner_leader = node * NODE_RANKS, (1 - node) * NODE_RANKS
        extra = replicated if rank == 0 else 0  # rank 0 also sends the replicated file to the other node
        sent = {int(k): v for k, v in counts["sent"].items()}
        across = sum(v for dst, v in sent.items() if dst // NODE_RANKS != node)
        assert across == own[rank] + extra, (rank, sent)  # 1x, not world_size x
        assert sent == {partner_leader: own[rank] + extra, **({leader: own[rank]} if rank != leader else {})}
        assert counts["objects"] < own[rank] // 8, (rank, counts)  # no file in the object collectives
        received = {int(k): v for k, v in counts["received"].items()}
        if rank != leader:
            assert received == {}, (rank, received)
        else:
            mate, other = rank + 1, partner_leader
            expected = {mate: own[mate], other: own[other] + (replicated if other == 0 else 0), other + 1: own[other + 1]}
            assert received == expected, (rank, received)
    for node in (0, 1):
        assert os.listdir(os.path.join(memory, f"node{node}", "peer")) == [f"node-{1 - node}"]
        mates = [r for r in range(world) if r // NODE_RANKS == node]
        partners = [r for r in range(world) if r // NODE_RANKS != node]
        assert _verified(os.path.join(memory, f"node{node}", "own"), 2) == {"replicated", *mates}
        assert _verified(os.path.join(memory, f"node{node}", "peer", f"node-{1 - node}"), 2) == set(partners)


def _verified(area: str, step: int) -> set:
    """Whose files a committed memory copy holds ("replicated", ranks), each checked against the manifest."""
    storage = open_storage(area)
    manifest = read_verified_manifest(storage, step, read_marker(storage, step))
    held = set()
    for name, record in manifest.files.items():
        path = os.path.join(area, mf.step_dir(step), name)
        if os.path.exists(path):
            verify_file(open(path, "rb").read(), record, path)
            held.add("replicated" if name.startswith("replicated/") else int(name.split("rank-")[1][:5]))
    return held


def test_a_lost_nodes_restore_moves_its_files_from_its_partner_only(ckpt_dir, tmp_path):
    from distckpt.testing import run_world

    world, memory = 4, str(tmp_path / "shm")
    saved = run_world("test_memory_tier_traffic:save_counted", world, url=ckpt_dir, memory=memory)
    assert all(r.error is None for r in saved), saved
    own, replicated = saved[0].value["own"], saved[0].value["replicated"]
    shutil.rmtree(os.path.join(memory, "node1"))  # node 1 replaced: its ranks 2 and 3 lost their copy
    results = run_world("test_memory_tier_traffic:restore_counted", world, url=ckpt_dir, memory=memory,
                        chunk=1 << 20)  # node 1's 8 MiB in several messages
    assert all(r.error is None for r in results), results
    assert [(r.value["step"], r.value["tier"]) for r in results] == [(2, "peer")] * world
    node1 = own[2] + own[3] + replicated
    sent = [{int(k): v for k, v in r.value["counts"]["sent"].items()} for r in results]
    received = [{int(k): v for k, v in r.value["counts"]["received"].items()} for r in results]
    assert sent == [{2: node1}, {}, {}, {}]
    assert received == [{}, {}, {0: node1}, {}]
    assert all(r.value["counts"]["objects"] < min(own) // 8 for r in results)


def partner_dies(rank: int, world: int, url: str, memory: str) -> str:
    """Rank 3 dies as its copy of step 2 starts: the others are left waiting for its files."""
    from distckpt.runtime import faults

    _as_node(rank, memory, 1 << 20)

    def die(name: str, context: dict) -> None:
        if name == "memory/sending" and rank == 3 and context.get("step") == 2:
            os._exit(9)

    faults.on_point(die)
    mgr = distckpt.CheckpointManager(url, memory_tier=True, timeout=10)
    mgr.save(1, _state(rank))
    try:
        mgr.save(2, _state(rank))
    except distckpt.DistCkptError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_rank_that_dies_during_the_copies_fails_the_save_on_every_other_rank(ckpt_dir, tmp_path):
    from distckpt.testing import run_world

    memory = str(tmp_path / "shm")
    results = run_world("test_memory_tier_traffic:partner_dies", 4, url=ckpt_dir, memory=memory)
    assert results[3].exitcode == 9
    for r in results[:3]:  # the same error class on each, naming the memory copy's exchange
        assert r.error is None and r.value.startswith("CoordinationError") and "'memory/" in r.value, \
            (r.rank, r.value, r.error)
    for node in (0, 1):  # what the leaders had received of step 2 is not left in shared memory
        left = [f for _, _, files in os.walk(os.path.join(memory, f"node{node}", "incoming")) for f in files]
        assert left == [], (node, left)
    assert _verified(os.path.join(memory, "node0", "own"), 1) == {"replicated", 0, 1}  # step 1 stands
