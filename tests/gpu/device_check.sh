#!/bin/bash
# The GPU checks in one run on a machine with CUDA and without network:
#   bash tests/gpu/device_check.sh OUTDIR
# Wheels missing there (torchdata) are expected under .whl/. Logs go to OUTDIR.
set -u
out=${1:-/tmp/distckpt-gpu}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:$PWD/launch:${PYTHONPATH:-} PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
nvidia-smi -L | tee "$out/machine.txt"
python3 -c "import torch, torchdata; print('torch', torch.__version__, 'torchdata', torchdata.__version__, torch.cuda.get_device_name())" | tee -a "$out/machine.txt"
timeout 200 python3 -m pytest tests/gpu -v -p no:cacheprovider --timeout 150 2>&1 | tee "$out/gpu_tests.log" | tail -25
timeout 70 python3 bench/gpu.py --mib 512 2048 --repeats 3 2>&1 | tee "$out/gpu_bench.md"
[ -n "${SKIP_OVERLAP:-}" ] || timeout 60 python3 bench/overlap.py --device cuda --sizes 256 1024 --rounds 3 2>&1 | tee "$out/overlap.md"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/unit/test_rng.py tests/unit/test_serialize.py \
    tests/protocol/test_manager_local.py tests/resume/test_sampler_replay.py tests/resume/test_loop_patterns.py 2>&1 | tee "$out/cpu_tests_on_gpu_host.log" | tail -8
