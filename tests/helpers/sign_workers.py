"""Functions run on every rank by distckpt.testing.run_world for the signing tests."""

from __future__ import annotations

import json

import distckpt


def signing_on_rank_zero_only(rank: int, world: int, url: str, key: bytes) -> None:
    distckpt.CheckpointManager(url, timeout=30, signing_key=key if rank == 0 else None).close()


def save_signed_forge_and_resume(rank: int, world: int, url: str, key: bytes, pub: bytes) -> dict:
    """Two signed saves by every rank; rank 0 forges step 2 as a bucket writer would; every rank
    then resumes from step 1, with the same warning."""
    import warnings

    import torch
    from forger import forge_step

    state = {"w": torch.full((8,), 1.0), "mine": distckpt.per_rank(torch.full((4,), float(rank)))}
    with distckpt.CheckpointManager(url, timeout=60, signing_key=key) as mgr:
        mgr.load_latest(state)
        mgr.save(1, state)
        state["w"].fill_(2.0)
        mgr.save(2, state)
    torch.distributed.barrier()
    if rank == 0:
        forge_step(url, 2)
    torch.distributed.barrier()
    state["w"].zero_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distckpt.CheckpointManager(url, timeout=60, verify_key=pub) as mgr:
            progress = mgr.load_latest(state)
    said = [str(w.message) for w in caught if issubclass(w.category, distckpt.CheckpointFallbackWarning)]
    return {"step": progress.step, "w": state["w"].tolist(), "mine": state["mine"].obj.tolist(), "warned": said}


def cooperative_load_past_a_wrong_digest(rank: int, world: int, url: str, options: dict, key: bytes,
                                         pub: bytes) -> dict:
    """Two signed saves of a replicated state large enough to be read cooperatively; rank 0 then
    signs step 2 again, with the key, over a digest table that gives its replicated file another
    BLAKE3 (its bytes and xxh3 untouched); every rank loads with the verify key."""
    import warnings

    import torch
    from coop_workers import _counting, bits, replicated_tensors

    from distckpt.io import manifest as mf
    from distckpt.io import signing
    from distckpt.storage import open_storage

    def state(seed: int) -> dict:
        return {"r": dict(replicated_tensors(seed, 1.3)), "gen": torch.Generator().manual_seed(seed)}

    with distckpt.CheckpointManager(url, storage_options=options, timeout=60, signing_key=key) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
    torch.distributed.barrier()
    if rank == 0:
        storage = open_storage(url, options)
        base = mf.step_dir(2)
        manifest = storage.read_bytes(f"{base}/{mf.MANIFEST}", 1 << 24)
        table = {f"{base}/{name}": record[signing.DIGEST] for name, record in json.loads(manifest)["files"].items()}
        replicated = next(path for path in table if "/replicated/" in path)
        table[replicated] = signing.digest_of(b"other bytes")
        storage.write_file(f"{base}/{signing.SIGNATURE}", [signing.signature_bytes(load_key(key), manifest, table)])
    torch.distributed.barrier()
    seen = _counting()
    loaded: dict = {"r": {}, "gen": torch.Generator()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distckpt.CheckpointManager(url, storage_options=options, timeout=60, verify_key=pub) as mgr:
            progress = mgr.load_latest(loaded)
    said = [str(w.message) for w in caught if issubclass(w.category, distckpt.CheckpointFallbackWarning)]
    return {"step": progress.step, "exchanges": seen["exchanges"], "warned": said,
            "same": all(bits(loaded["r"][k]) == bits(t) for k, t in state(1)["r"].items())}


def load_key(pem: bytes) -> object:
    from distckpt.io import signing

    return signing.load_signing_key(pem)
