"""FSDP2 (fully_shard) workers for distckpt.testing.run_world: real gloo groups, CPU DTensors."""

from __future__ import annotations

import os
import signal

import torch
from torch import nn

import distckpt
from distckpt.runtime import faults


class Net(nn.Module):
    """Odd sizes on purpose: 2 and 4 ranks shard them unevenly (a rank may hold an empty piece)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 6)
        self.body = nn.Sequential(nn.Linear(6, 9), nn.GELU(), nn.Linear(9, 6))
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(self.emb(x)))).mean(1)


def build(seed: int, shard: bool = True) -> dict:
    torch.manual_seed(seed)
    model = Net()
    if shard:
        from torch.distributed.fsdp import fully_shard

        for layer in (model.body[0], model.body[2], model.head):
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optimizer": opt, "gen": torch.Generator().manual_seed(7)}


def train(state: dict, steps: int, first: int = 0) -> list[str]:
    """Deterministic batches (from the step number and this rank's generator); losses as hex."""
    model, opt = state["model"], state["optimizer"]
    losses = []
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randint(0, 13, (4, 5), generator=g)
        y = torch.randn(4, 3, generator=state["gen"])
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item().hex())
    return losses


def full_values(state: dict) -> dict[str, list]:
    """Every model and optimizer tensor, gathered whole (DTensor.full_tensor), by name."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(state["model"], state["optimizer"])
    out = {f"model.{k}": _whole(v) for k, v in msd.items()}
    for fqn, per_param in osd["state"].items():
        for k, v in per_param.items():
            out[f"opt.{fqn}.{k}"] = _whole(v)
    return out


def _whole(t: torch.Tensor) -> list:
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().reshape(-1).tolist()


def evaluate(state: dict) -> None:
    """A validation pass as loops run one: eval mode, no_grad forward, back to train. fully_shard
    leaves the root module's parameters unsharded after it (plain full tensors)."""
    model = state["model"]
    model.eval()
    with torch.no_grad():
        model(torch.randint(0, 13, (2, 5), generator=torch.Generator().manual_seed(5)))
    model.train()


def save_after_training(rank: int, world: int, url: str, steps: int = 3, async_save: bool = False,
                        options: dict | None = None, eval_pass: bool = False) -> dict:
    state = build(0)
    losses = train(state, steps)
    if eval_pass:
        evaluate(state)
    with distckpt.CheckpointManager(url, timeout=30, async_save=async_save, storage_options=options) as mgr:
        mgr.save(steps, state, epoch=0)
        values = full_values(state)
        if async_save:  # in-place updates right after save() returns must not reach the file
            with torch.no_grad():
                for p in state["model"].parameters():
                    p.add_(1.0)
            mgr.wait()
            return {"values": values}
        more = train(state, 3, steps)
    return {"values": values, "losses": losses, "more": more}


def load_and_report(rank: int, world: int, url: str, policy: str = "refuse", train_after: int = 0,
                    save_step: int | None = None, options: dict | None = None, eval_pass: bool = False) -> dict:
    import warnings

    state = build(123)  # other values, so a load that changes nothing is caught
    if eval_pass:
        evaluate(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distckpt.CheckpointManager(url, timeout=30, world_size_policy=policy, storage_options=options) as mgr:
            progress = mgr.load_latest(state)
            values = full_values(state)
            losses = train(state, train_after, progress.step) if train_after else []
            if save_step is not None:
                mgr.save(save_step, state, epoch=0)
            after = full_values(state)
    return {"step": progress.step, "rederived": progress.rederived, "values": values, "losses": losses, "after": after,
            "warnings": [str(w.message) for w in caught if "world_size_policy" in str(w.message)]}


def kill_after_shards(rank: int, world: int, url: str, victim: int) -> dict:
    """Commit step 1; then SIGKILL rank `victim` at step 2 once its shard file is durable."""
    state = build(0)
    with distckpt.CheckpointManager(url, timeout=8) as mgr:
        train(state, 1)
        mgr.save(1, state, epoch=0)

        def hook(name: str, context: dict) -> None:
            if name == "save/shards-written" and context.get("step") == 2 and rank == victim:
                os.kill(os.getpid(), signal.SIGKILL)

        faults.on_point(hook)
        train(state, 1, 1)
        try:
            mgr.save(2, state, epoch=0)
        except distckpt.DistCkptError as e:
            return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def save_stray_dtensor(rank: int, world: int, url: str) -> None:
    state = build(0)
    state["extra"] = next(state["model"].parameters()).detach()  # a DTensor on its own
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        mgr.save(1, state)


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))


