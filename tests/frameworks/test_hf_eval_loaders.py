"""The Trainer's loaders under distckpt's Trainer with dataloader_persistent_workers=True: each
evaluation's built anew, and none with persistent workers (the end-to-end case, killed and resumed bit
for bit with evaluations, is tests/frameworks/test_hf_trainer.py[persistent-workers-evaluations], in
make test-faults)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers"))
import cpu_torchvision  # noqa: E402,F401  (before transformers: torchvision's operators on a CPU build of torch)

import distckpt  # noqa: E402


class Pairs(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((2,), float(i)), "labels": torch.zeros(1)}


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(2, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        out = self.w(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def test_each_evaluation_gets_a_loader_of_its_own_and_no_loader_keeps_its_workers(tmp_path):
    persistent = True
    transformers = pytest.importorskip("transformers")
    from distckpt.integrations import hf_trainer

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=2, report_to=[], save_strategy="no",
        dataloader_num_workers=1, dataloader_persistent_workers=persistent, eval_strategy="steps", eval_steps=1)
    with distckpt.CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        trainer = hf_trainer.make_trainer(model=Tiny(), args=args, train_dataset=Pairs(), eval_dataset=Pairs(),
                                          checkpoints=mgr, save_every=1)
        first, second = trainer.get_eval_dataloader(), trainer.get_eval_dataloader()
        assert first is not second  # transformers.Trainer returns its kept one the second time
        for loader in (first, second):
            assert getattr(loader, "persistent_workers", getattr(loader.base_dataloader, "persistent_workers", None)) is False
        assert trainer.args.dataloader_persistent_workers is persistent  # the setting itself is left as given
        # the training loader's workers start at each pass too: kept, they carried their streams into
        # an epoch that a process resumed at the previous epoch's end started anew
        assert trainer.get_train_dataloader().base_dataloader.persistent_workers is False
