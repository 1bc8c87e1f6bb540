"""The save and load protocols, as short functions of named phases: the save in saving.py,
the load in loading.py, what "committed" means in commit.py. This module names them together.

Save(step)
    capture   every rank: RNG first, then its per-rank entries; rank 0 also the replicated ones
    agree     all ranks: everyone captured, and all hold the same step and epoch
    own files every rank: its rank file and (sharded entries, split writes) its shard file,
              durable, then one report (names, sizes, checksums, chunk boxes, or its failure)
              through the store — no collective, so it runs in the background writer too
    write     rank 0: the replicated file; every rank's report; the manifest
    commit    rank 0: COMMITTED, exclusive create, last
    share     rank 0's outcome to every rank, so a failed save fails everywhere

Load
    choose    rank 0 lists committed steps, newest first, and broadcasts the list
    read      every rank: marker, manifest, replicated file and its own rank file, verified by
              checksum and checked against `state` before anything is changed; a damaged
              candidate makes all ranks move to the previous one together, with a warning
    agree     all ranks hold the same (step, epoch, manifest digest), or all raise
    apply     every rank restores its entries, RNG last; outcomes exchanged once more

Every phase ends in `coord.agree`, so every rank takes the same branch.
"""
