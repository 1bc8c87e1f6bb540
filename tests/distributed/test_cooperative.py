"""Cooperative loads from an object store: each replicated byte read from storage once per job,
the ranges exchanged over the process group, verified before anything changes (real SeaweedFS
behind a byte-counting proxy, real gloo groups, real SIGKILL)."""

from __future__ import annotations

import os

import pytest
import s3fs
from coop_workers import bits, replicated_tensors

from distckpt.io import manifest as mf
from distckpt.testing import run_world

W = "coop_workers"
MIB = 4.0


def _options(s3_server, endpoint: str | None = None) -> dict:
    return {**s3_server.storage_options(endpoint), "config_kwargs": {
        "connect_timeout": 2, "read_timeout": 10, "retries": {"max_attempts": 3, "mode": "standard"}}}


def _ok(results) -> list:
    assert all(r.error is None for r in results), [r.error for r in results]
    return [r.value for r in results]


def test_a_4_rank_load_from_s3_moves_each_replicated_byte_once(s3_server, s3_url, proxy):
    """The goal: a 4-rank load of a replicated state moves <= 1.25x its bytes from S3 (every
    rank reading the whole file moved 4.00x), a save <= 1.25x."""
    options = _options(s3_server, proxy.endpoint)
    state = sum(t.numel() * t.element_size() for t in replicated_tensors(0, MIB).values())
    proxy.clear()
    _ok(run_world(f"{W}:save", 4, url=s3_url, options=options))
    saved = proxy.sent
    proxy.clear()
    loaded = _ok(run_world(f"{W}:load", 4, url=s3_url, options=options))
    moved = proxy.received
    assert all(v["exchanges"] == 1 and v["step"] == 1 for v in loaded), loaded
    assert saved <= 1.25 * state, (saved, state)
    assert moved <= 1.25 * state, f"a 4-rank load moved {moved / state:.2f}x the state's {state} bytes"
    assert moved >= 0.9 * state  # the proxy saw the load at all


@pytest.mark.parametrize("world,spill", [(2, True), (3, False)])
def test_a_cooperative_load_is_bitwise_the_file_for_every_dtype_and_layout(s3_server, s3_url, world, spill):
    """Every tensor (bf16, int8, bool, empty, non-contiguous saved views, any bit pattern) comes
    back bit for bit on every rank, the file split in ranges that do not fall on tensor bounds;
    exchanged into a mapped download file (the default spill_dir) or into memory (spill_dir=None)."""
    options = {**_options(s3_server), **({} if spill else {"spill_dir": None})}
    _ok(run_world(f"{W}:save", world, url=s3_url, options=options, mib=1.3))
    expected = replicated_tensors(0, 1.3)
    for value in _ok(run_world(f"{W}:load", world, url=s3_url, options=options, mib=1.3)):
        assert value["exchanges"] == 1, value["exchanges"]
        assert sorted(value["tensors"]) == sorted(expected)
        for key, t in expected.items():
            dtype, shape, data = value["tensors"][key]
            assert (dtype, shape) == (str(t.dtype), tuple(t.shape)), key
            assert data == bits(t), key


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_byte_damaged_in_one_ranks_range_falls_back_on_every_rank(s3_server, s3_url, damage):
    """Step 2's replicated file damaged at rest inside the range rank 1 reads (a byte flipped, or
    the object cut short there): every rank (not only rank 1) finds it damaged and all load step 1
    together, each warned."""
    options = _options(s3_server)
    _ok(run_world(f"{W}:save", 2, url=s3_url, options=options, steps=(1, 2)))
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options())
    base = f"{s3_url[len('s3://'):]}/{mf.step_dir(2)}"
    name = next(p for p in fs.find(base) if "/replicated" in p and p.endswith(".safetensors"))
    data = bytearray(fs.cat_file(name))
    part = -(-len(data) // 2)
    data[part + part // 2] ^= 0x10  # rank 1's range: [part, size)
    fs.pipe_file(name, bytes(data) if damage == "flipped" else bytes(data[:part + part // 2]))
    one = replicated_tensors(1, MIB)
    for value in _ok(run_world(f"{W}:load", 2, url=s3_url, options=options)):
        assert value["step"] == 1, value
        # flipped: step 2 read together twice (the second read: damage at rest), step 1 once;
        # truncated: step 2's size is wrong before any byte is exchanged
        assert value["exchanges"] == (3 if damage == "flipped" else 1), value
        assert len(value["fallbacks"]) == 1 and "step 2" in value["fallbacks"][0], value["fallbacks"]
        assert value["tensors"]["big"][2] == bits(one["big"])


@pytest.mark.parametrize("point", ["load/cooperative-part", "load/cooperative-exchange"])
def test_a_rank_killed_during_a_cooperative_load_is_the_same_error_on_every_other_rank(s3_server, s3_url, point):
    """Rank 1 of 3 SIGKILLed after reading its range (before the others heard of it, or before
    the exchange): ranks 0 and 2 raise the same CoordinationError within the timeout, and no
    live state changed."""
    options = _options(s3_server)
    _ok(run_world(f"{W}:save", 3, url=s3_url, options=options))
    results = run_world(f"{W}:die_during_load", 3, timeout=90, url=s3_url, options=options, timeout_s=20, point=point)
    assert results[1].died and results[1].exitcode == -9
    survivors = [r.value for r in (results[0], results[2])]
    assert all(r.error is None for r in (results[0], results[2])), [r.error for r in results]
    for value in survivors:
        assert value["raised"] is not None and value["raised"][0] == "CoordinationError", value
        assert "load/cooperative" in value["raised"][1], value
        assert value["elapsed"] < 20 + 10, value
        assert value["unchanged"], value


EXAMPLES = int(os.environ.get("DISTCKPT_HYPOTHESIS_EXAMPLES", "40"))


def test_exchanges_carry_generated_message_sizes_exactly():
    """Messages sized to their content: from 0 bytes to past the old 64 KiB slot, on each rank
    independently (some inline, some following in a message of their exact size), every rank
    receives every message byte for byte (hypothesis, seeded, the same draws on every rank)."""
    results = run_world(f"{W}:exchange_generated_sizes", 3, examples=max(8, EXAMPLES // 4))
    assert [r.value for r in results] == [max(8, EXAMPLES // 4)] * 3, [r.error for r in results]
