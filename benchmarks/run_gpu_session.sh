#!/usr/bin/env bash
# One batched session on a multi-GPU host: install, GPU tests, torchrun verification, ring + merge + LSE
# toolkit benchmarks, each step under its own time limit so one slow step cannot starve the rest.
# Usage: bash benchmarks/run_gpu_session.sh OUT_DIR [tests|final|all|lse|ring|ring2|checks2|memory|faults2|bench2]   (all logs go to OUT_DIR/session.log)
set -uo pipefail
out=${1:?output dir}; what=${2:-final}
log="$out/session.log"
export PYTHONUNBUFFERED=1
# `python3 -m pip`: the machine's bare `pip` belongs to another interpreter
python3 -m pip install -q -e . --no-build-isolation --no-deps >/tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
python3 -c "import ringlse.blocks.triton_kernels, ringlse.kernels.merge, ringlse.lse.kernels.softmax; print('ringlse.kernels and ringlse.lse.kernels ok')" || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$log"
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
rc=0
step() {  # step SECONDS NAME COMMAND...: run with a limit, log everything, show the tail
    local limit=$1 name=$2; shift 2
    echo "=== $name" | tee -a "$log"
    timeout "$limit" "$@" >>"$log" 2>&1 || { echo "step $name failed/timed out (rc=$?)" | tee -a "$log"; rc=1; }
    grep -v "ring bench:" "$log" | tail -n 12
}
if [[ $what == tests || $what == all ]]; then
    step 200 gpu-tests python3 -m pytest -q -m gpu tests/test_ring_gpu.py tests/test_backends.py tests/test_merge_kernel.py -p no:cacheprovider
    step 100 lse-gpu-tests python3 -m pytest tests/test_lse_toolkit_gpu.py -q -m gpu -p no:cacheprovider
fi
if [[ $what == final || $what == all ]]; then
    for causal in yes no; do
        step 45 "verify-causal-$causal" torchrun --nproc_per_node="$n" launch/verify.py --seqlen 8192 --heads 8 \
            --kv-heads 2 --head-dim 128 --causal "$causal"
    done
    step 90 lse-bench python3 benchmarks/lse_toolkit.py --out "$out"
    step 260 ring-bench torchrun --nproc_per_node="$n" benchmarks/ring.py --out "$out" --budget-s 0.25
fi
if [[ $what == lse ]]; then  # the LSE toolkit alone (tests, then the benchmark)
    step 320 lse-gpu-tests python3 -m pytest tests/test_lse_toolkit_gpu.py -q -m gpu -p no:cacheprovider
    step 300 lse-bench python3 benchmarks/lse_toolkit.py --out "$out"
fi
if [[ $what == ring ]]; then  # the ring alone: tests (copy-engine and NCCL transports), verification, benchmark
    step 240 ring-gpu-tests python3 -m pytest -q tests/test_ring_gpu.py tests/test_part_sum.py tests/test_state_parts.py \
        tests/test_backends.py -p no:cacheprovider
    RINGLSE_KV_TRANSPORT=nccl step 120 ring-gpu-tests-nccl python3 -m pytest -q tests/test_ring_gpu.py \
        -k matches_reference -p no:cacheprovider
    step 45 verify-causal-yes torchrun --nproc_per_node="$n" launch/verify.py --seqlen 8192 --heads 8 --kv-heads 2 \
        --head-dim 128 --causal yes
    step 300 ring-bench torchrun --nproc_per_node="$n" benchmarks/ring.py --out "$out" --budget-s 0.25
fi
if [[ $what == ring2 ]]; then  # the ring benchmark on 2 of the GPUs (causal fwd+bwd)
    step 200 ring-bench-2 torchrun --nproc_per_node=2 benchmarks/ring.py --out "$out" --budget-s 0.25 \
        --gqa-kv-heads 0 --causal yes --modes fwd+bwd
fi
if [[ $what == checks2 ]]; then  # two GPUs: this version's GPU tests, masked verification, training
    step 300 gpu-tests python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_ring_gpu.py \
        tests/test_attention_hopper_gpu.py tests/test_triton_attention.py \
        -k "windows_and_documents or dead_rank or never_reach or bitwise or bad_inputs"
    step 60 verify-masks torchrun --nproc_per_node=2 launch/verify.py --seqlen 8192 --heads 8 --kv-heads 2 \
        --head-dim 128 --causal yes --window 1024,0 --docs 6
    step 90 train-2gpu-bf16 torchrun --nproc_per_node=2 launch/train.py --dtype bf16 --steps 20 --out "$out"
fi
if [[ $what == memory ]]; then  # every GPU: peak memory per rank vs context parallel, the dk/dv pieces A/B (W >= 3)
    if (( n >= 3 )); then
        step 200 dkv-pieces torchrun --nproc_per_node="$n" benchmarks/dkv_pieces_probe.py --out "$out" \
            --seqlens 16384 32768 --pieces 1 2 4
    fi
    step 150 memory-n torchrun --nproc_per_node="$n" benchmarks/memory.py --out "$out" --seqlens 8192 32768
    step 120 memory-fake torchrun --nproc_per_node=1 benchmarks/memory.py --out "$out/fake" --seqlens 8192 32768 \
        --fake-worlds 3 4
fi
if [[ $what == faults2 ]]; then  # two GPUs: the ring GPU tests (faults, masks, bad inputs, against the reference)
    step 480 gpu-tests python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_ring_gpu.py
fi
if [[ $what == bench2 ]]; then  # two GPUs, every backend (fa4 where installed): ring vs context parallel, error growth
    step 300 ring-bench-2 torchrun --nproc_per_node=2 benchmarks/ring.py --out "$out" --budget-s 0.25 \
        --backends fa4 sdpa triton --seqlens 16384 32768 131072 --causal yes --modes fwd+bwd
    step 90 error-growth-2 torchrun --nproc_per_node=2 benchmarks/error_growth.py --out "$out" \
        --backends fa4 sdpa triton
fi
exit $rc
