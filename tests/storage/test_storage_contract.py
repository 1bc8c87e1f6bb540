"""One contract, every registered backend (distckpt/storage/registry.py), each on its fixture:
local disk, memory://, the generic fsspec backend over a file system distckpt does not know,
S3 on a real SeaweedFS server read by each client: s3fs (large files downloaded into a local
file, or held in memory) and the CRT client of s3torchconnector (credentials from the
environment, as it takes them), and Google Cloud Storage on fake-gcs-server and Azure Blob on
Azurite (each honours the precondition of its marker: ifGenerationMatch=0, If-None-Match: *).

The suite is parametrized from the registry: a backend registered without a fixture here fails."""

from __future__ import annotations

import uuid
from typing import Any, Callable

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from distckpt.errors import CheckpointExistsError, MissingFileError, StorageError
from distckpt.storage import NonAtomicStorageWarning, backends, normalize_url, open_storage, scheme_of
from distckpt.storage.registry import backend_for

Opener = Callable[[Any, Any, Any], "tuple[str, dict[str, Any]]"]  # (request, tmp_path, monkeypatch) -> url, options


class UnknownToDistckpt(MemoryFileSystem):
    """An fsspec file system no distckpt backend claims: the generic fsspec backend opens it."""

    protocol = ("contractfs",)
    store: dict = {}  # its own, not memory://'s
    pseudo_dirs = [""]

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.replace("contractfs://", "memory://", 1) if isinstance(path, str) else path)


def _local(request, tmp_path, monkeypatch):
    return str(tmp_path / "root"), {}


def _memory(request, tmp_path, monkeypatch):
    return f"memory://contract-{uuid.uuid4().hex}", {}


def _fsspec(request, tmp_path, monkeypatch):
    fsspec.register_implementation("contractfs", UnknownToDistckpt, clobber=True)
    return f"contractfs://contract-{uuid.uuid4().hex}", {}


def _gcs(request, tmp_path, monkeypatch):
    return f"gs://ckpt/contract-{uuid.uuid4().hex[:8]}", request.getfixturevalue("gcs_server").storage_options()


def _azure(request, tmp_path, monkeypatch):
    return f"az://ckpt/contract-{uuid.uuid4().hex[:8]}", request.getfixturevalue("azure_server").storage_options()


SMALL_RANGES = {"range_bytes": 2**20}  # large-file reads in several ranged GETs


def _s3(request, tmp_path, monkeypatch):
    server = request.getfixturevalue("s3_server")
    return f"s3://ckpt/contract-{uuid.uuid4().hex[:8]}", {**server.storage_options(), **SMALL_RANGES, "client": "s3fs"}


def _s3_in_memory(request, tmp_path, monkeypatch):
    server = request.getfixturevalue("s3_server")
    return f"s3://ckpt/contract-{uuid.uuid4().hex[:8]}", {**server.storage_options(), **SMALL_RANGES, "spill_dir": None}


def _s3_crt(request, tmp_path, monkeypatch):
    for name, value in request.getfixturevalue("s3_server").env().items():
        monkeypatch.setenv(name, value)
    return f"s3://ckpt/contract-{uuid.uuid4().hex[:8]}", {"client": "crt"}


# backend name -> its variants (id -> opener). Every registered backend needs at least one.
CONTRACT_FIXTURES: dict[str, dict[str, Opener]] = {
    "local": {"local": _local},
    "memory": {"memory": _memory},
    "fsspec": {"fsspec": _fsspec},
    "s3": {"s3": _s3, "s3-in-memory": _s3_in_memory},
    "s3-crt": {"s3-crt": _s3_crt},
    "gcs": {"gcs": _gcs},
    "azure": {"azure": _azure},
}
SLOW_VARIANTS = {"s3-in-memory"}  # run with the fault suite


def _params() -> list:
    params = []
    for spec in backends():
        variants = CONTRACT_FIXTURES.get(spec.name) or {f"{spec.name}-without-fixture": None}
        for variant in variants:
            marks = [pytest.mark.faults] if variant in SLOW_VARIANTS else []
            params.append(pytest.param((spec.name, variant), id=variant, marks=marks))
    return params


