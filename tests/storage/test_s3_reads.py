"""Loads from S3 through each payload reader — s3fs ranged GETs into a download file or into
memory, the CRT client of s3torchconnector — on a real SeaweedFS server, with faults on the wire
and on the local disk the download goes to."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
import time

import pytest
import torch
from faultproxy import Rule
from torch import nn

import distckpt
from distckpt.storage import open_storage

BIG = 3 * 2**20  # float32 elements: a 12 MiB file, above the 4 MiB read in one GET


def state_with(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Linear(64, 4)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters()),
            "big": torch.randn(BIG), "gen": torch.Generator().manual_seed(seed)}


def blank() -> dict:
    return state_with(99)


def same(a: dict, b: dict) -> bool:
    return (torch.equal(a["big"], b["big"]) and torch.equal(a["model"].weight, b["model"].weight)
            and torch.equal(a["gen"].get_state(), b["gen"].get_state()))


def env_credentials(monkeypatch, server, endpoint: str | None = None) -> dict:
    """The CRT client's way: credentials from the environment, only the endpoint in options."""
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    return {"client_kwargs": {"endpoint_url": endpoint or server.endpoint}}


READERS = {
    "s3fs, download file": lambda server, mp, tmp: {**server.storage_options(), "spill_dir": str(tmp)},
    "s3fs, in memory": lambda server, mp, tmp: {**server.storage_options(), "spill_dir": None},
    "crt, download file": lambda server, mp, tmp: {**env_credentials(mp, server), "client": "crt",
                                                   "spill_dir": str(tmp)},
}


@pytest.mark.parametrize("reader", list(READERS))
def test_every_reader_restores_the_checkpoint_exactly(s3_server, s3_url, monkeypatch, tmp_path, reader):
    saved = state_with(1)
    with distckpt.CheckpointManager(s3_url, storage_options=s3_server.storage_options()) as mgr:
        mgr.save(1, saved)
    options = READERS[reader](s3_server, monkeypatch, tmp_path)
    back = blank()
    with distckpt.CheckpointManager(s3_url, storage_options=options) as mgr:
        assert mgr.load_latest(back).step == 1
    assert same(back, saved)
    assert list(tmp_path.iterdir()) == []  # the download file had no name


def test_a_damaged_payload_read_by_the_crt_client_falls_back_to_the_previous_step(s3_server, s3_url, monkeypatch):
    import s3fs

    first, second = state_with(1), state_with(2)
    with distckpt.CheckpointManager(s3_url, storage_options=s3_server.storage_options()) as mgr:
        mgr.save(1, first)
        mgr.save(2, second)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options())
    payload = next(k for k in fs.find(s3_url.split("://")[1]) if "step-000000002" in k and k.endswith(".safetensors")
                   and "replicated" in k)
    data = bytearray(fs.cat_file(payload))
    data[len(data) // 2] ^= 0x01  # one flipped bit in the middle of the big tensor
    fs.pipe_file(payload, bytes(data))
    back = blank()
    options = {**env_credentials(monkeypatch, s3_server), "client": "crt"}
    with distckpt.CheckpointManager(s3_url, storage_options=options) as mgr:
        with pytest.warns(distckpt.CheckpointFallbackWarning, match="step 2"):
            assert mgr.load_latest(back).step == 1
    assert same(back, first)


def test_the_crt_client_retries_failed_gets(s3_server, s3_url, proxy, monkeypatch):
    saved = state_with(1)
    with distckpt.CheckpointManager(s3_url, storage_options=s3_server.storage_options()) as mgr:
        mgr.save(1, saved)
    proxy.add(Rule("GET", r"replicated/state\.g000001\.safetensors", "status", times=2, status=503))
    options = {**env_credentials(monkeypatch, s3_server, proxy.endpoint), "client": "crt"}
    back = blank()
    with distckpt.CheckpointManager(s3_url, storage_options=options) as mgr:
        assert mgr.load_latest(back).step == 1
    assert proxy.rules[0].hits == 2
    gets = [s for m, p, s in proxy.log if m == "GET" and "replicated/state.g000001.safetensors" in p]
    assert "503" in gets and gets[-1] in ("200", "206")
    assert same(back, saved)


@pytest.mark.faults  # make test-faults
def test_a_crt_read_from_a_paused_server_is_an_error_within_its_deadline(s3_server, s3_url, monkeypatch):
    with distckpt.CheckpointManager(s3_url, storage_options=s3_server.storage_options()) as mgr:
        mgr.save(1, state_with(1))
    storage = open_storage(s3_url, {**env_credentials(monkeypatch, s3_server), "client": "crt"})
    name = next(n for n in storage.list_files("") if "replicated" in n and n.endswith(".safetensors"))
    size = storage.size(name)
    bucket, _, key = f"{storage.root}/{name}".partition("/")
    s3_server.pause()
    start = time.monotonic()
    try:
        with open(os.devnull, "wb") as sink, pytest.raises(distckpt.StorageError) as info:
            storage.crt.download(bucket, key, size, sink.fileno(), 3.0, name)
    finally:
        s3_server.resume()
    assert info.value.errno == errno.ETIMEDOUT and time.monotonic() - start < 10


@contextlib.contextmanager
def full_disk(directory, monkeypatch):
    """A directory on a real 1 MiB tmpfs (as root); elsewhere ENOSPC from the allocation call."""
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(directory)],
                             capture_output=True).returncode == 0
    if not mounted:
        def no_space(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", no_space)
    try:
        yield
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(directory)], check=True)


