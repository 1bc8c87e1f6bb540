"""The job every node of bench/cluster.py runs under torchrun: save and load per write path.

    torchrun ... bench/cluster_job.py CONFIG.json

CONFIG holds the S3 URL root and storage options, the state's size, the paths to run, the
repeats, the handshake folder and where rank 0 writes its results. Paths:

* ``rank0``: a replicated (DDP-like) state, saved with ``split_writes=False``;
* ``split``: the same state with ``split_writes=True``;
* ``sharded``: an FSDP2 model (``fully_shard``) of the same size in all, 1/ranks per rank.

Each save and each load is one phase, bracketed by a handshake with the harness (rank 0 writes
``NAME.req`` in the handshake folder and waits for ``NAME.ack``) so that the harness reads the
shaped links' byte counters exactly before and after it. A load is a fresh manager's
construction plus ``load_latest`` into zeroed tensors, checked bit for bit against what was
saved. Times are the slowest rank's (each rank's is kept too). Whatever distckpt is first on ``sys.path`` runs: the
branch's, or a baseline's through PYTHONPATH.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

import distckpt


def _replicated(mib: float) -> dict[str, torch.Tensor]:
    n = 8
    per = max(1, int(mib * 2**20) // 4 // n)
    g = torch.Generator().manual_seed(0)  # every rank holds the same values, as DDP guarantees
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n)}


def _sharded(mib: float, world: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    width, layers = 1024, 8
    rows = max(world, int(mib * 2**20) // 4 // width // layers)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, rows, bias=False) for _ in range(layers)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class Job:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.phases: list[dict[str, Any]] = []

    def mark(self, name: str) -> None:
        """Every rank waits while the harness reads the counters (outside every timing)."""
        dist.barrier()
        if self.rank == 0:
            folder = self.config["handshake"]
            with open(os.path.join(folder, f"{name}.req"), "w") as f:
                f.write(str(time.time()))
            ack, deadline = os.path.join(folder, f"{name}.ack"), time.monotonic() + 120
            while not os.path.exists(ack):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the harness did not acknowledge {name} within 120 s")
                time.sleep(0.01)
        dist.barrier()

    def phase(self, name: str, fn: Callable[[], None]) -> None:
        self.mark(f"{name}.start")
        t0 = time.perf_counter()
        fn()
        mine = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine)
        self.mark(f"{name}.end")
        per_rank = [t.item() for t in every]
        self.phases.append({"phase": name, "seconds": max(per_rank), "per_rank": per_rank})

    def manager(self, path: str) -> distckpt.CheckpointManager:
        options: dict[str, Any] = {"split_writes": path == "split"}
        return distckpt.CheckpointManager(f"{self.config['url']}/{path}", timeout=300,
                                          storage_options=self.config["storage_options"], **options)

    def hosts(self) -> list[str]:
        """Every rank's host name (one per node: the harness gives each node its own)."""
        every: list[object] = [None] * self.world
        dist.all_gather_object(every, socket.gethostname())
        return [str(h) for h in every]

    def warm_up(self) -> None:
        """One tiny save and load, untimed: the first S3 request of a process pays for its
        connections and lazy imports, which no path's row should carry."""
        mgr = self.manager("warm-up")
        mgr.save(0, {"x": torch.zeros(4)})
        mgr.close()
        fresh = self.manager("warm-up")
        fresh.load_latest({"x": torch.zeros(4)})
        fresh.close()

    def run_path(self, path: str) -> None:
        mib, repeats = self.config["mib"], self.config["repeats"]
        if path == "sharded":
            model = _sharded(mib, self.world)
            state: dict[str, Any] = {"model": model}
            tensors: list[torch.Tensor] = list(model.parameters())
            saved = [_local(p).detach().clone() for p in tensors]
        else:
            state = _replicated(mib)
            tensors = list(state.values())
            saved = [t.clone() for t in tensors]
        mgr = self.manager(path)
        for r in range(repeats):
            self.phase(f"{path}.save.{r}", functools.partial(mgr.save, r + 1, state))
        mgr.close()
        for r in range(repeats):
            with torch.no_grad():
                for t in tensors:
                    _local(t).zero_()

            def load() -> None:
                fresh = self.manager(path)
                progress = fresh.load_latest(state)
                fresh.close()
                if progress is None or progress.step != repeats:
                    raise RuntimeError(f"{path}: load_latest found {progress}, expected step {repeats}")

            self.phase(f"{path}.load.{r}", load)
            if not all(torch.equal(_local(t), s) for t, s in zip(tensors, saved)):
                raise RuntimeError(f"{path}: the loaded state differs from the saved one (rank {self.rank})")


def main(config_path: str) -> int:
    with open(config_path) as f:
        config = json.load(f)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")  # the node's log
    distckpt.init_distributed(timeout=300)
    job = Job(config)
    job.warm_up()
    for path in config["paths"]:
        job.run_path(path)
    hosts = job.hosts()
    if job.rank == 0:
        with open(config["out"], "w") as f:
            json.dump({"distckpt": os.path.dirname(distckpt.__file__), "world": job.world, "hosts": hosts,
                       "phases": job.phases}, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
