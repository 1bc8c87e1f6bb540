"""distckpt.integrations.timm.create_loader's loader in `state`, used as the frameworks guide shows: the
saves say nothing (its PrefetchLoader keeps the StatefulDataLoader as `.loader`, whose pass was taken
for one left out of `state`: every documented timm loop was warned at its first saves)."""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers"))
import cpu_torchvision  # noqa: E402,F401  (before timm: torchvision's operators on a CPU build of torch)

import distckpt  # noqa: E402


class Pictures(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.transform = None  # set by timm's create_loader

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        from PIL import Image

        picture = Image.fromarray(np.full((40, 40, 3), i, dtype=np.uint8))
        return (self.transform(picture) if self.transform else picture), i % 4


@pytest.mark.parametrize("workers", [0, 2])
def test_a_create_loader_loader_in_state_is_not_warned_about(tmp_path, workers):
    pytest.importorskip("timm")
    from distckpt.integrations import timm as dct

    loader = dct.create_loader(Pictures(), input_size=(3, 32, 32), batch_size=4, is_training=True,
                               use_prefetcher=True, num_workers=workers, device=torch.device("cpu"),
                               persistent_workers=workers > 0)
    state = {"loader": loader, "model": torch.nn.Linear(3, 1)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distckpt.CheckpointManager(str(tmp_path / "ckpt")) as mgr:
            mgr.load_latest(state)
            for step, _batch in enumerate(loader):
                if step in (2, 3):  # the first saves are where a loader left out of `state` is told
                    mgr.save(step, state)
    said = [str(w.message) for w in caught if issubclass(w.category, distckpt.CheckpointWarning)]
    assert said == [], said
