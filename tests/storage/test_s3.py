"""Checkpoints on a real S3 server (SeaweedFS on loopback), with faults injected on the wire."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from faultproxy import Rule
from seaweed import ACCESS_KEY, SECRET_KEY
from torch import nn

import distckpt
from distckpt.runtime import faults
from distckpt.testing import run_world


def state_with(seed: int, size: int = 1000) -> dict:
    torch.manual_seed(seed)
    model = nn.Linear(size, 4)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters()),
            "gen": torch.Generator().manual_seed(seed), "config": {"size": size}}


def weights(state: dict) -> torch.Tensor:
    return state["model"].weight.detach().clone()


def fast_options(endpoint_options: dict, **extra) -> dict:
    """Short timeouts so a fault ends in seconds (production defaults are minutes)."""
    return {**endpoint_options, "config_kwargs": {"connect_timeout": 2, "read_timeout": 4,
                                                  "retries": {"max_attempts": 3, "mode": "standard"}},
            "retries": 2, "call_timeout": 12, **extra}


def via(proxy, s3_server, **extra) -> dict:
    return fast_options(s3_server.storage_options(proxy.endpoint), **extra)


def committed_objects(s3_server, url: str) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options())
    return sorted(k for k in fs.find(url.split("://")[1]) if k.endswith("/COMMITTED"))


def test_save_and_load_on_s3(s3_server, s3_url):
    state = state_with(0)
    opts = s3_server.storage_options()
    with distckpt.CheckpointManager(s3_url, storage_options=opts, keep_last=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state, epoch=0, metric=float(step))
        assert mgr.committed_steps() == [3, 2]
    other = state_with(1)
    with distckpt.CheckpointManager(s3_url, storage_options=opts) as mgr:
        assert mgr.load_latest(other).step == 3
    assert torch.equal(weights(other), weights(state))


def test_multipart_upload_with_concurrent_parts(s3_server, s3_url, proxy):
    state = {"big": torch.randn(3 * 2**20)}  # 12 MiB in 5 MiB parts: three parts
    opts = via(proxy, s3_server, part_bytes=5 * 2**20)
    with distckpt.CheckpointManager(s3_url, storage_options=opts) as mgr:
        mgr.save(1, state)
    parts = [p for m, p, s in proxy.log if m == "PUT" and "partNumber=" in p]
    assert len(parts) == 3
    back = {"big": torch.zeros(3 * 2**20)}
    with distckpt.CheckpointManager(s3_url, storage_options=s3_server.storage_options()) as mgr:
        mgr.load_latest(back)
    assert torch.equal(back["big"], state["big"])


def test_slowdown_and_5xx_replies_are_retried(s3_server, s3_url, proxy):
    proxy.add(Rule("PUT", r"replicated/state\.g000001\.safetensors", "status", times=1, status=503),
              Rule("PUT", r"rank-00000", "status", times=1, status=500),
              Rule("PUT", r"COMMITTED", "status", times=1, status=503))
    state = state_with(0)
    with distckpt.CheckpointManager(s3_url, storage_options=via(proxy, s3_server)) as mgr:
        mgr.save(1, state)
    assert [r.hits for r in proxy.rules] == [1, 1, 1]
    assert committed_objects(s3_server, s3_url) == [f"{s3_url[5:]}/step-000000001/COMMITTED"]


def test_persistent_5xx_is_a_clear_error_and_keeps_the_previous_checkpoint(s3_server, s3_url, proxy):
    state = state_with(0)
    opts = via(proxy, s3_server)
    with distckpt.CheckpointManager(s3_url, storage_options=opts) as mgr:
        mgr.save(1, state)
        proxy.add(Rule("PUT", r"step-000000002/ranks/", "status", times=1000, status=500))
        start = time.monotonic()
        with pytest.raises(distckpt.StorageError, match=r"s3://ckpt/.*step-000000002/ranks/rank-00000"):
            mgr.save(2, state_with(5))
        assert time.monotonic() - start < 60
    assert committed_objects(s3_server, s3_url) == [f"{s3_url[5:]}/step-000000001/COMMITTED"]
    other = state_with(1)
    with distckpt.CheckpointManager(s3_url, storage_options=s3_server.storage_options()) as mgr:
        assert mgr.load_latest(other).step == 1
    assert torch.equal(weights(other), weights(state))


def test_connection_reset_mid_upload_is_retried(s3_server, s3_url, proxy):
    state = {"big": torch.randn(3 * 2**20)}
    proxy.add(Rule("PUT", r"partNumber=2", "reset", times=1),
              Rule("PUT", r"rank-00000", "reset", times=1))
    with distckpt.CheckpointManager(s3_url, storage_options=via(proxy, s3_server, part_bytes=5 * 2**20)) as mgr:
        mgr.save(1, state)
    assert [r.hits for r in proxy.rules] == [1, 1]
    back = {"big": torch.zeros(3 * 2**20)}
    with distckpt.CheckpointManager(s3_url, storage_options=s3_server.storage_options()) as mgr:
        mgr.load_latest(back)
    assert torch.equal(back["big"], state["big"])


def test_a_failed_multipart_upload_publishes_nothing_and_is_aborted(s3_server, s3_url, proxy):
    import s3fs

    proxy.add(Rule("PUT", r"partNumber=2", "status", times=1000, status=500))
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options())
    with distckpt.CheckpointManager(s3_url, storage_options=via(proxy, s3_server, part_bytes=5 * 2**20),
                                    leftover_grace_s=0) as mgr:
        with pytest.raises(distckpt.StorageError):
            mgr.save(1, {"big": torch.randn(3 * 2**20)})
        # Nothing published: no manifest, no marker; what the failed save left (its rank file,
        # written by its rank before the replicated file failed) is an uncommitted leftover.
        left = [p.rsplit("/", 2)[-2:] for p in fs.find(s3_url[5:]) if "/fence/" not in p]
        assert left == [["ranks", "rank-00000.g000001.safetensors"]], left
        uploads = fs.call_s3("list_multipart_uploads", Bucket="ckpt", Prefix=s3_url[10:]).get("Uploads", [])
        assert uploads == []
        proxy.clear()
        mgr.save(2, {"big": torch.randn(3 * 2**20)})  # commits, and collects the failed save's leftover
        fs.invalidate_cache()
        assert {p.split("/")[2] for p in fs.find(s3_url[5:]) if "/fence/" not in p} == {"step-000000002"}


def test_a_lost_response_to_the_conditional_commit_is_recognised_as_success(s3_server, s3_url, proxy):
    proxy.add(Rule("PUT", r"COMMITTED", "drop", times=1))
    with distckpt.CheckpointManager(s3_url, storage_options=via(proxy, s3_server)) as mgr:
        mgr.save(1, state_with(0))
        assert mgr.committed_steps() == [1]
    marker_puts = [s for m, p, s in proxy.log if m == "PUT" and "COMMITTED" in p]
    assert marker_puts[0] == "drop" and "412" in marker_puts[1:]  # the retry met its own write


def test_two_writers_of_one_step_exactly_one_commits(s3_server, s3_url):
    from distckpt.storage import open_storage

    a = open_storage(s3_url, s3_server.storage_options())
    b = open_storage(s3_url, s3_server.storage_options())
    a.create_exclusive("step-000000001/COMMITTED", b"writer a")
    with pytest.raises(distckpt.CheckpointExistsError, match="another writer committed"):
        b.create_exclusive("step-000000001/COMMITTED", b"writer b")
    assert b.read_bytes("step-000000001/COMMITTED") == b"writer a"


@pytest.mark.faults  # make test-faults
def test_a_paused_server_is_an_error_within_the_timeout(s3_server, s3_url):
    state = state_with(0)
    opts = fast_options(s3_server.storage_options())
    with distckpt.CheckpointManager(s3_url, storage_options=opts) as mgr:
        mgr.save(1, state)
        remove = faults.on_point(lambda name, ctx: s3_server.pause() if name == "save/replicated-written" else None)
        start = time.monotonic()
        try:
            with pytest.raises(distckpt.StorageError):
                mgr.save(2, state)
        finally:
            remove()
            s3_server.resume()
        assert time.monotonic() - start < 90
    other = state_with(3)
    with distckpt.CheckpointManager(s3_url, storage_options=s3_server.storage_options()) as mgr:
        assert mgr.load_latest(other).step == 1
    assert torch.equal(weights(other), weights(state))


@pytest.mark.faults  # make test-faults; make test: S3 failing from the Nth request (test_s3_faults.py)
def test_a_server_killed_mid_save(tmp_path):
    from seaweed import SeaweedS3

    server = SeaweedS3(str(tmp_path / "weed")).start()
    try:
        server.make_bucket("ckpt")
        url, state = "s3://ckpt/killed", state_with(0)
        with distckpt.CheckpointManager(url, storage_options=fast_options(server.storage_options())) as mgr:
            mgr.save(1, state)
            remove = faults.on_point(lambda name, ctx: server.stop() if name == "save/rank-files-written" else None)
            try:
                with pytest.raises(distckpt.StorageError):
                    mgr.save(2, state)
            finally:
                remove()
        server.start()  # same data directory, new ports
        other = state_with(2)
        with distckpt.CheckpointManager(url, storage_options=server.storage_options()) as mgr:
            assert mgr.load_latest(other).step == 1
            assert mgr.committed_steps() == [1]
        assert torch.equal(weights(other), weights(state))
    finally:
        server.stop()


def test_credentials_never_appear(s3_server, s3_url, proxy, caplog):
    caplog.set_level(logging.DEBUG)  # every logger, botocore's request dumps included
    opts = via(proxy, s3_server)
    with distckpt.CheckpointManager(s3_url, storage_options=opts) as mgr:
        mgr.save(1, state_with(0))
        proxy.add(Rule("PUT", r"step-000000002", "status", times=1000, status=500))
        with pytest.raises(distckpt.StorageError) as info:
            mgr.save(2, state_with(0))
        texts = [repr(mgr), repr(mgr.storage), str(info.value), caplog.text,
                 mgr.storage.read_bytes("step-000000001/manifest.json").decode()]
    assert "botocore" in caplog.text and "Authorization" in caplog.text  # the dumps were there ...
    for text in texts:
        assert SECRET_KEY not in text and ACCESS_KEY not in text  # ... without the credentials


def test_a_session_token_never_appears_in_any_log_record(caplog):
    from distckpt.storage.redact import protect_credentials

    token = "FwoGZXIvYXdzEJr//////////wEaDSessionToken" + "x" * 40
    protect_credentials({"key": "AKIAEXAMPLEKEY123", "secret": "s3cr3t/EXAMPLE+key", "token": token})
    caplog.set_level(logging.DEBUG)
    logging.getLogger("botocore.endpoint").debug("Sending http request: %s",
                                                  {"X-Amz-Security-Token": token, "Authorization":
                                                   "AWS4-HMAC-SHA256 Credential=AKIAEXAMPLEKEY123/2026"})
    logging.getLogger("some.app").info("token=%s", token)
    assert len(caplog.records) == 2
    assert token not in caplog.text and "AKIAEXAMPLEKEY123" not in caplog.text
    assert caplog.text.count("***") == 3


def test_a_short_access_key_is_redacted_from_signed_request_dumps(caplog):
    """Keys shorter than the length a registered secret needs (a test server's "AKTEST") still
    appeared in botocore's Authorization header dumps."""
    from distckpt.storage.redact import protect_credentials

    protect_credentials({"key": "AKTEST", "secret": "SECRETtest123"})
    caplog.set_level(logging.DEBUG)
    logging.getLogger("botocore.endpoint").debug("Sending http request: %s", {
        "Authorization": "AWS4-HMAC-SHA256 Credential=AKTEST/20261203/us-east-1/s3/aws4_request, "
                         "SignedHeaders=host, Signature=abc"})
    assert "AKTEST" not in caplog.text and "Credential=***/20261203" in caplog.text, caplog.text


def test_a_write_failure_on_s3_fails_every_rank(s3_server, s3_url, proxy):
    proxy.add(Rule("PUT", r"replicated/", "status", times=1000, status=500))
    results = run_world("s3_workers:save_once", 2, url=s3_url, options=via(proxy, s3_server))
    for r in results:
        assert r.error_type == "StorageError", (r.rank, r.error)
        assert "rank(s) [0]" in r.error and "replicated/state.g000001.safetensors" in r.error


def test_abandoned_multipart_uploads_and_leftovers_are_collected(s3_server, s3_url):
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options())
    key = f"{s3_url[10:]}/step-000000007/replicated/state.g000001.safetensors"
    upload = fs.call_s3("create_multipart_upload", Bucket="ckpt", Key=key)
    fs.call_s3("upload_part", Bucket="ckpt", Key=key, UploadId=upload["UploadId"], PartNumber=1,
               Body=b"x" * (5 * 2**20))
    fs.pipe_file(f"{s3_url[5:]}/step-000000007/ranks/rank-00000.g000001.safetensors", b"partial")
    with distckpt.CheckpointManager(s3_url, storage_options=s3_server.storage_options(), leftover_grace_s=0) as mgr:
        mgr.save(1, state_with(0))
        assert mgr.committed_steps() == [1]
    uploads = fs.call_s3("list_multipart_uploads", Bucket="ckpt", Prefix=s3_url[10:]).get("Uploads", [])
    assert uploads == []
    fs.invalidate_cache()
    assert not any("step-000000007" in k for k in fs.find(s3_url[5:]))


