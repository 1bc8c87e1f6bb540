"""Process-group start-up that survives torchrun restarts, on one node or many.

With ``torchrun --max-restarts``, the plain ``init_process_group("gloo")`` of a restarted
worker reads the dead attempt's gloo addresses from the agent's store (torch keys workers under
one fixed prefix), and fails about half the time with "Gloo connectFullMesh failed ...
Connection refused". Keying by ``TORCHELASTIC_RESTART_COUNT`` fixed it on one node (8 of 8), but
agents on different nodes count restarts separately (a replaced node starts again at 0), so
here every attempt gets a store of its own instead: rank 0 hosts a fresh TCPStore and
publishes its address in the agent's store; the other ranks connect to it, and a published
address that refuses connections is a dead attempt's, so they wait for the new one.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from distckpt.config import arguments_checked, seconds
from distckpt.errors import ConfigError, shown
from distckpt.runtime.iterators import track_iterators

log = logging.getLogger("distckpt")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    restart_count: int


_BACKENDS = [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]


@arguments_checked
def init_distributed(backend: str | None = None, timeout: float | timedelta = 600.0) -> DistInfo:
    """Start the default process group from torchrun's environment (every rank calls it).

    The backend is NCCL when CUDA is available (each rank on cuda:LOCAL_RANK), else gloo.
    Without torchrun's variables it starts nothing and describes a world of one.
    """
    timeout = seconds("timeout", timeout)
    if backend is not None and (not isinstance(backend, str) or backend.lower() not in _BACKENDS):
        raise ConfigError(f"backend={shown(backend)}: must be None (NCCL on GPUs, else gloo) or one of "
                          f"{sorted(_BACKENDS)}")
    track_iterators()  # before the loop builds its loaders: the saves' loader checks see every iterator
    env = os.environ
    try:
        local_rank = int(env.get("LOCAL_RANK", "0"))
        restarts = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError as e:
        raise ConfigError(f"torchrun environment is malformed (LOCAL_RANK / TORCHELASTIC_RESTART_COUNT: {e}); "
                          "launch with torchrun") from e
    device = _device_for(local_rank)
    if dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device,
                        dist.get_backend(), restarts)
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return DistInfo(0, 1, 0, device, None, restarts)
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError) as e:
        raise ConfigError(f"torchrun environment is incomplete or malformed ({e}); launch with torchrun") from e
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    wait = timedelta(seconds=timeout)
    if agent_store:
        store = _attempt_store(dist.TCPStore(addr, port, world_size=world, is_master=False, timeout=wait),
                               addr, port, rank, world, timeout)
    else:  # launched without an elastic agent: rank 0 hosts a store that lives as long as the job
        store = dist.TCPStore(addr, port, world_size=world, is_master=(rank == 0), timeout=wait,
                              wait_for_workers=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=wait)
    log.info("rank %d/%d: process group up (backend %s, attempt %d, device %s)",
             rank, world, backend, restarts, device)
    return DistInfo(rank, world, local_rank, device, backend, restarts)


_PUBLISHED = "/worker/distckpt/attempt-store"


def _attempt_store(agent: dist.Store, addr: str, port: int, rank: int, world: int, timeout: float) -> dist.Store:
    """A TCPStore that only this attempt's workers use (see the module docstring)."""
    if rank == 0:
        own = dist.TCPStore(_reachable_address(addr, port), 0, world_size=world, is_master=True,
                            timeout=timedelta(seconds=timeout), wait_for_workers=False)
        agent.set(_PUBLISHED, f"{_reachable_address(addr, port)}:{own.port}:{uuid.uuid4().hex}")
        return own
    deadline = time.monotonic() + timeout
    refused = None
    while time.monotonic() < deadline:
        published = agent.get(_PUBLISHED).decode()
        if published == refused:
            time.sleep(0.2)  # a dead attempt's address: wait for this attempt's rank 0
            continue
        host, store_port, _ = published.rsplit(":", 2)
        if not _accepts_connections(host, int(store_port)):
            refused = published  # a dead attempt's store: refused at once (TCPStore would retry for 5 s, loudly)
            continue
        try:
            store = dist.TCPStore(host, int(store_port), world_size=world, is_master=False,
                                  timeout=timedelta(seconds=5))
        except (RuntimeError, TimeoutError, OSError) as e:
            log.debug("rank %d: %s refused (%s): an earlier attempt's store", rank, published, e)
            refused = published
            continue
        store.set_timeout(timedelta(seconds=timeout))
        return store
    raise ConfigError(f"rank {rank}: rank 0 of this attempt published no reachable store within {timeout:g}s")


def _accepts_connections(host: str, port: int) -> bool:
    """Whether something listens at (host, port): a closed port is refused within milliseconds."""
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False


def _reachable_address(peer_host: str, peer_port: int) -> str:
    """The local address other nodes reach us by: the one our route to the agent store uses."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(peer_host), peer_port))  # no packet is sent
        return s.getsockname()[0]


def _device_for(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


@arguments_checked
def shutdown_distributed() -> None:
    """Tear the default process group down cleanly (every rank calls it).

    Drop your references to DDP wrappers first (``del ddp_model``): with a DDP reducer alive at
    ``destroy_process_group``, about one exit in 6–10 aborted with "terminate called without an
    active exception". This collects garbage so released wrappers are really gone.

    Then it waits a moment with the GIL released (about 0.1 s, once per job): each collective's
    work object is let go by one of gloo's threads just after the call returns, and the last one
    can hold a tensor made in Python (FSDP2's gathers, ``DTensor.full_tensor``); let go while the
    interpreter finalizes, that release aborts the process the same way (rank 1 of one 2-rank
    FSDP2 job in 8 that gathered its weights just before exiting). Destroying the group does not
    join those threads while FSDP2's modules still hold it; the pause lets them finish first.
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(_RELEASE_PAUSE_S)


_RELEASE_PAUSE_S = 0.1