def split_writes_with_own_buffers(rank: int, world: int, url: str) -> dict:
    """FSDP2 + BatchNorm, each rank its own batch (its own statistics), saved with split writes."""
    from torch.distributed.fsdp import fully_shard

    model = _bn_model()
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(100 + rank)
    loss = model(torch.randn(8, 4) * (1 + rank)).square().mean()
    loss.backward()
    opt.step()
    with distckpt.CheckpointManager(url, timeout=30, split_writes=True) as mgr:
        mgr.save(1, {"model": model, "optimizer": opt})
    return {k: model[1].get_buffer(k).tolist() for k in ("running_mean", "running_var")}


def a_partial_placement_is_refused_by_the_users_key_path(rank: int, world: int, url: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (world,))
    module = nn.Module()
    module.w = nn.Parameter(DTensor.from_local(torch.ones(4), mesh, [Partial()]))
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        try:
            mgr.save(0, {"model": module})
            return "saved"
        except distckpt.UnstorableValueError as e:
            return str(e)


def saves_before_the_first_step_change_nothing(rank: int, world: int, url: str) -> dict:
    """A save at the top of every step from step 0 (the optimizer has no state yet at the first)
    trains exactly as without saves, fires no optimizer step hook, and its step-0 checkpoint loads
    back into a fresh optimizer as no state; a load that fails later leaves a fresh optimizer
    without state. DCP's own initialisation took a zero step on the live optimizer each time."""
    import os

    fired: list[int] = []
    with_saves = build(0)
    with_saves["optimizer"].register_step_post_hook(lambda *_: fired.append(1))
    with distckpt.CheckpointManager(os.path.join(url, "a"), timeout=60, keep_last=10) as mgr:
        losses = []
        for step in range(3):
            mgr.save(step, with_saves)
            losses += train(with_saves, 1, step)
    plain = build(0)
    reference = train(plain, 3)
    fresh = build(0)
    with distckpt.CheckpointManager(os.path.join(url, "a"), timeout=60) as mgr:
        mgr.load(fresh, 0)
    state_after_load = len(fresh["optimizer"].state)
    resumed = train(fresh, 3)
    broken = build(0)
    broken["extra"] = torch.zeros(5)  # not in the checkpoint's shape: refused after the optimizer was resolved
    with distckpt.CheckpointManager(os.path.join(url, "b"), timeout=60) as mgr:
        mgr.save(0, {**build(0), "extra": torch.zeros(4)})
        try:
            mgr.load(broken, 0)
            refused = False
        except distckpt.IncompatibleCheckpointError:
            refused = True
    return {"same": losses == reference, "hooks_fired": len(fired), "state_after_load": state_after_load,
            "resumed_same": resumed == reference, "refused": refused,
            "state_after_failed_load": len(broken["optimizer"].state), "after_failed_same": train(broken, 3) == reference}


def a_layer_frozen_mid_run_stays_frozen(rank: int, world: int, url: str) -> list:
    state = build(0)
    train(state, 1)
    state["model"].head.requires_grad_(False)
    with distckpt.CheckpointManager(url, timeout=60) as mgr:
        mgr.save(1, state)
    fresh = build(0)
    with distckpt.CheckpointManager(url, timeout=60) as mgr:
        mgr.load_latest(fresh)
    return [name for name, p in fresh["model"].named_parameters() if not p.requires_grad]


