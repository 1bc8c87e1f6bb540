"""Whether a manager built without ``split_writes=`` spreads its replicated tensors over the ranks.

Split writes win where one process cannot fill what the nodes can send: on a simulated cluster
whose nodes each reach an object store through a link of their own (docs/benchmarks/cluster.md),
a split-writes save of a replicated state took 0.54x rank 0 alone's time at 2 nodes and 0.30x
at 4. On one node every rank shares the node's one link, and on one local disk every
path costs the same (docs/design/scaling.md): there split writes buy nothing and spread a
replicated state over as many files as ranks. So ``split_writes=None`` (the default) is on where
the root is remote storage (a URL with a scheme other than ``file://``) and the job spans several
nodes, unless something rules split writes out (``incremental=True``, a local tier), and off
otherwise. ``True`` and ``False`` are kept as given.

Every rank decides alike without an exchange: torchrun's LOCAL_WORLD_SIZE is below WORLD_SIZE on
every rank of a job of several nodes and on no rank of a job of one; the decision is then one of
the settings every rank's manager must share, compared when it is built (settings.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from distckpt.config import ManagerConfig
from distckpt.storage import scheme_of
from distckpt.storage.registry import LOCAL_PATH


def resolve_split_writes(config: ManagerConfig, url: str, local_dir: str | None,
                         env: Mapping[str, str] | None = None) -> ManagerConfig:
    """`config` with split_writes True or False: as given, or decided for `url` (normalized)."""
    if config.split_writes is not None:
        return config
    on = (scheme_of(url) != LOCAL_PATH and spans_several_nodes(os.environ if env is None else env)
          and not config.incremental and local_dir is None)
    return dataclasses.replace(config, split_writes=on)


def spans_several_nodes(env: Mapping[str, str]) -> bool:
    """Whether torchrun started this job on several nodes (its LOCAL_WORLD_SIZE below WORLD_SIZE);
    False outside torchrun or with malformed values (the default then stays as on one node)."""
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        local = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    except ValueError:
        return False
    return 1 <= local < world
