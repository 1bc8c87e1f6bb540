"""A Mersenne Twister state whose position lies outside its 624 words, in a checkpoint (re-signed, as
a writer to the bucket can): NumPy takes it without a check and its next draw reads outside the
state array — numbers from elsewhere in memory, or a segfault — after a load that said nothing. Now
the step is damaged: the load falls back to the older step, which restores exactly. Every NumPy
Mersenne Twister a checkpoint holds: the process-wide stream, a RandomState, a Generator over
MT19937. Each load runs in a process of its own (a segfault must fail the test, not end the run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers"))
from forger import rewrite_trees  # noqa: E402

STATE = """
import numpy as np, torch, distckpt
def state():
    return {"w": torch.zeros(2), "rs": np.random.RandomState(1), "mt": np.random.Generator(np.random.MT19937(2))}
"""

SAVE = STATE + """
with distckpt.CheckpointManager(ROOT) as mgr:
    s = state()
    for step in (1, 2):
        np.random.seed(step); s["rs"].seed(10 + step); s["mt"] = np.random.Generator(np.random.MT19937(20 + step))
        mgr.save(step, s)
"""

LOAD = STATE + """
import warnings
s = state()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with distckpt.CheckpointManager(ROOT) as mgr:
        progress = mgr.load_latest(s)
said = " ".join(str(w.message) for w in caught)
print(json.dumps({"step": progress.step, "said": said, "draws": [float(np.random.rand()), float(s["rs"].rand()),
                                                                 float(s["mt"].random())]}))
"""


def _run(code: str, root: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", f"import json\nROOT = {root!r}\n{code}"], capture_output=True,
                          text=True, timeout=120)


def _set_every_position(root: str, step: int, pos: int) -> int:
    """Every `["pos", N]` in the step's payload trees set to `pos`, the files and manifest re-signed."""
    return rewrite_trees(root, step, r'\["pos", ?-?\d+\]', f'["pos", {pos}]')


@pytest.mark.parametrize("pos", [625, 2**30, -1])
def test_an_out_of_range_mersenne_twister_position_is_damage_and_the_older_step_loads(tmp_path, pos):
    root = str(tmp_path / "ckpt")
    saved = _run(SAVE, root)
    assert saved.returncode == 0, saved.stderr[-2000:]
    assert _set_every_position(root, 2, pos) == 3  # the process-wide stream, the RandomState, the Generator
    got = _run(LOAD, root)
    assert got.returncode == 0, f"exit {got.returncode}: {got.stderr[-2000:]}"
    result = json.loads(got.stdout.strip().splitlines()[-1])
    assert result["step"] == 1 and "Mersenne Twister position" in result["said"], result
    # what step 1 holds, drawn as a resume from it draws
    np.random.seed(1)
    assert result["draws"][0] == float(np.random.rand())
