"""The read phase of world_size_policy="elastic" at another world size (loading.py calls it).

Every new rank reads every old rank's file (verified, as any rank file is) and makes its own
per-rank state from them, before anything is changed:

* each per-rank entry from its kind's rule (`Kind.elastic`: a loader continues the interrupted
  epoch's global order, a DistributedSampler takes the agreed epoch, a generator follows the
  streams' rule) or from the user's `per_rank(obj, reshard=fn)`; an entry with neither is
  refused by name (ElasticResumeError), on every rank alike (the read phase's outcomes are
  exchanged);
* the process's random streams: old rank j's on new rank j < N, else seeded (elastic_rules.py).

Replicated and sharded state is read as "reshard" reads it. Nothing here writes or talks to
other ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from distckpt.errors import CorruptCheckpointError, ElasticResumeError
from distckpt.io import manifest as mf
from distckpt.state.capture import PER_RANK, Entry
from distckpt.state.elastic import ElasticContext
from distckpt.state.elastic_rules import process_rng_for
from distckpt.state.kinds import Trait

if TYPE_CHECKING:
    from distckpt.protocol.loading import ReadCheckpoint

POLICY = "elastic"


def read_sources(read_rank_file: Callable[[str], Any], manifest: mf.Manifest, where: str) -> list[dict[str, Any]]:
    """Every old rank's own file, checked to belong to the manifest's step."""
    _, rank_names = manifest.payload_names()
    sources = []
    for rank, name in enumerate(rank_names):
        tree = read_rank_file(name)
        if (tree.get("step", manifest.step), tree.get("epoch"), tree.get("rank")) != (manifest.step, manifest.epoch, rank):
            raise CorruptCheckpointError(f"{where}/{name}: it records step {tree.get('step')} epoch {tree.get('epoch')} "
                                         f"rank {tree.get('rank')}, the manifest step {manifest.step} epoch "
                                         f"{manifest.epoch} rank {rank}: the files do not belong together")
        sources.append(tree)
    return sources


def derive(read: "ReadCheckpoint", entries: list[Entry], rank: int, world_size: int) -> None:
    """Fill `read.own` with this rank's per-rank state at the new world size (see the module)."""
    sources = read.sources or []
    torch_cpu = (sources[0].get("rng") or {}).get("torch_cpu") if sources else None
    context = ElasticContext(rank, world_size, len(sources), read.step,
                             bytes(torch_cpu.numpy().tobytes()) if torch_cpu is not None else b"")
    own_entries: dict[str, Any] = {}
    resharded, rederived = [], []
    for entry in entries:
        if entry.scope != PER_RANK:
            continue
        records = [source["entries"].get(entry.key) for source in sources]
        if any(not isinstance(r, dict) for r in records):
            continue  # not saved by every rank: the missing-entry rule of the load applies
        states = [r.get("state") for r in records]
        if entry.reshard is not None:
            state = _apply_reshard(entry, states, context)
            resharded.append(entry.key)
        else:
            state = entry.kind_spec.elastic(entry, states, context)
            if not context.takes_over and Trait.SAMPLING_ORDER not in entry.kind_spec.traits(records[0]):
                rederived.append(entry.key)  # its streams seeded afresh (a sampler's epoch and seed are agreed)
        own_entries[entry.key] = {**records[0], "state": state}
    read.own = {"epoch": read.manifest.epoch, "rank": rank, "entries": own_entries,
                "rng": process_rng_for(sources, context)}
    read.per_rank_restored = True
    read.rederived = ([] if context.takes_over else ["rng"]) + rederived
    read.elastic_note = _note(read, context, resharded)


def _apply_reshard(entry: Entry, states: list[Any], context: ElasticContext) -> Any:
    """per_rank(obj, reshard=fn): fn(old values, new world size) -> one value per new rank."""
    try:
        values = entry.reshard(list(states), context.world_size)
    except Exception as e:
        raise ElasticResumeError(f"state[{entry.key!r}]: its reshard= function raised {type(e).__name__}: {e}") from e
    if not isinstance(values, (list, tuple)) or len(values) != context.world_size:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
        raise ElasticResumeError(f"state[{entry.key!r}]: its reshard= function must return a list of one value per "
                                 f"new rank ({context.world_size}), it returned {got}")
    return values[context.rank]


def _note(read: "ReadCheckpoint", context: ElasticContext, resharded: list[str]) -> str:
    streams = (f"its RNG streams and per-rank generators are old rank {context.rank}'s" if context.takes_over else
               "its RNG streams and per-rank generators were seeded afresh (no old rank of its number; "
               "docs: guides/elastic.md, the streams' rule)")
    return (f"rank {context.rank}: step {read.step} was written by {context.old_world_size} ranks and is loaded by "
            f"{context.world_size} (world_size_policy='elastic'): replicated and sharded state restored; the "
            f"interrupted epoch continues in its global order across {context.world_size} ranks; {streams}"
            + (f"; per-rank entries {resharded} remapped by their reshard= functions" if resharded else "")
            + ". The run continues, not bit for bit (another world size reduces in another order).")
