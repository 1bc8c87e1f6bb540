"""A model and its AdamW state saved and loaded each in a new process: time and peak extra memory.

    python bench/model_state.py [--shapes 64x200,64x2000,16x20000] [--repeats 3]

`MiB x parameters`: a module of that many float32 parameters of equal size holding MiB of
weights, trained one AdamW step (so the optimizer holds two moments and a step per parameter:
the state is about 3x MiB and 3x the parameters + 1 tensors). What users compare against:

* torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}) + fsync + rename /
  torch.load + model.load_state_dict + opt.load_state_dict;
* dcp.save / dcp.load of torch.distributed.checkpoint.state_dict's get_state_dict, then
  set_state_dict (the documented pair for a model and its optimizer);
* distckpt: manager + save of {"model", "optimizer"} + close / manager + load_latest + close.

Each load starts as a resume does: a model built from another seed and an optimizer that has not
stepped (no state yet), and is checked to restore the saved values exactly. Peak extra memory
therefore includes the optimizer state the load brings into being (2x the weights for AdamW).
Operations run interleaved, one of each per round; each row is the median of --repeats. Peak
extra memory is measured as in bench/fresh.py (bench/process_cost.py).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile

from process_cost import run_child

CHILD = r"""
import os, shutil, sys
import torch
from torch import nn
from process_cost import fsync_dir, measure, report

op, root, mib, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
numel = mib * 2**18 // count


def built(seed, trained=True):
    torch.manual_seed(seed)
    model = nn.ParameterList([nn.Parameter(torch.randn(numel)) for _ in range(count)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if trained:
        for p in model:
            p.grad = torch.randn(numel)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def torch_save(model, opt):
    path = os.path.join(root, "state.pt")
    with open(path + ".tmp", "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    fsync_dir(root)


def torch_load(model, opt):
    loaded = torch.load(os.path.join(root, "state.pt"), weights_only=True)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])


def dcp_save(model, opt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, opt_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optimizer": opt_sd}, checkpoint_id=os.path.join(root, "dcp"))


def dcp_load(model, opt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, opt_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optimizer": opt_sd}
    dcp.load(state, checkpoint_id=os.path.join(root, "dcp"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def distckpt_save(model, opt):
    import distckpt
    with distckpt.CheckpointManager(os.path.join(root, "distckpt")) as mgr:
        mgr.save(1, {"model": model, "optimizer": opt})


def distckpt_load(model, opt):
    import distckpt
    with distckpt.CheckpointManager(os.path.join(root, "distckpt")) as mgr:
        assert mgr.load_latest({"model": model, "optimizer": opt}).step == 1


OPS = {"torch.save + fsync + rename": torch_save, "torch.load + load_state_dict": torch_load,
       "dcp.save (get_state_dict)": dcp_save, "dcp.load + set_state_dict": dcp_load,
       "distckpt save": distckpt_save, "distckpt load": distckpt_load}
OUTPUTS = {"torch.save + fsync + rename": "state.pt", "dcp.save (get_state_dict)": "dcp", "distckpt save": "distckpt"}
fn = OPS[op]
loading = op not in OUTPUTS
model, opt = built(1, trained=False) if loading else built(0)  # a resume: an optimizer not stepped yet
import distckpt  # noqa: F401  (imports are not the operation's cost)
import torch.distributed.checkpoint  # noqa: F401
if op in OUTPUTS:  # every save writes into an empty place
    path = os.path.join(root, OUTPUTS[op])
    shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.path.exists(path) and os.remove(path)
    os.sync()
_, measured = measure(lambda: fn(model, opt))
if loading:  # the saved values, exactly
    saved_model, saved_opt = built(0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), saved_model.parameters())), "weights differ"
    for p, q in zip(model.parameters(), saved_model.parameters()):
        for k, v in saved_opt.state[q].items():
            assert torch.equal(opt.state[p][k], v), f"optimizer {k} differs"
report(measured)
"""

SAVES = ["torch.save + fsync + rename", "dcp.save (get_state_dict)", "distckpt save"]
LOADS = ["torch.load + load_state_dict", "dcp.load + set_state_dict", "distckpt load"]


def run(op: str, root: str, mib: int, count: int) -> dict[str, float]:
    return run_child(CHILD, [op, root, str(mib), str(count)])


def table(shapes: list[tuple[int, int]], repeats: int, echo: bool = False) -> str:
    """The rows for every shape; with `echo`, each row is printed as soon as measured."""
    lines = ["| model (weights) | operation | median s | vs torch | peak extra memory, MiB |",
             "|---|---|---:|---:|---:|"]
    if echo:
        print("\n".join(lines), flush=True)
    for mib, count in shapes:
        root = tempfile.mkdtemp(prefix="distckpt-model-")
        try:
            for op in SAVES:  # the files the loads read
                run(op, root, mib, count)
            samples: dict[str, list[dict[str, float]]] = {}
            for _ in range(repeats):
                for op in SAVES + LOADS:
                    samples.setdefault(op, []).append(run(op, root, mib, count))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        median = {op: statistics.median(s["seconds"] for s in v) for op, v in samples.items()}
        extra = {op: statistics.median(s["extra_mib"] for s in v) for op, v in samples.items()}
        for op in SAVES + LOADS:
            base = SAVES[0] if op in SAVES else LOADS[0]
            lines.append(f"| {mib} MiB, {count:,} parameters + AdamW | {op} | {median[op]:.3f} | "
                         f"{median[base] / median[op]:.2f}x | {extra[op]:.0f} |")
            if echo:
                print(lines[-1], flush=True)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="64x200,64x2000,16x20000")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    table([tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")], args.repeats, echo=True)  # type: ignore[misc]
    return 0


if __name__ == "__main__":
    sys.exit(main())
