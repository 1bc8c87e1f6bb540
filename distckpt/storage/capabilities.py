"""What a backend can do, declared by each (the contract suite checks the claims it can observe).

The protocol's rules do not depend on them — every backend commits by an exclusive create of
the marker — but what it says and where it looks does: a backend without a real exclusive create
is warned about at construction, a directory that outlives its files is looked for only where
one can (retention).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    exclusive_create: bool  # create_exclusive is atomic against another writer (else check-then-write)
    streamed_writes: bool  # write_file sends its chunks as they come (never the whole file in memory)
    renames_into_place: bool  # files reach their name by rename (else the store's whole-object put)
    ranged_reads: bool  # read_buffer downloads a large file in ranged requests into a local file
    keeps_empty_directories: bool  # a directory exists without files (a listing of files misses it)


LOCAL_DISK = Capabilities(exclusive_create=True, streamed_writes=True, renames_into_place=True,
                          ranged_reads=False, keeps_empty_directories=True)
