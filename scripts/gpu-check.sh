#!/usr/bin/env bash
# The GPU checks in one command, on a machine with a CUDA GPU (CI has none):
#
#   bash scripts/gpu-check.sh [OUT_DIR]
#
# runs tests/gpu (torchtitan parity with fsdp on CUDA, 2-step runs with NCCL, a default
# `forge run` on the GPU with each trainer; the SGLang tests where sglang is installed) and
# the trainer and generator kits with the backends on the GPU (one-rank checks),
# and a 2-step run over `--transport nccl` with the trainer and the generator on one GPU;
# it records the machine and `forge plugins list`. Logs go to OUT_DIR (default $OUT, else
# /tmp/forge-gpu). The environment is the one forgerl is installed in; on a machine that
# cannot reach a package index, put wheels (forgerl's own and whatever the machine lacks)
# in .whl/ and they are installed without an index into /tmp/forge-site first.
set -uo pipefail
out=${1:-${OUT:-/tmp/forge-gpu}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/forge-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/forge-site${PYTHONPATH:+:$PYTHONPATH}
fi

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0), "devices", torch.cuda.device_count())'
    "$py" -m forgerl.cli plugins list
} 2>&1 | tee "$out/machine.txt"

status=0
"$py" -m pytest -q -p no:cacheprovider -rA --continue-on-collection-errors tests/gpu 2>&1 | tee "$out/pytest-gpu.log" || status=1
# The trainer and generator kits' one-rank checks with the backends on the GPU (their
# two-rank check needs a GPU per rank).
"$py" -m pytest -q -p no:cacheprovider -rA -k "not two_ranks" \
    tests/conformance/test_trainer_kit.py tests/conformance/test_generator_kit.py::TestHFGenerator \
    2>&1 | tee "$out/pytest-kits.log" || status=1

# One GPU, the trainer and the hf generator (in the trainer's process) on it, weights over
# the nccl transport: it must train, not hang (2 steps on an H200, 2026-12-04).
timeout 150 "$py" -m forgerl.cli run --model tiny --generator hf --transport nccl --steps 2 \
    --set loop.prompts_per_step=2 --set loop.group_size=4 --set loop.sampling.max_tokens=12 \
    --set loop.eval_size=4 --set logging.progress=false --output /tmp/forge-gpu-nccl \
    > "$out/nccl-one-gpu.log" 2>&1
nccl_status=$?
echo "forge run --transport nccl on one GPU: exit $nccl_status" | tee -a "$out/nccl-one-gpu.log"
[ "$nccl_status" -eq 0 ] || status=1
tail -n 5 /tmp/forge-gpu-nccl/logs/*.log >> "$out/nccl-one-gpu.log" 2>/dev/null
exit $status
