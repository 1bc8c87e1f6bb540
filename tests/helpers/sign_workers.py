"""Functions run on every rank by distckpt.testing.run_world for the signing tests."""

from __future__ import annotations

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