def test_a_full_download_disk_falls_back_to_memory_and_loads_exactly(s3_server, s3_url, monkeypatch, tmp_path, caplog):
    saved = state_with(1)
    with distckpt.CheckpointManager(s3_url, storage_options=s3_server.storage_options()) as mgr:
        mgr.save(1, saved)
    spill = tmp_path / "small"
    spill.mkdir()
    back = blank()
    with full_disk(spill, monkeypatch), caplog.at_level(logging.WARNING, logger="distckpt"):
        options = {**s3_server.storage_options(), "spill_dir": str(spill)}
        with distckpt.CheckpointManager(s3_url, storage_options=options) as mgr:
            assert mgr.load_latest(back).step == 1
    assert same(back, saved)
    assert any("holding the file in memory instead" in r.getMessage() and "spill_dir" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("options, named", [
    ({"spill_dir": "/nonexistent/place"}, "spill_dir"),
    ({"spill_dir": 17}, "spill_dir"),
    ({"client": "boto"}, "client"),
    ({"client": "crt", "key": "AKIA...", "secret": "..."}, "client='crt'"),
    ({"concurrency": 0}, "concurrency=0"),       # waited forever on its semaphore
    ({"range_bytes": 0}, "range_bytes=0"),       # a bare ValueError from range()
    ({"retries": "3"}, "retries='3'"),
    ({"retries": 0}, "retries=0"),               # s3fs would never send the request
    ({"call_timeout": -1}, "call_timeout=-1"),
    ({"part_bytes": True}, "part_bytes=True"),
])
def test_bad_read_options_are_config_errors_naming_them(s3_server, s3_url, options, named):
    with pytest.raises(distckpt.ConfigError, match=named):
        open_storage(s3_url, {**s3_server.storage_options(), **options} if "key" not in options else options)


def test_the_crt_client_without_its_package_is_a_config_error(s3_url, monkeypatch):
    from distckpt.storage import s3_crt

    monkeypatch.setattr(s3_crt, "crt_available", lambda: False)
    with pytest.raises(distckpt.ConfigError, match=r"distckpt\[s3-crt\]"):
        open_storage(s3_url, {"client": "crt"})


def test_a_failed_range_stops_every_other_range_before_the_read_returns(s3_server, s3_url, proxy, monkeypatch, tmp_path):
    """One ranged GET failing for good while the others still stream: every other range is
    stopped before read_buffer raises, so none writes into a download file afterwards (they
    once went on writing at a reused descriptor number, into the next step's download)."""
    from distckpt.storage import s3 as s3_module

    with distckpt.CheckpointManager(s3_url, storage_options=s3_server.storage_options()) as mgr:
        mgr.save(1, state_with(1))
    storage = open_storage(s3_url, {**s3_server.storage_options(), "spill_dir": str(tmp_path), "retries": 1,
                                    "range_bytes": 2**20,
                                    "client_kwargs": {"endpoint_url": proxy.endpoint, "region_name": "us-east-1"}})
    name = next(n for n in storage.list_files("") if "replicated" in n and n.endswith(".safetensors"))
    writes: list[float] = []
    real_write_at = s3_module.write_at

    def slow_write_at(fd, data, offset):  # a slow disk: the other ranges are mid-stream at the failure
        writes.append(time.monotonic())
        time.sleep(0.05)
        real_write_at(fd, data, offset)

    monkeypatch.setattr(s3_module, "write_at", slow_write_at)
    # The failure answers late, so the other ranges are surely writing by then (an early 403
    # on a busy machine once failed the read before any range had written: nothing tested).
    proxy.add(Rule("GET", r"replicated/.*safetensors", "status", times=1, status=403, skip=4, delay=0.5))
    with pytest.raises(distckpt.StorageError):
        storage.read_buffer(name)
    returned = time.monotonic()
    time.sleep(1.0)
    assert writes, "no range wrote before the failure: the test did not exercise the stop"
    assert not [t for t in writes if t > returned], "a range wrote after the read had failed"
