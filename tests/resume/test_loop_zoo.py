"""The loop zoo: loops written the way users write them (tests/helpers/zoo_loop.py), each killed with
SIGKILL under a real torchrun and resumed, compared with an uninterrupted run bit for bit
(every rank's loss and parameter sum after every step).

`make test` runs the cases marked below, one per counterexample found by trying loops from
outside; `make test-faults` runs the whole matrix."""

from __future__ import annotations

import pytest
from zoo import run_zoo_pair

pytestmark = pytest.mark.slow

faults = pytest.mark.faults

# (ranks, loop options, kill steps): saves every 5 steps unless --every says otherwise; 8 steps
# per epoch with a DistributedSampler at 2 ranks (4 at 4 ranks), 16 with a plain shuffle.
ZOO = [
    # FSDP2 with a BatchNorm switched to eval mode: its statistics are each rank's own.
    pytest.param(2, ["--wrap", "fsdp2", "--bn-eval-at", "7"], "23", id="fsdp2-bn-eval"),
    pytest.param(2, ["--wrap", "fsdp2", "--bn-eval-at", "7", "--async", "--workers", "2"], "23",
                 id="fsdp2-bn-eval-async-workers", marks=faults),
    pytest.param(4, ["--wrap", "fsdp2", "--optim", "sgd"], "23", id="fsdp2-4ranks", marks=faults),
    # A loader without generator= draws its base seed from torch's global generator.
    pytest.param(2, ["--no-loader-gen", "--workers", "2", "--bn-eval-at", "7", "--prefetch", "--async"], "23",
                 id="ddp-no-loader-generator-workers-prefetch-async", marks=faults),  # make test: test_loop_patterns
    pytest.param(2, ["--no-loader-gen", "--sampler", "random"], "23", id="ddp-no-generator-plain-shuffle",
                 marks=faults),
    # torch's RandomSampler (no state_dict): replayed from its epoch's start, workers, async.
    pytest.param(2, ["--sampler", "torch-random", "--workers", "2", "--async"], "23",
                 id="torch-random-sampler-workers-async", marks=faults),  # make test: test_sampler_replay
    # Gradient accumulation under no_sync(), wrapped and bare modules, at 4 ranks.
    pytest.param(4, ["--accum", "2"], "23", id="ddp-no-sync-4ranks", marks=faults),
    pytest.param(4, ["--wrap", "bare", "--accum", "2"], "23", id="bare-module-no-sync-4ranks", marks=faults),
    pytest.param(4, ["--wrap", "bare"], "23", id="bare-module-4ranks", marks=faults),
    pytest.param(2, ["--accum", "3", "--optim", "adam", "--sched", "onecycle"], "23",
                 id="ddp-no-sync-adam-onecycle", marks=faults),
    # The DDP warm-up runs the loop's own (training) forward and puts back what it changed: a head
    # used in training only (plain DDP), a forward drawing its own noise; and a wrapper built
    # after load_latest (the "load, then wrap" order), found at its first forward.
    pytest.param(2, ["--aux-head", "--noise-forward", "--bn-eval-at", "7", "--workers", "2"], "23",
                 id="ddp-aux-head-noisy-forward", marks=faults),
    pytest.param(4, ["--wrap", "bare", "--wrap-after-load", "--accum", "2", "--noise-forward"], "23",
                 id="bare-module-wrapped-after-load-4ranks", marks=faults),
    pytest.param(2, ["--wrap", "bare", "--wrap-after-load", "--compile", "--aux-head"], "23",
                 id="bare-module-wrapped-after-load-compiled", marks=faults),
    # torch.compile, GradScaler, EMA (AveragedModel), SGD with nesterov, SequentialLR.
    pytest.param(2, ["--compile", "--scaler", "--ema", "--optim", "sgd", "--sched", "seq", "--bn-eval-at", "7"],
                 "23", id="compiled-scaler-ema-sgd-seq", marks=faults),
    pytest.param(4, ["--compile", "--accum", "2", "--ema"], "23", id="compiled-no-sync-ema-4ranks", marks=faults),
    # A second resume inside the same epoch, the loader without a generator.
    pytest.param(2, ["--every", "2", "--no-loader-gen", "--sampler", "random"], "20,22",
                 id="two-resumes-in-one-epoch", marks=faults),
    pytest.param(2, ["--sampler", "random", "--workers", "2", "--optim", "adam", "--sched", "onecycle",
                     "--prefetch", "--async"], "23", id="plain-shuffle-workers-prefetch-async", marks=faults),
    pytest.param(4, ["--workers", "2", "--no-loader-gen", "--every", "3"], "17,19", id="4ranks-workers-two-resumes",
                 marks=faults),
    # Incremental saves of a LoRA-like state (fc1 frozen): references, and retention keeping them.
    pytest.param(2, ["--incremental", "--freeze-fc1"], "23", id="incremental-frozen-fc1", marks=faults),
    pytest.param(2, ["--incremental", "--freeze-fc1", "--async", "--every", "2", "--workers", "2"], "20,22",
                 id="incremental-async-two-resumes", marks=faults),
    # Every-step async saves with the snapshot overlapped with the next forward/backward (the
    # optimizer step waits for the copy; BatchNorm statistics and the EMA are copied at save()).
    pytest.param(2, ["--bn-eval-at", "7", "--async", "--overlap", "--every", "1"], "23",
                 id="ddp-bn-every-step-overlap", marks=faults),
    pytest.param(2, ["--bn-eval-at", "7", "--async", "--overlap", "--every", "1", "--workers", "2"], "23",
                 id="ddp-bn-every-step-overlap-workers", marks=faults),
    pytest.param(4, ["--compile", "--scaler", "--ema", "--async", "--overlap", "--every", "2"], "23",
                 id="compiled-scaler-ema-overlap-4ranks", marks=faults),
    pytest.param(2, ["--wrap", "fsdp2", "--async", "--overlap", "--every", "1"], "23", id="fsdp2-every-step-overlap",
                 marks=faults),
    # Two tiers with FSDP2 shards (one node: every rank's shard file in the one local dir) and async.
    pytest.param(2, ["--wrap", "fsdp2", "--local-tier", "--async"], "23", id="fsdp2-local-tier-async", marks=faults),
]


@pytest.mark.parametrize("ranks,options,kill_at", ZOO)
def test_a_zoo_loop_killed_and_resumed_is_bitwise_identical(tmp_path, ranks, options, kill_at):
    result = run_zoo_pair(str(tmp_path), ranks, options, kill_at, kill_rank=ranks - 1)
    assert len(result.resumes) == len(kill_at.split(",")), result.resumes
    assert result.identical, result.first_difference
    assert result.lines == 30 * ranks
    if "--incremental" in options:  # the frozen fc1 was referenced, not rewritten
        import glob
        import json

        manifests = sorted(glob.glob(str(tmp_path / "ckpt-killed" / "step-*" / "manifest.json")))
        assert manifests and "reused" in json.load(open(manifests[-1])), manifests
