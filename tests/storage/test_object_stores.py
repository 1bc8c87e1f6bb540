"""Checkpoints on the object stores beside S3, each on its emulator on loopback: Google Cloud
Storage (gcsfs, fake-gcs-server) and Azure Blob (adlfs, Azurite). The manager's save and exact
resume, a resume in a new process, damage after commit, and the commit marker's native exclusive
create (ifGenerationMatch=0, If-None-Match: *)."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
import torch
from torch import nn

import distckpt


def state_with(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Linear(256, 8)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters()),
            "big": torch.randn(2**20), "gen": torch.Generator().manual_seed(seed), "config": {"seed": seed}}


def same(a: dict, b: dict) -> bool:
    return (torch.equal(a["model"].weight, b["model"].weight) and torch.equal(a["big"], b["big"])
            and torch.equal(a["gen"].get_state(), b["gen"].get_state()))


@pytest.fixture(params=["gcs", "azure"])
def store(request):
    """(url of a fresh prefix, storage_options, an fsspec filesystem on the same store)."""
    url = f"{'gs' if request.param == 'gcs' else 'az'}://ckpt/run-{uuid.uuid4().hex[:8]}"
    if request.param == "gcs":
        from gcsfs.core import GCSFileSystem

        server = request.getfixturevalue("gcs_server")
        return url, server.storage_options(), GCSFileSystem(skip_instance_cache=True, **server.storage_options())
    from adlfs import AzureBlobFileSystem

    server = request.getfixturevalue("azure_server")
    return url, server.storage_options(), AzureBlobFileSystem(skip_instance_cache=True, **server.storage_options())


def test_save_and_resume_exactly(store):
    url, options, _ = store
    saved = state_with(1)
    with distckpt.CheckpointManager(url, storage_options=options, keep_last=2) as mgr:
        assert mgr.load_latest(state_with(5)) is None
        for step in (1, 2, 3):
            mgr.save(step, saved)
        assert sorted(mgr.committed_steps()) == [2, 3]
    back = state_with(9)
    with distckpt.CheckpointManager(url, storage_options=options) as mgr:
        assert mgr.load_latest(back).step == 3
    assert same(back, saved)


def test_a_resume_in_a_new_process_reads_what_was_committed(store):
    url, options, _ = store
    with distckpt.CheckpointManager(url, storage_options=options) as mgr:
        mgr.load_latest({})
        mgr.save(7, {"w": torch.arange(1000.0)})
    code = ("import sys, torch, distckpt\n"
            f"state = {{'w': torch.zeros(1000)}}\n"
            f"with distckpt.CheckpointManager({url!r}, storage_options={options!r}) as m:\n"
            "    assert m.load_latest(state).step == 7\n"
            "assert torch.equal(state['w'], torch.arange(1000.0))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # and it exits quietly: the client's own exit finalizers ran before the IO loop was stopped
    assert "Traceback" not in out.stderr and "Loop is not running" not in out.stderr, out.stderr[-2000:]


def test_a_flipped_byte_falls_back_to_the_previous_step(store):
    url, options, fs = store
    first, second = state_with(1), state_with(2)
    with distckpt.CheckpointManager(url, storage_options=options) as mgr:
        mgr.save(1, first)
        mgr.save(2, second)
    payload = next(k for k in fs.find(url.split("://")[1])
                   if "step-000000002/replicated" in k and k.endswith(".safetensors"))
    data = bytearray(fs.cat_file(payload))
    data[len(data) // 2] ^= 0x10
    fs.pipe_file(payload, bytes(data))
    back = state_with(9)
    with distckpt.CheckpointManager(url, storage_options=options) as mgr:
        with pytest.warns(distckpt.CheckpointFallbackWarning, match="step 2"):
            assert mgr.load_latest(back).step == 1
    assert same(back, first)


def test_two_writers_of_one_step_exactly_one_commits(store):
    url, options, _ = store
    from distckpt.storage import open_storage

    a = open_storage(url, options)
    b = open_storage(url, options)
    a.create_exclusive("step-000000001/COMMITTED", b"writer a")
    with pytest.raises(distckpt.CheckpointExistsError, match="another writer committed"):
        b.create_exclusive("step-000000001/COMMITTED", b"writer b")
    assert b.read_bytes("step-000000001/COMMITTED") == b"writer a"


def test_no_non_atomic_warning(store, recwarn):
    url, options, _ = store
    from distckpt.storage import NonAtomicStorageWarning, open_storage

    open_storage(url, options)
    assert not [w for w in recwarn if issubclass(w.category, NonAtomicStorageWarning)]


def test_azure_credentials_never_appear_in_logs_errors_or_the_manifest(azure_server, caplog):
    import logging

    from azurite import KEY

    caplog.set_level(logging.DEBUG)  # every logger, the Azure SDK's request logging included
    options = azure_server.storage_options()
    with distckpt.CheckpointManager(f"az://ckpt/creds-{uuid.uuid4().hex[:8]}", storage_options=options) as mgr:
        mgr.save(1, state_with(0))
        manifest = mgr.storage.read_bytes("step-000000001/manifest.json").decode()
        texts = [repr(mgr), repr(mgr.storage), manifest]
    with pytest.raises(distckpt.DistCkptError) as info:  # a container that does not exist
        with distckpt.CheckpointManager("az://no-such-container/x", storage_options=options) as mgr:
            mgr.save(1, state_with(0))
    texts += [str(info.value), caplog.text]
    assert "azure" in caplog.text.lower()  # the SDK's records were there ...
    for text in texts:
        assert KEY not in text  # ... without the account key


def test_a_gcs_service_account_key_is_redacted_from_every_log_record(caplog):
    import logging

    from distckpt.storage.redact import protect_credentials

    secret = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC" + "x" * 40
    protect_credentials({"token": {"type": "service_account", "private_key": secret, "client_email": "a@b"}})
    caplog.set_level(logging.DEBUG)
    logging.getLogger("google.auth").debug("signing with %s", secret)
    assert secret not in caplog.text and "***" in caplog.text


@pytest.mark.parametrize("url, options", [
    ("az://ckpt/x", {"connection_string": "not a connection string"}),
    ("gs://ckpt/x", {"token": 12}),
])
def test_options_the_client_refuses_are_config_errors(url, options):
    with pytest.raises(distckpt.ConfigError, match="storage_options for"):
        distckpt.CheckpointManager(url, storage_options=options)


def test_a_missing_azure_container_is_a_storage_error_that_says_so(azure_server):
    with pytest.raises(distckpt.StorageError, match="container does not exist"):
        with distckpt.CheckpointManager("az://no-such-container/x", storage_options=azure_server.storage_options()) as mgr:
            mgr.save(1, state_with(0))


def test_a_missing_gcs_bucket_is_a_storage_error_that_says_so(gcs_server):
    with pytest.raises(distckpt.StorageError, match="does the bucket exist"):
        with distckpt.CheckpointManager("gs://no-such-bucket/x", storage_options=gcs_server.storage_options()) as mgr:
            mgr.save(1, state_with(0))


def test_a_first_save_into_an_s3_bucket_that_does_not_exist_names_the_bucket(s3_server):
    """It said only "s3://no-such-bucket/x/fence does not exist"."""
    with pytest.raises(distckpt.StorageError, match="the bucket 'no-such-bucket' does not exist"):
        with distckpt.CheckpointManager("s3://no-such-bucket/x", storage_options=s3_server.storage_options()) as mgr:
            mgr.save(1, state_with(0))


@pytest.mark.parametrize("backend", ["s3", "gcs", "azure"])
def test_a_load_from_a_bucket_that_does_not_exist_is_an_error_not_a_fresh_start(backend, request):
    """A typo in the bucket name must not make a resuming job start from scratch."""
    server = request.getfixturevalue({"s3": "s3_server", "gcs": "gcs_server", "azure": "azure_server"}[backend])
    scheme, word = {"s3": ("s3", "bucket"), "gcs": ("gs", "bucket"), "azure": ("az", "container")}[backend]
    with distckpt.CheckpointManager(f"{scheme}://no-such-{word}/run", storage_options=server.storage_options()) as mgr:
        with pytest.raises(distckpt.StorageError, match=f"the {word} 'no-such-{word}' does not exist"):
            mgr.load_latest(state_with(0))
    with distckpt.CheckpointManager(f"{scheme}://ckpt/empty-{uuid.uuid4().hex[:8]}",
                                    storage_options=server.storage_options()) as mgr:
        assert mgr.load_latest(state_with(0)) is None  # an existing bucket with nothing in it: a fresh start
