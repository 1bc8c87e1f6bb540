"""Pre-emption: a real SIGTERM to the torchrun agent; every rank saves at the next step
boundary within the grace period and exits; the relaunched job resumes bit for bit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from demo import HERE, compare, read_losses, resumed_from, torchrun

import distckpt

pytestmark = pytest.mark.slow


def max_step(log_dir: str) -> int:
    steps = [-1]
    for name in os.listdir(log_dir) if os.path.isdir(log_dir) else []:
        for line in open(os.path.join(log_dir, name)):
            if line[:1].isdigit():
                steps.append(int(line.split()[0]))
    return max(steps)


@pytest.mark.parametrize("workers", [pytest.param(0, marks=pytest.mark.faults), 2])  # make test: with workers
def test_sigterm_saves_at_the_next_step_and_the_relaunch_is_bitwise(tmp_path, workers):
    """With loader workers, torchrun's SIGTERM to the rank's process group killed the workers
    and the rank's next batch raised before the step boundary (3 of 4 runs): no pre-emption save."""
    common = ["--steps", "50", "--ckpt-every", "20", "--workers", str(workers)]
    ref = torchrun(2, ["--ckpt", str(tmp_path / "ref"), "--loss-log", str(tmp_path / "log-ref"), *common])
    assert ref.returncode == 0, ref.stderr[-3000:]

    ckpt, logs = str(tmp_path / "ckpt"), str(tmp_path / "log")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(HERE)}
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
                              os.path.join(HERE, "train.py"), "--ckpt", ckpt, "--loss-log", logs, *common],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while max_step(logs) < 25 and time.monotonic() < deadline and agent.poll() is None:
        time.sleep(0.05)
    assert agent.poll() is None, agent.stdout.read()[-3000:]
    sent = time.monotonic()
    agent.send_signal(signal.SIGTERM)  # what a spot notice or Kubernetes delivers
    out, _ = agent.communicate(timeout=60)
    elapsed = time.monotonic() - sent
    preempted = [line for line in open(os.path.join(logs, "rank-0.txt")) if line.startswith("# pre-empted")]
    assert preempted, out[-3000:]
    step = int(preempted[0].split()[-1])
    assert 25 <= step < 40 and step % 20 != 0
    with distckpt.CheckpointManager(ckpt) as mgr:
        assert mgr.committed_steps()[0] == step
    assert elapsed < 30  # inside torchrun's and Kubernetes' 30 s grace

    again = torchrun(2, ["--ckpt", ckpt, "--loss-log", logs, *common])
    assert again.returncode == 0, again.stderr[-3000:]
    assert resumed_from(logs) == [f"resumed from step {step} epoch {0 if step < 33 else 1}"]
    result = compare(read_losses(str(tmp_path / "log-ref")), read_losses(logs))
    assert result.identical, result.table