def _tensor_parallel_net(seed: int, world: int, on_part_of_the_mesh: bool) -> nn.Module:
    """Net with its body tensor parallel (column- then row-wise) and a plain head: over every
    rank, or over the "tp" dimension of a (dp=world, tp=1) mesh, whose "dp" copies the DTensors
    do not know of."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = Net()
    if on_part_of_the_mesh:
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))["tp"]
    else:
        mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model.body, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def tensor_parallel_on_part_of_the_mesh(rank: int, world: int, url: str, diverge: bool = False) -> dict:
    """Every "dp" copy writes the same pieces: one is kept after checking they are equal (the save
    was refused as "overlapping pieces"); copies that differ are refused naming two ranks."""
    model = _tensor_parallel_net(0, world, on_part_of_the_mesh=True)
    if diverge and rank == 1:
        with torch.no_grad():
            model.body[0].weight.add_(1.0)
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        try:
            mgr.save(1, {"model": model})
        except distckpt.DistCkptError as e:
            return {"error": str(e)}
    saved = {k: _whole(v) for k, v in model.state_dict().items()}
    other = _tensor_parallel_net(5, world, on_part_of_the_mesh=True)
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        mgr.load_latest({"model": other})
    return {"saved": saved, "loaded": {k: _whole(v) for k, v in other.state_dict().items()}}


def partly_tensor_parallel_into_fully_sharded(rank: int, world: int, url: str) -> dict:
    """A checkpoint of a model whose head is a plain parameter beside tensor-parallel ones, loaded
    into the same model under fully_shard: it failed inside torch's copy_ (a plain tensor into a
    DTensor), after every check had passed."""
    model = _tensor_parallel_net(0, world, on_part_of_the_mesh=False)
    source = {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2),
              "gen": torch.Generator().manual_seed(7)}
    for p in model.parameters():  # a step, for the optimizer's moments (no forward needed)
        p.grad = torch.ones_like(p)
    source["optimizer"].step()
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        mgr.save(1, source)
    target = build(9)
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        mgr.load_latest(target)
    return {"expected": full_values(source), "loaded": full_values(target)}


class _Refusing:
    """A user's object whose load_state_dict refuses on one rank."""

    def __init__(self, refuse: bool) -> None:
        self.refuse, self.value = refuse, 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, sd: dict) -> None:
        if self.refuse:
            raise ValueError("refused by the user's object")
        self.value = sd["value"]


def a_failed_load_leaves_the_sharded_model_as_it_was(rank: int, world: int, url: str) -> dict:
    """FSDP2's own load hooks no longer make the module count as one with load logic of its own
    (which copied the whole model aside for the undo): restored after every other entry, it is
    untouched when another entry's load fails on one rank."""
    state = build(0)
    train(state, 2)
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        mgr.save(2, {**state, "thing": _Refusing(False)})
    state = build(123)
    train(state, 1)
    before = full_values(state)
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        try:
            mgr.load_latest({**state, "thing": _Refusing(rank == 1)})
        except distckpt.DistCkptError as e:
            error = str(e)
        else:
            error = ""
    return {"error": error, "unchanged": full_values(state) == before}


def a_tensor_parallel_model_whose_plain_head_differs(rank: int, world: int, url: str, differ: bool) -> str:
    """The module comparison sampled a bare model's parameters only: a partly tensor-parallel
    model whose plain head each rank changed on its own saved rank 0's head, resumed everywhere."""
    model = _tensor_parallel_net(0, world, on_part_of_the_mesh=False)
    if differ:
        with torch.no_grad():
            model.head.weight.add_(float(rank))
    with distckpt.CheckpointManager(url, timeout=30) as mgr:
        try:
            mgr.save(1, {"model": model})
        except distckpt.DistCkptError as e:
            return str(e)
    return "saved"
