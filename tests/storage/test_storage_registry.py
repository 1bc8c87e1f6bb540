"""Storage backends as a registry (distckpt/storage/registry.py): every backend states every fact
of its spec, schemes are claimed once, every per-backend list is read from the registry, and a
backend added in one place (here: this file) is dispatched, mapped, redacted and jitter-tuned with
no other file touched."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import re
import sys
import types
import uuid

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import distckpt
from distckpt.storage import BackendSpec, FsspecStorage, backends, open_storage, register_backend, unregister_backend
from distckpt.storage.registry import LOCAL_PATH, backend_for

FIELDS = [f.name for f in dataclasses.fields(BackendSpec)]
OPTIONAL_FIELDS = {"client_errors"}


def _spec_kwargs(**changes) -> dict:
    base = dict(name="probe", schemes=("probe",), open=lambda url, options: None, exclusive_create=True, container=None,
                client_packages=(), install_hint="", jitter_modules=(), secret_env=(), secret_options=(),
                credential_env_prefixes=(), selected_by=(), client_errors=())
    assert sorted(base) == sorted(FIELDS), "a field of BackendSpec this test does not know"
    return {**base, **changes}


@pytest.mark.parametrize("field", FIELDS)
def test_a_spec_without_a_field_is_refused(field):
    """No field has a default (but client_errors, added later: a backend written before it still
    registers): a backend states each fact, even that it has none of a kind."""
    if field in OPTIONAL_FIELDS:
        kwargs = _spec_kwargs()
        del kwargs[field]
        assert getattr(BackendSpec(**kwargs), field) == ()
        return
    kwargs = _spec_kwargs()
    del kwargs[field]
    with pytest.raises(TypeError, match=field):
        BackendSpec(**kwargs)


MALFORMED = {"name": "Not A Name", "schemes": ("S3",), "open": "not callable", "exclusive_create": "yes",
             "container": "", "client_packages": ("",), "install_hint": None, "jitter_modules": "botocore",
             "secret_env": ("",), "secret_options": [("key")], "credential_env_prefixes": (3,),
             "selected_by": (("client",),), "client_errors": (ValueError, "not a path", int)}


@pytest.mark.parametrize("field", FIELDS)
def test_a_malformed_field_is_refused_naming_it(field):
    assert set(MALFORMED) == set(FIELDS)
    with pytest.raises(distckpt.ConfigError, match=f"^BackendSpec\\(.*\\b{field}="):
        BackendSpec(**_spec_kwargs(**{field: MALFORMED[field]}))


@pytest.mark.parametrize("spec", backends(), ids=lambda s: s.name)
def test_every_registered_backend_states_every_field(spec):
    """Every field present and well formed (re-checked here), and the facts that go together:
    a backend with a client library says how to install it, a backend with secrets in the
    environment names the environment its client reads them from."""
    for field in FIELDS:
        if field not in OPTIONAL_FIELDS:
            assert dataclasses.fields(BackendSpec)[FIELDS.index(field)].default is dataclasses.MISSING
        assert getattr(spec, field, None) is not None or field == "container", field
    dataclasses.replace(spec)  # __post_init__ checks every field again
    if spec.client_packages:
        assert spec.install_hint.startswith("pip install"), spec.install_hint
    for name in spec.secret_env:
        assert name.isupper() and name.startswith(spec.credential_env_prefixes), name
    if spec.container is not None:
        assert LOCAL_PATH not in spec.schemes and not spec.is_fallback


def test_each_scheme_is_claimed_once_and_there_is_one_local_and_one_fallback_backend():
    specs = backends()
    claims = [(scheme, tuple(sorted(spec.selected_by))) for spec in specs for scheme in spec.schemes]
    assert len(claims) == len(set(claims)), claims
    assert [s.name for s in specs if s.is_fallback] == ["fsspec"]
    assert [s.name for s in specs if LOCAL_PATH in s.schemes] == ["local"]
    assert backend_for("s3", {"client": "crt"}).name == "s3-crt" and backend_for("s3", {}).name == "s3"
    assert backend_for("ftp", {}).name == "fsspec" and backend_for("file", {}).name == "local"


def test_a_clashing_registration_is_refused_and_replace_takes_the_place():
    s3 = backend_for("s3", {})
    with pytest.raises(distckpt.ConfigError, match="already registered"):
        register_backend(dataclasses.replace(s3, name="another-s3"))
    with pytest.raises(distckpt.ConfigError, match="the name already registered"):
        register_backend(dataclasses.replace(s3, schemes=("s3x",)))
    with pytest.raises(distckpt.ConfigError, match="already registered"):
        register_backend(dataclasses.replace(s3, name="another-fallback", schemes=()))
    try:
        register_backend(dataclasses.replace(s3, install_hint="pip install elsewhere"), replace=True)
        assert backend_for("s3", {}).install_hint == "pip install elsewhere"
    finally:
        register_backend(s3, replace=True)
    assert backend_for("s3", {}) is s3


@pytest.mark.parametrize("spec", [s for s in backends() if s.client_packages], ids=lambda s: s.name)
def test_a_missing_client_package_names_how_to_install_it(spec, monkeypatch):
    """The client library is imported when a root is opened; its absence is a ConfigError that
    carries the spec's advice, not a bare ImportError from deep inside."""
    from distckpt.storage import clients

    package = spec.client_packages[0]
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")] + [package]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(clients, "_CLIENTS", {})  # no client shared from an earlier test
    url = f"{spec.schemes[0]}://ckpt/run-{uuid.uuid4().hex[:8]}"
    with pytest.raises(distckpt.ConfigError, match=f"the {spec.name} backend needs {package},.*{re.escape(spec.install_hint)}"):
        open_storage(url, dict(spec.selected_by))


