"""Import timm and transformers where torchvision's compiled operators cannot load (torchvision's wheels on PyPI are
built against torch's CUDA build, and this environment runs torch's CPU build): torchvision
registers fake implementations of `nms` and `qnms` at import without checking that its operators
loaded, which fails the import. Defining those two schemas first lets torchvision and timm
import; nothing in timm's classification path or the Trainer calls them. Import this module before either."""

from __future__ import annotations

import importlib.util


def _define_missing_torchvision_ops() -> None:
    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        return
    import torch

    try:
        torch.ops.torchvision.nms  # noqa: B018  (loaded: nothing to do)
        return
    except (AttributeError, RuntimeError):
        pass
    try:
        import glob
        import os

        library = glob.glob(os.path.join(os.path.dirname(spec.origin or ""), "_C*.so"))
        if library:
            torch.ops.load_library(library[0])
            return
    except (OSError, RuntimeError):
        pass  # built against another torch: define the two schemas torchvision's import needs
    definitions = torch.library.Library("torchvision", "DEF")  # kept for the process's life
    definitions.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    definitions.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _KEPT.append(definitions)


_KEPT: list = []
_define_missing_torchvision_ops()