def test_large_objects_are_read_as_concurrent_ranges(s3_server, s3_url, proxy):
    state = {"big": torch.randn(3 * 2**20)}  # 12 MiB: three 5 MiB ranges
    with distckpt.CheckpointManager(s3_url, storage_options=s3_server.storage_options()) as mgr:
        mgr.save(1, state)
    proxy.add(Rule("GET", r"replicated/state\.g000001\.safetensors", "reset", times=1))  # one range fails once
    back = {"big": torch.zeros(3 * 2**20)}
    with distckpt.CheckpointManager(s3_url, storage_options=via(proxy, s3_server, range_bytes=5 * 2**20)) as mgr:
        mgr.load_latest(back)
    gets = [s for m, p, s in proxy.log if m == "GET" and "replicated/state.g000001.safetensors" in p]
    assert len([s for s in gets if s in ("200", "206")]) == 3 and proxy.rules[0].hits == 1
    assert torch.equal(back["big"], state["big"])


def test_parts_regroup_any_chunks_and_grow_so_an_object_can_reach_5_tib(monkeypatch):
    from distckpt.storage import s3

    mib = 2**20
    sizes = [s3.part_size(n, 8 * mib) for n in range(1, 10_001)]
    assert sizes[0] == sizes[999] == 8 * mib and sizes[1000] == 16 * mib and max(sizes) <= 5 * 2**30
    assert sum(sizes) >= 5 * 2**40  # S3's largest object within its 10,000 parts
    monkeypatch.setattr(s3, "PARTS_PER_SIZE", 2)
    data = bytes(range(256)) * 3
    chunks = [data[:5], memoryview(data[5:300]), data[300:301], data[301:]]
    parts = list(s3._parts(chunks, 4))
    assert [len(p) for p in parts[:6]] == [4, 4, 8, 8, 16, 16] and b"".join(parts) == data
    assert len(parts[-1]) <= s3.part_size(len(parts), 4)
    assert list(s3._parts([b""], 4)) == []


