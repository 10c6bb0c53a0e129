#!/usr/bin/env bash
# One batched session on the GPU machine (multi-GPU host): install, GPU tests, torchrun verification,
# merge and ring benchmarks. Usage: bash benchmarks/run_gpu_session.sh OUT_DIR [tests|bench|all]
# Logs and result files land in OUT_DIR.
set -uo pipefail
out=${1:?output dir}; what=${2:-all}
export PYTHONUNBUFFERED=1
python3 -m pip install -q -e . --no-build-isolation --no-deps >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
python3 -c "import ringlse.kernels.attention, ringlse.kernels.merge; print('ringlse.kernels ok')" || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
rc=0
if [[ $what == tests || $what == all ]]; then
    python3 -m pytest -q -m gpu tests/test_ring_gpu.py tests/test_backends.py tests/test_merge_kernel.py \
        -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -25 || rc=1
    for causal in yes no; do
        torchrun --nproc_per_node="$n" launch/verify.py --seqlen 16384 --heads 16 --kv-heads 4 --head-dim 128 \
            --causal "$causal" 2>&1 | tee -a "$out/verify.log" | tail -9 || rc=1
    done
    python3 benchmarks/merge.py --out "$out" 2>&1 | tail -15 || rc=1
fi
if [[ $what == bench || $what == all ]]; then
    torchrun --nproc_per_node="$n" benchmarks/ring.py --out "$out" --budget-s 1.0 2>&1 | tee "$out/ring_bench.log" \
        | grep -v "ring bench:" | tail -40 || rc=1
fi
exit $rc
