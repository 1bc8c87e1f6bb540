"""A Hugging Face Trainer checkpointed through distckpt.integrations.hf_trainer, run under torchrun
(tests/frameworks/test_hf_trainer.py):

    torchrun --nproc-per-node N tests/helpers/hf_trainer_loop.py --ckpt DIR --loss-log DIR [--steps N]
        [--workers W] [--accum M] [--async] [--every K] [--kill-at S1,S2] [--kill-rank R]
        [--eval-every N] [--persistent]

A small model whose forward draws dropout, a dataset drawing augmentation (in the loader workers if
any), the Trainer's own loader (prepared by Accelerate over a StatefulDataLoader), its AdamW and
linear schedule with warm-up, gradient accumulation, the loss logged at every step.

Each rank appends `step loss weights` (floats as hex) to LOSS_LOG/rank-R.txt after every
optimizer step; --kill-at SIGKILLs rank --kill-rank when that optimizer step begins in the first
incarnation (the second value in the second).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import cpu_torchvision  # noqa: F401  (before transformers: torchvision's operators on a CPU build of torch)
import torch
from torch.utils.data import Dataset

import distckpt


class Noisy(Dataset):
    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.full((4,), float(i)) / 48 + 0.1 * torch.randn(4)
        return {"x": x, "labels": x.sum(0, keepdim=True)}


class Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.net(x)
        loss = torch.nn.functional.mse_loss(out, labels) if labels is not None else None
        return {"loss": loss, "logits": out}


EVALUATIONS = 100_000  # an evaluation's line: this plus the optimizer step it followed


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--loss-log", dest="log", required=True)
    p.add_argument("--steps", type=int, default=15, help="optimizer steps in all")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--kill-at", default="")
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N optimizer steps (0: never)")
    p.add_argument("--persistent", action="store_true", help="dataloader_persistent_workers=True")
    return p.parse_args()


def main() -> int:
    args = parse()
    from transformers import TrainerCallback, TrainingArguments

    from distckpt.integrations import hf_trainer

    info = distckpt.init_distributed()  # before TrainingArguments: Accelerate then uses this group
    kills = [int(s) for s in args.kill_at.split(",") if s]
    incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    class Log(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, targs, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if incarnation < len(kills) and state.global_step == kills[incarnation] and info.rank == args.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_log(self, targs, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
            if logs and "eval_loss" in logs:  # compared too: an evaluation after a resume is the uninterrupted run's
                _log(args.log, info.rank, f"{EVALUATIONS + state.global_step} {float(logs['eval_loss']).hex()}")
            if logs and "loss" in logs:
                model = kwargs["model"]
                weights = sum(p.double().sum() for p in model.parameters()).item()
                _log(args.log, info.rank, f"{state.global_step - 1} {float(logs['loss']).hex()} {weights.hex()}")

    training = TrainingArguments(
        output_dir=os.path.join(args.ckpt, "trainer-output"), use_cpu=True, max_steps=args.steps,
        per_device_train_batch_size=4, gradient_accumulation_steps=args.accum, learning_rate=1e-2,
        warmup_steps=3, logging_steps=1, save_strategy="no", report_to=[], seed=7,
        dataloader_num_workers=args.workers, disable_tqdm=True,
        dataloader_persistent_workers=args.persistent and args.workers > 0,
        eval_strategy="steps" if args.eval_every else "no", eval_steps=args.eval_every or None)
    dataset = distckpt.with_worker_rng(Noisy()) if args.workers else Noisy()
    torch.manual_seed(0)  # the model's initial weights
    trainer = hf_trainer.make_trainer(
        model=Regressor(), args=training, train_dataset=dataset, callbacks=[Log()],
        eval_dataset=(distckpt.with_worker_rng(Noisy()) if args.workers else Noisy()) if args.eval_every else None,
        checkpoints=distckpt.CheckpointManager(args.ckpt, async_save=args.async_save, timeout=60),
        save_every=args.every)
    if trainer.checkpoints.committed_steps():
        _log(args.log, info.rank, f"# resumed from step {trainer.checkpoints.committed_steps()[0]}")
    trainer.train()
    trainer.checkpoints.close()
    return 0


def _log(log_dir: str, rank: int, line: str) -> None:
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, f"rank-{rank}.txt"), "a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