# -- a backend added in one file ------------------------------------------------------------------

class ToyFileSystem(MemoryFileSystem):
    """fsspec's in-memory file system with a store of its own, and a client error on demand."""

    store: dict = {}
    pseudo_dirs = [""]
    fail_next_read = False

    def cat_file(self, path, start=None, end=None, **kwargs):
        if ToyFileSystem.fail_next_read:
            ToyFileSystem.fail_next_read = False
            raise sys.modules["toyclient"].ToyClientError("the toy service is busy")
        return super().cat_file(path, start=start, end=end, **kwargs)


class ToyStorage(FsspecStorage):
    """Checkpoints under toy://<path>, kept in this process."""


def open_toy(url: str, options: dict) -> ToyStorage:
    import toyclient  # the client library, imported when a root is opened (as gcsfs, adlfs)

    fs = ToyFileSystem(skip_instance_cache=True)
    return ToyStorage(fs, "/" + url.split("://", 1)[1].strip("/"), url, exclusive_create=toyclient.EXCLUSIVE)


def _toy_client_module() -> types.ModuleType:
    """A client library: its own error class, and retry jitter drawn from the global `random`."""
    module = types.ModuleType("toyclient")
    module.random = random
    module.EXCLUSIVE = True
    module.ToyClientError = type("ToyClientError", (Exception,), {"__module__": "toyclient"})
    return module


TOY = BackendSpec(name="toy", schemes=("toy",), open=open_toy, exclusive_create=True, container=None,
                  client_packages=("toyclient",), install_hint="pip install toyclient", jitter_modules=("toyclient",),
                  secret_env=("TOY_TOKEN",), secret_options=("toy_key",), credential_env_prefixes=("TOY_",),
                  selected_by=())


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(sys.modules, "toyclient", _toy_client_module())
    register_backend(TOY)
    yield sys.modules["toyclient"]
    unregister_backend("toy")


def test_a_backend_registered_in_one_file_saves_and_resumes(toy):
    url = f"toy://runs/{uuid.uuid4().hex[:8]}"
    weights = torch.arange(6, dtype=torch.float32)
    with distckpt.CheckpointManager(url, keep_last=2) as mgr:
        assert mgr.load_latest({"w": torch.zeros(6)}) is None
        for step in (1, 2, 3):
            mgr.save(step, {"w": weights + step, "config": {"lr": 0.1}})
    state = {"w": torch.zeros(6), "config": {"lr": 0.1}}
    with distckpt.CheckpointManager(url) as mgr:
        assert isinstance(mgr.storage, ToyStorage)
        assert mgr.load_latest(state).step == 3 and mgr.committed_steps() == [3, 2]
    assert torch.equal(state["w"], weights + 3)
    assert any(key.startswith("/runs/") for key in ToyFileSystem.store)  # written where its URL says
    assert not MemoryFileSystem.store.keys() & ToyFileSystem.store.keys()


