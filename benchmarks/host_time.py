"""Host time per call of the LSE toolkit's launchers, next to PyTorch's ops and to the L2 flush
`do_bench` runs before each timed call.

Why: on inputs of a few MB the kernels run for a few microseconds, and an eager call costs what the
host spends launching it. `do_bench` (the LSE benchmark's eager timing) hides host time behind its L2
flush; where the two are close, eager figures flip between runs (README, known gaps). This records
both, so that the flip is explained by numbers rather than guessed.

Host time per call: `CALLS` calls issued while the GPU is held busy by a sleep kernel queued first
(`torch.cuda._sleep`), so that no call waits for the GPU: the loop's wall time over `CALLS` is host
time alone, whatever the kernels' GPU time (a loop that outlasted the sleep is dropped: its host may
have waited on the GPU); the median of `REPEATS` loops. Flush: the GPU time of `do_bench`'s 256 MB
`zero_`, timed with CUDA events.

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

from ringlse.lse.kernels import softmax as ks
from ringlse.lse.kernels.launch import recorded_launches

# (rows, cols, dtype): the launch-bound float32 cases of lse_toolkit.py, then inputs that fill the GPU
CASES = [(8, 131072, torch.float32), (4, 1 << 20, torch.float32), (4096, 1000, torch.float32),
         (512, 131072, torch.bfloat16), (16384, 4097, torch.bfloat16)]
# (few calls a loop: the launches queued behind the sleep must not fill the driver's queue, which would
# make the host wait for the GPU after all)
CALLS, REPEATS, SLEEP_CYCLES = 40, 15, 1 << 24


def host_loop_us(fn) -> float | None:
    """One loop of CALLS calls issued behind a sleep kernel: host microseconds per call, or None if the
    sleep ended before the loop did (the host may have waited on the GPU)."""
    torch.cuda._sleep(SLEEP_CYCLES)
    asleep = torch.cuda.Event()
    asleep.record()  # (completes when the sleep ends)
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    elapsed = time.perf_counter() - t0
    busy = not asleep.query()
    torch.cuda.synchronize()
    return elapsed / CALLS * 1e6 if busy else None


def host_us(fns: dict) -> dict:
    """Median over REPEATS loops (`host_loop_us`) per function; the functions take turns loop by loop,
    so that the host's own drift (frequency, neighbours) spreads over all of them alike."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    loops: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(3 * REPEATS):
        for name, fn in fns.items():
            if len(loops[name]) < REPEATS and (t := host_loop_us(fn)) is not None:
                loops[name].append(t)
        if all(len(v) == REPEATS for v in loops.values()):
            return {name: sorted(v)[REPEATS // 2] for name, v in loops.items()}
    raise RuntimeError(f"the sleep kernel ended before loops of {CALLS} calls too often: the host waited on the GPU")


def launches(fn) -> int:
    """Kernel launches one call of our launchers makes (their plans' `BoundLaunch` calls counted)."""
    with recorded_launches() as seen:
        fn()
    return len(seen)


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
    for R, N, dtype in CASES:
        x = torch.randn(R, N, device="cuda", dtype=dtype)
        y = ks.softmax_forward(x)
        g = torch.randn_like(y)
        lse = ks.logsumexp_forward(x)
        gl = torch.randn_like(lse)
        fns = {
            "softmax_forward": lambda: ks.softmax_forward(x),
            "softmax_backward": lambda: ks.softmax_backward(y, g),
            "logsumexp_forward": lambda: ks.logsumexp_forward(x),
            "logsumexp_backward": lambda: ks.logsumexp_backward(x, lse, gl),
            "softmax (autograd, forward)": lambda: ks.softmax(x),
            "torch.softmax": lambda: torch.softmax(x, -1),
            "torch.logsumexp": lambda: torch.logsumexp(x, -1),
            "torch.empty_like": lambda: torch.empty_like(x),
        }
        for name, us in host_us(fns).items():
            rows.append(dict(rows=R, cols=N, dtype=str(dtype).removeprefix("torch."), call=name, host_us_per_call=us,
                             launches=None if name.startswith("torch.") else launches(fns[name])))
            print(f"{R}x{N} {rows[-1]['dtype']} {name:28s} {rows[-1]['host_us_per_call']:6.1f} us", flush=True)
    result = {
        "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "method": f"host time per call: median of {REPEATS} loops of {CALLS} calls issued while a sleep kernel "
                  "queued first holds the GPU busy (no call waits on the GPU), the calls of one input taking "
                  "turns loop by loop; flush: GPU time of do_bench's 256 MB zero_ (CUDA events, median of 50)",
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