def test_a_part_size_below_s3s_minimum_is_refused(s3_server, s3_url):
    with pytest.raises(distckpt.ConfigError, match="below S3's smallest multipart part"):
        distckpt.CheckpointManager(s3_url, storage_options={**s3_server.storage_options(), "part_bytes": 2**20})


def _requests_of(proxy, action, *args) -> int:
    proxy.log.clear()
    action(*args)
    return len(proxy.log)


def test_requests_per_save_and_per_load_do_not_grow_with_the_number_of_committed_steps(s3_server, s3_url, proxy):
    """Retention, leftover collection and the load's choice read the listing, not one object per
    committed step: a save with 16 committed steps (keep_last above them) and a load of a root
    holding 16 make as many requests as with 3."""
    opts = fast_options(s3_server.storage_options(proxy.endpoint))
    state = {"w": torch.arange(8.0), "gen": torch.Generator().manual_seed(1)}
    per_save: dict[int, int] = {}
    per_load: dict[int, int] = {}
    for history in (3, 16):
        url = f"{s3_url}-{history}"
        with distckpt.CheckpointManager(url, storage_options=opts, keep_last=1000, leftover_grace_s=0) as mgr:
            for step in range(1, history + 1):
                count = _requests_of(proxy, mgr.save, step, state)
            per_save[history] = count
        with distckpt.CheckpointManager(url, storage_options=opts) as mgr:
            per_load[history] = _requests_of(proxy, mgr.load_latest, state)
            assert mgr.committed_steps()[0] == history
    assert per_save[16] <= per_save[3] + 1, per_save
    assert per_load[16] <= per_load[3] + 1, per_load


