"""A verified load hashes large files with BLAKE3 on several threads (io/checksums.py
digest_threads, io/signing.py new_digest): the digest is BLAKE3's whatever the threads and the
pieces, and a process that forks after hashing (a loader's workers) still hashes in the child."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import distckpt
from distckpt.io import checksums, signing
from distckpt.io import manifest as mf


def _record(data: bytes) -> dict:
    return {"size": len(data), "xxh3_64": mf.checksum_of(data), signing.DIGEST: signing.digest_of(data)}


@settings(max_examples=20, deadline=None, derandomize=True)
@given(size=st.sampled_from([0, 1, 1023, 1024, 1025, 64 << 10, (1 << 20) + 7]), threads=st.integers(2, 4),
       seed=st.integers(0, 255))
def test_a_threaded_digest_is_the_single_threaded_one(size, threads, seed):
    data = bytes((seed + i * 7) % 256 for i in range(min(size, 4096))) * (size // 4096 + 1)
    data = data[:size]
    one, many = signing.new_digest(), signing.new_digest(threads)
    one.update(data)
    for start in range(0, size or 1, 1 << 18):  # in pieces, as verify_file hands them over
        many.update(data[start:start + (1 << 18)])
    assert many.hexdigest() == one.hexdigest() == signing.digest_of(data)


def test_a_large_verified_file_is_hashed_on_the_cores_of_the_rank_but_one(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert checksums.digest_threads(checksums.PARALLEL_DIGEST_BYTES - 1) == 1  # a pool costs more than it saves
    assert checksums.digest_threads(checksums.PARALLEL_DIGEST_BYTES) == 5  # one left for the prefault thread
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # the node's cores are shared with its other ranks
    assert checksums.digest_threads(1 << 30) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert checksums.digest_threads(1 << 30) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    assert checksums.digest_threads(1 << 30) == 5
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert checksums.digest_threads(1 << 30) == 1  # 2 cores: the hash and the prefault, one each
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert checksums.digest_threads(1 << 30) == checksums.MAX_DIGEST_THREADS


def test_verify_file_hands_the_digest_its_threads_and_still_refuses_a_mismatch(monkeypatch):
    data = os.urandom((2 << 20) + 5)
    good, bad = _record(data), {**_record(data), signing.DIGEST: signing.digest_of(data[:-1] + b"\x00")}
    small = _record(data[:100])
    asked: list[int] = []
    made = signing.new_digest
    monkeypatch.setattr(signing, "new_digest", lambda threads=1: asked.append(threads) or made(threads))
    monkeypatch.setattr(checksums, "PARALLEL_DIGEST_BYTES", 1 << 20)
    monkeypatch.setattr(checksums, "digest_threads", lambda n: 2 if n >= (1 << 20) else 1)
    released: list[tuple[int, int]] = []
    mf.verify_file(data, good, "f", lambda s, n: released.append((s, n)), digest=True)
    assert asked == [2] and sum(n for _, n in released) == len(data)
    with pytest.raises(distckpt.UntrustedCheckpointError, match="does not match the signed"):
        mf.verify_file(data, bad, "f", digest=True)
    mf.verify_file(data[:100], small, "f", digest=True)
    assert asked[-1] == 1


_FORKS = textwrap.dedent("""
    import os, signal, sys
    from distckpt.io import signing
    data = os.urandom(24 << 20)
    expected = signing.digest_of(data)
    def child(hash_it):
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a child waiting on threads it did not inherit dies of SIGALRM, not silently
            os._exit(0 if hash_it() == expected else 3)
        return os.waitpid(pid, 0)[1]
    h = signing.new_digest(int(sys.argv[1])); h.update(data)
    assert h.hexdigest() == expected
    statuses = [child(lambda: signing.new_digest(int(sys.argv[1])).update(data).hexdigest())]  # after a use
    held = signing.new_digest(int(sys.argv[1])); held.update(data[:1 << 20])  # a hasher alive at the fork
    statuses.append(child(lambda: signing.new_digest(int(sys.argv[1])).update(data).hexdigest()))
    print(statuses)
    sys.exit(0 if statuses == [0, 0] else 1)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX only")
@pytest.mark.parametrize("threads", [1, 2])
def test_a_forked_child_hashes_after_its_parent_used_threads(threads):
    """BLAKE3's process-wide pool (max_threads=AUTO) hangs a forked child's hash for ever; a
    hasher with its own pool, made in the child, does not (a DataLoader worker verifying)."""
    done = subprocess.run([sys.executable, "-c", _FORKS, str(threads)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"a child's wait status (14: killed by SIGALRM, hung): {done.stdout} {done.stderr}"


def test_a_hasher_whose_threads_cannot_start_hashes_on_one(monkeypatch, caplog):
    """rayon panics when the OS refuses it a thread (a PanicException, a BaseException): the
    verify pass goes on on one thread rather than failing the load."""
    import blake3

    class Refused(BaseException):
        pass

    real = blake3.blake3

    def refusing(*args, **kwargs):
        if kwargs.get("max_threads", 1) != 1:
            raise Refused("failed to spawn thread")
        return real(*args, **kwargs)

    monkeypatch.setattr(blake3, "blake3", refusing)
    h = signing.new_digest(4)
    h.update(b"abc")
    assert h.hexdigest() == real(b"abc").hexdigest()
    assert "could not start 4 hashing threads" in caplog.text
