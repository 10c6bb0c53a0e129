"""Host time per call of the LSE toolkit's launchers on inputs too small to fill the GPU, next to
PyTorch's ops and to the L2 flush `do_bench` runs before each timed call.

Why: on inputs of a few MB the kernels run for a few microseconds, and an eager call costs what the
host spends launching it. `do_bench` (the LSE benchmark's eager timing) hides host time behind its L2
flush; where the two are close, eager figures flip between runs (README, known gaps). This records
both, so that the flip is explained by numbers rather than guessed.

Time per call: `CALLS` calls back to back without synchronising, divided by `CALLS`; the median of
`REPEATS` such loops. A loop runs at the slower of the host and the GPU: for our launchers on these
inputs that is the host (their kernels take 7-14 us of GPU time, `lse_toolkit-*.json`), so the figure
is their host time; `torch.logsumexp` here is GPU-bound (its kernels take longer than its launch).
Flush: the GPU time of `do_bench`'s 256 MB `zero_`, timed with CUDA events.

Usage: python benchmarks/host_time.py [--out DIR]   (writes DIR/host_time-<gpu>.json, default
benchmarks/results)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch
import triton

from ringlse.kernels import softmax as ks

CASES = [(8, 131072), (4, 1 << 20)]  # float32: the launch-bound cases of lse_toolkit.py
CALLS, REPEATS = 500, 5


def loop_us(fn) -> float:
    """Median over REPEATS loops of CALLS back-to-back calls: microseconds per call."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    loops = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        loops.append((time.perf_counter() - t0) / CALLS * 1e6)
        torch.cuda.synchronize()
    return sorted(loops)[len(loops) // 2]


def flush_us() -> float:
    """GPU time of the L2 flush `triton.testing.do_bench` runs before each timed call (a 256 MB
    `zero_`), median of 50."""
    cache = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        cache.zero_()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    rows = []
    for R, N in CASES:
        x = torch.randn(R, N, device="cuda")
        y = ks.softmax_forward(x)
        g = torch.randn_like(y)
        lse = ks.logsumexp_forward(x)
        gl = torch.randn_like(lse)
        fns = {
            "softmax_forward": lambda: ks.softmax_forward(x),
            "softmax_backward": lambda: ks.softmax_backward(y, g),
            "logsumexp_forward": lambda: ks.logsumexp_forward(x),
            "logsumexp_backward": lambda: ks.logsumexp_backward(x, lse, gl),
            "torch.softmax": lambda: torch.softmax(x, -1),
            "torch.logsumexp": lambda: torch.logsumexp(x, -1),
            "torch.empty_like": lambda: torch.empty_like(x),
        }
        for name, fn in fns.items():
            rows.append(dict(rows=R, cols=N, dtype="float32", call=name, us_per_call_back_to_back=loop_us(fn)))
            print(f"{R}x{N} {name:20s} {rows[-1]['us_per_call_back_to_back']:6.1f} us", flush=True)
    result = {
        "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "method": f"time per call: median of {REPEATS} loops of {CALLS} back-to-back calls, no synchronise inside "
                  "a loop (the slower of host and GPU: the host for our launchers here); flush: GPU time of "
                  "do_bench's 256 MB zero_ (CUDA events, median of 50)",
        "do_bench_flush_gpu_us": flush_us(),
        "calls": rows,
    }
    print(f"do_bench flush: {result['do_bench_flush_gpu_us']:.1f} us of GPU time")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"host_time-{re.sub(r'[^a-z0-9]+', '-', gpu.lower()).strip('-')}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