def test_gc_names_the_abandoned_uploads_it_aborts_and_leaves_a_sibling_roots_alone(s3_server, s3_url, monkeypatch,
                                                                                    capsys):
    """`gc --dry-run` listed nothing while an upload a kill had abandoned was open, and `gc` aborted
    it without a word; the listing's bare prefix also matched a sibling root (runs/a vs runs/ab),
    whose uploads a gc of runs/a aborted."""
    import json

    import s3fs

    from distckpt.tools import cli
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options())
    with distckpt.CheckpointManager(s3_url, storage_options=s3_server.storage_options()) as mgr:
        mgr.save(1, state_with(0))

    def open_upload(key: str) -> str:
        upload = fs.call_s3("create_multipart_upload", Bucket="ckpt", Key=key)
        fs.call_s3("upload_part", Bucket="ckpt", Key=key, UploadId=upload["UploadId"], PartNumber=1,
                   Body=b"x" * (5 * 2**20))
        return upload["UploadId"]

    mine = "step-000000002/replicated/state.g000001.safetensors"
    open_upload(f"{s3_url[10:]}/{mine}")
    sibling = f"{s3_url[10:]}x/step-000000002/replicated/state.g000001.safetensors"
    open_upload(sibling)

    def open_keys() -> set[str]:
        return {u["Key"] for u in fs.call_s3("list_multipart_uploads", Bucket="ckpt",
                                             Prefix=s3_url[10:]).get("Uploads", [])}

    assert cli.main(["gc", s3_url, "--grace-s", "0", "--dry-run", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["aborted_uploads"] == [mine], planned
    assert open_keys() == {f"{s3_url[10:]}/{mine}", sibling}  # a dry run aborts nothing
    assert cli.main(["gc", s3_url, "--grace-s", "0"]) == 0
    assert f"aborted the abandoned upload of {mine}" in capsys.readouterr().out
    assert open_keys() == {sibling}  # the sibling root's upload is not ours
    with distckpt.CheckpointManager(s3_url, storage_options=s3_server.storage_options()) as mgr:
        assert mgr.committed_steps() == [1]


def test_managers_with_the_same_options_share_one_client_and_others_do_not(s3_server, s3_url):
    # Each manager built its own s3fs client, and botocore keeps what each resolves in module-level
    # caches: a sweep building a manager per trial grew by ~1-10 MiB per manager (266 -> 442 MiB
    # over 81 managers). One client per set of options and process now.
    import os

    opts = s3_server.storage_options()
    with distckpt.CheckpointManager(s3_url, storage_options=opts) as a, \
            distckpt.CheckpointManager(s3_url + "-other", storage_options=dict(opts)) as b:
        assert a.storage.fs is b.storage.fs  # equal options: one client (another prefix, same store)
        with distckpt.CheckpointManager(s3_url, storage_options={**opts, "retries": 5}) as c:
            assert c.storage.fs is not a.storage.fs and c.storage.fs.retries == 5 and a.storage.fs.retries == 3
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # a forked child (a loader worker, a multiprocessing pool) builds its own
            try:
                with distckpt.CheckpointManager(s3_url, storage_options=opts) as child:
                    os.write(write, b"own" if child.storage.fs is not a.storage.fs else b"shared")
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(read, 16) == b"own"


@pytest.mark.faults  # make test-faults
def test_a_process_building_a_manager_per_trial_does_not_grow(s3_server, s3_url):
    code = textwrap.dedent(f"""
        import gc, torch, distckpt
        opts = {s3_server.storage_options()!r}
        state = {{"w": torch.zeros(1024)}}
        def rss():
            return int([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1]) // 1024
        for i in range(25):
            mgr = distckpt.CheckpointManager({s3_url!r}, keep_last=2, storage_options=opts)
            mgr.load_latest(state)
            state["w"] += 1
            mgr.save(i, state)
            mgr.close()
            if i == 4:
                gc.collect()
                after_five = rss()
        gc.collect()
        print("growth MiB", rss() - after_five)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    growth = int(out.stdout.split("growth MiB")[1])
    assert growth < 25, out.stdout  # 20 more managers: ~90 MiB before, 0 after (botocore's caches per client)


def test_credentials_rotated_in_the_environment_get_a_new_client(s3_server, s3_url, monkeypatch):
    opts = s3_server.storage_options()
    with distckpt.CheckpointManager(s3_url, storage_options=opts) as a:
        monkeypatch.setenv("AWS_SESSION_TOKEN", "rotated")
        with distckpt.CheckpointManager(s3_url, storage_options=opts) as b:
            assert b.storage.fs is not a.storage.fs