@pytest.fixture(params=_params())
def backend(request, tmp_path, monkeypatch):
    """(the backend's spec, a fresh root of it), opened through open_storage as a user would."""
    name, variant = request.param
    opener = CONTRACT_FIXTURES.get(name, {}).get(variant)
    if opener is None:
        pytest.fail(f"the storage backend {name!r} is registered without a contract fixture: add one to "
                    "CONTRACT_FIXTURES in tests/storage/test_storage_contract.py")
    url, options = opener(request, tmp_path, monkeypatch)
    url = normalize_url(url)
    spec = backend_for(scheme_of(url), options)
    assert spec.name == name, f"{variant}'s fixture opens the {spec.name} backend, not {name}"
    if spec.exclusive_create:
        storage = open_storage(url, options)
    else:
        with pytest.warns(NonAtomicStorageWarning, match="not known to create files exclusively"):
            storage = open_storage(url, options)
    if variant == "s3":
        assert storage.crt is None and storage.spill_dir
    elif variant == "s3-in-memory":
        assert storage.crt is None and storage.spill_dir is None
    elif variant == "s3-crt":
        assert storage.crt is not None
    return spec, storage


@pytest.fixture
def storage(backend):
    return backend[1]


def test_every_registered_backend_has_a_contract_fixture():
    names = [spec.name for spec in backends()]
    assert {"local", "memory", "fsspec", "s3", "s3-crt", "gcs", "azure"} <= set(names)
    missing = sorted(set(names) - set(CONTRACT_FIXTURES))
    assert not missing, f"registered without a contract fixture in CONTRACT_FIXTURES: {missing}"


def test_write_read_list(storage):
    storage.write_file("step-1/a/x.bin", [b"he", memoryview(b"llo")])
    storage.write_file("step-1/y.json", [b"{}"])
    assert storage.read_bytes("step-1/a/x.bin") == b"hello"
    assert storage.list_dir("") == ["step-1"]
    assert storage.list_dir("step-1") == ["a", "y.json"]
    assert storage.list_dir("nothing-here") == []
    assert storage.exists("step-1/y.json") and not storage.exists("step-1/z")
    assert storage.newest_mtime("step-1") is not None


def test_overwrite_replaces_whole(storage):
    storage.write_file("f", [b"first version"])
    storage.write_file("f", [b"2nd"])
    assert storage.read_bytes("f") == b"2nd"


def test_missing_file_is_file_not_found(storage):
    with pytest.raises(MissingFileError) as info:
        storage.read_bytes("step-9/none")
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, StorageError)


def test_exclusive_create_refuses_a_second_writer(storage):
    storage.write_file("step-1/data", [b"x"])
    storage.create_exclusive("step-1/COMMITTED", b"writer one")
    with pytest.raises(CheckpointExistsError):
        storage.create_exclusive("step-1/COMMITTED", b"writer two")
    assert storage.read_bytes("step-1/COMMITTED") == b"writer one"


def test_listing_sees_fresh_state(storage):
    storage.write_file("step-1/a", [b"1"])
    assert storage.list_dir("step-1") == ["a"]
    storage.write_file("step-1/b", [b"2"])  # a cached listing would miss this
    assert storage.list_dir("step-1") == ["a", "b"]
    storage.remove_file("step-1/a")
    assert storage.list_dir("step-1") == ["b"]


def test_remove_tree_and_absent_removals(storage):
    storage.write_file("step-1/x/y", [b"1"])
    storage.write_file("step-2/z", [b"1"])
    storage.remove_tree("step-1")
    storage.remove_tree("step-7")
    storage.remove_file("step-7/nothing")
    assert storage.list_dir("") == ["step-2"]


