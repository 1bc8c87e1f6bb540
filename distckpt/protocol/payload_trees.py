"""What a load checks of a step's payload trees without the live `state`, shared by everything
that decides whether a step is whole: `verify` (and `prune`, `ls --verify` through it), `export`,
`load_weights` and `inspect`. They checked file digests only; a step whose rank file held
another rank or a malformed random stream was "ok" to them while every load skipped it as
damaged — and `prune --keep-last 1` then removed the steps a resume could still use."""

from __future__ import annotations

from typing import Any

from distckpt.errors import CorruptCheckpointError
from distckpt.io import manifest as mf
from distckpt.state.rng import check_process_rng


def check_replicated_tree(tree: Any, manifest: mf.Manifest, where: str) -> None:
    """The replicated file's tree belongs to this step."""
    mf.check_tree_belongs(tree, manifest.step, manifest.epoch, where)


def check_rank_tree(tree: Any, rank: int, manifest: mf.Manifest, where: str) -> None:
    """A rank's file: of this step, of that rank, its random streams such that a restore cannot
    fail (the same checks the load runs before it changes anything)."""
    mf.check_tree_belongs(tree, manifest.step, manifest.epoch, where)
    if manifest.imported is not None:
        return  # from torch.save / DCP: no per-rank state, and a load reads no rank file
    if not isinstance(tree, dict) or tree.get("rank") != rank:
        held = tree.get("rank") if isinstance(tree, dict) else None
        raise CorruptCheckpointError(f"{where}: the file for rank {rank} holds rank {held!r}")
    check_process_rng(tree.get("rng"), where)


def rank_of_file(manifest: mf.Manifest, name: str) -> int | None:
    """The rank whose own file `name` is, None for any other file of the step."""
    _, rank_names = manifest.payload_names()
    try:
        return rank_names.index(name)
    except ValueError:
        return None