def test_a_registered_backends_client_errors_jitter_secrets_and_credentials_are_read_from_its_spec(toy, monkeypatch, caplog):
    """What four hand-kept lists held is read from the spec: the client's exception becomes a
    StorageError (a backend whose spec omitted its package lets it through as a defect), its
    jitter leaves the global stream, its secrets are redacted, its environment keys shared clients."""
    from distckpt.storage import clients

    monkeypatch.setenv("TOY_TOKEN", "toy-secret-" + uuid.uuid4().hex)
    storage = open_storage(f"toy://errors/{uuid.uuid4().hex[:8]}", {"toy_key": "toy-key-" + uuid.uuid4().hex})
    assert toy.random is not random  # pointed at a private generator when the root was opened
    storage.write_file("f", [b"x"])
    ToyFileSystem.fail_next_read = True
    with pytest.raises(distckpt.StorageError, match="ToyClientError: the toy service is busy"):
        storage.read_bytes("f")
    with caplog.at_level(logging.INFO, logger="toy.client"):  # a client logging its request at INFO
        logging.getLogger("toy.client").info("headers: token=%s", os.environ["TOY_TOKEN"])
    assert os.environ["TOY_TOKEN"] not in caplog.text and "token=***" in caplog.text
    assert ("TOY_TOKEN", os.environ["TOY_TOKEN"]) in clients._credential_environment()
    register_backend(dataclasses.replace(TOY, client_packages=()), replace=True)
    ToyFileSystem.fail_next_read = True
    with pytest.raises(toy.ToyClientError):  # not the store's answer any more: a defect, raised as it is
        storage.read_bytes("f")


def test_a_backend_that_says_it_checks_then_writes_is_warned_about(toy):
    register_backend(dataclasses.replace(TOY, exclusive_create=False), replace=True)
    toy.EXCLUSIVE = False
    with pytest.warns(distckpt.NonAtomicStorageWarning, match="toy://warned"):
        storage = open_storage("toy://warned")
    assert not storage.capabilities.exclusive_create


def _wrapper_module_with_its_own_error() -> types.ModuleType:
    """A module of the backend's own (not its client package) that defines the store's error."""
    module = types.ModuleType("toy_wrapper.errors")
    module.ToyWrapperError = type("ToyWrapperError", (Exception,), {"__module__": "toy_wrapper.errors"})
    return module


@pytest.mark.parametrize("named_as", ["class", "dotted path", "colon path"])
def test_a_backends_client_errors_become_storage_errors_in_save(toy, monkeypatch, named_as):
    """An exception class named in client_errors, defined outside client_packages, is the store's
    answer: save() raises StorageError naming it (nothing committed), not the raw class; one not
    named stays a defect, raised as it is."""
    wrapper = _wrapper_module_with_its_own_error()
    monkeypatch.setitem(sys.modules, "toy_wrapper.errors", wrapper)
    error = wrapper.ToyWrapperError
    named = {"class": error, "dotted path": "toy_wrapper.errors.ToyWrapperError",
             "colon path": "toy_wrapper.errors:ToyWrapperError"}[named_as]

    def refusing_writes(self, path, value, *args, **kwargs):
        raise error("503 SlowDown")

    monkeypatch.setattr(ToyFileSystem, "pipe_file", refusing_writes)
    url = f"toy://client-errors/{uuid.uuid4().hex[:8]}"
    register_backend(dataclasses.replace(TOY, client_errors=(named,)), replace=True)
    with distckpt.CheckpointManager(url) as mgr:
        with pytest.raises(distckpt.StorageError, match="ToyWrapperError: 503 SlowDown") as caught:
            mgr.save(1, {"w": torch.ones(2)})
        assert isinstance(caught.value, OSError) and isinstance(caught.value.__cause__, error)
    register_backend(TOY, replace=True)
    with distckpt.CheckpointManager(url) as mgr:
        with pytest.raises(error):  # no spec names it: a defect, not translated
            mgr.save(2, {"w": torch.ones(2)})


@pytest.mark.parametrize("listing", ["nothing", "all but the rank file"])
def test_a_listing_that_lags_its_writes_is_named_so_in_a_world_of_one(toy, monkeypatch, listing):
    """A store whose listing is not read-after-write consistent, in a world of one: the files rank 0
    has just written are said to be missing from the store's listing (a backend's fault), not a
    disagreement of ranks that should be given one URL; nothing is committed."""
    honest = FsspecStorage.list_files

    def lagging(self, path="", start_after=None):
        files = honest(self, path, start_after)
        return {} if listing == "nothing" else {k: v for k, v in files.items() if not k.startswith("ranks/")}

    monkeypatch.setattr(ToyStorage, "list_files", lagging)
    url = f"toy://lagging/{uuid.uuid4().hex[:8]}"
    with distckpt.CheckpointManager(url) as mgr:
        with pytest.raises(distckpt.StorageError, match=r"just written are not listed by the store \(first: ranks/") as caught:
            mgr.save(1, {"w": torch.ones(2)})
    assert "Give every rank" not in str(caught.value) and "step-000000001" in str(caught.value)
    monkeypatch.setattr(ToyStorage, "list_files", honest)
    with distckpt.CheckpointManager(url) as mgr:
        assert mgr.committed_steps() == []