def test_large_file_roundtrips(storage):
    blob = bytes(range(256)) * (3 * 2**20 // 256 + 17)
    storage.write_file("big", [memoryview(blob)[: len(blob) // 2], memoryview(blob)[len(blob) // 2:]])
    assert storage.read_bytes("big") == blob


@pytest.mark.parametrize("size", [0, 1000, 4 * 2**20 - 1, 4 * 2**20, 9 * 2**20 + 12345])
def test_read_buffer_holds_exactly_the_file(storage, size):
    """Every read path (one GET, ranged GETs into memory or a download file, the CRT stream)
    gives back exactly the bytes written, and a missing file is MissingFileError."""
    import os

    blob = os.urandom(size)
    storage.write_file("step-1/blob", [blob])
    assert bytes(storage.read_buffer("step-1/blob")) == blob
    with pytest.raises(MissingFileError):
        storage.read_buffer("step-1/absent")


@pytest.mark.parametrize("size", [0, 1, 100, 101])
def test_a_bounded_read_gives_the_file_or_refuses_a_larger_one(storage, size):
    """read_bytes(path, max_bytes): the whole file up to the bound (an empty one too: S3 answers
    a ranged GET of an empty object with 416), StorageError EFBIG above it."""
    import errno
    import os

    blob = os.urandom(size)
    storage.write_file("small", [blob])
    if size <= 100:
        assert storage.read_bytes("small", 100) == blob
    else:
        with pytest.raises(StorageError) as info:
            storage.read_bytes("small", 100)
        assert info.value.errno == errno.EFBIG


def test_size_is_read_fresh_and_none_when_absent(storage):
    storage.write_file("step-1/s.bin", [b"x" * 1000])
    assert storage.size("step-1/s.bin") == 1000
    storage.write_file("step-1/s.bin", [b"y" * 10])
    assert storage.size("step-1/s.bin") == 10
    assert storage.size("step-1/absent.bin") is None


def test_list_files_is_one_fresh_recursive_listing_with_version_tags(storage):
    storage.write_file("step-1/ranks/r0.bin", [b"1"])
    storage.write_file("step-1/COMMITTED", [b"first"])
    storage.write_file("top.json", [b"{}"])
    listed = storage.list_files("")
    assert sorted(listed) == ["step-1/COMMITTED", "step-1/ranks/r0.bin", "top.json"]
    assert sorted(storage.list_files("step-1")) == ["COMMITTED", "ranks/r0.bin"]
    assert storage.list_files("absent") == {}
    before = listed["step-1/COMMITTED"]
    storage.remove_file("step-1/COMMITTED")
    storage.write_file("step-1/COMMITTED", [b"other"])  # same size, written at once
    after = storage.list_files("")["step-1/COMMITTED"]
    # a tag, where there is one, tells the versions apart; "" means "read it to know"
    assert (before == after == "") or before != after
    if storage.url.startswith("s3://"):
        assert before and after  # S3 gives ETags: the commit index relies on them there


def test_concurrent_exclusive_creates_exactly_one_wins(storage):
    """Eight writers race for one marker at once: exactly one creates it, every other gets
    CheckpointExistsError, and the marker holds the winner's bytes. (A backend that says it only
    checks, then writes: at least one wins and the marker holds one winner's bytes whole.)"""
    from concurrent.futures import ThreadPoolExecutor

    def attempt(i: int) -> bool:
        try:
            storage.create_exclusive("step-1/COMMITTED", f"writer {i}".encode())
            return True
        except CheckpointExistsError:
            return False

    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(attempt, range(8)))
    marker = storage.read_bytes("step-1/COMMITTED")
    if storage.capabilities.exclusive_create:
        assert won.count(True) == 1, won
        assert marker == f"writer {won.index(True)}".encode()
    else:
        assert marker in {f"writer {i}".encode() for i, w in enumerate(won) if w}, (won, marker)


def test_the_declared_capabilities_hold(backend):
    """What a backend says of itself (storage/capabilities.py) is what it does, where a test can
    see it: a directory left without files, a large read held in a local file, no partial file
    from a write whose chunks fail midway."""
    import os

    from distckpt.storage import Capabilities, is_mapped

    spec, storage = backend
    caps = storage.capabilities
    assert isinstance(caps, Capabilities)
    assert caps.exclusive_create == spec.exclusive_create  # what the registry says is what it opened
    storage.write_file("step-1/only.bin", [b"x"])
    storage.remove_file("step-1/only.bin")
    assert (storage.list_dir("") == ["step-1"]) == caps.keeps_empty_directories
    blob = os.urandom(5 * 2**20)
    storage.write_file("step-2/big", [blob])
    buffer = storage.read_buffer("step-2/big")
    assert bytes(buffer) == blob
    if caps.ranged_reads and getattr(storage, "spill_dir", None):
        assert is_mapped(buffer)  # downloaded into a local file, not held in memory

    def failing():
        yield b"a" * 2**20
        raise OSError("the producer failed")

    with pytest.raises(OSError):
        storage.write_file("step-3/torn", failing())
    assert not storage.exists("step-3/torn")
