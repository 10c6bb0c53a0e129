"""The SM clock and power while one kernel runs for seconds on end: is the merging forward's extra time
its state's HBM traffic spent under the power cap?

For each side (the plain forward, the merging forward into a float32 state, and the dense backward for
scale), launches run back to back for `--seconds` while `nvidia-smi` samples the SM clock, the power
draw and the throttle reasons every 50 ms; the first second is dropped (the clock settling). Prints and
records per side: ms per call, median SM clock (MHz), median power (W), the throttle reasons seen.
bf16, b 2, 16 heads, head dim 128, S 8K, causal (`block_attention.py`'s merge row that is over 3%).

Usage: python3 benchmarks/clock_probe.py [--out DIR] [--seconds 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import triton

import ringlse

sys.path.insert(0, os.path.dirname(__file__))
from block_attention import save_result  # noqa: E402

QUERY = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"


def sample_while(fn, seconds: float) -> dict:
    """Run `fn` back to back for `seconds`, sampling the GPU; the stats of the samples after the first second."""
    smi = subprocess.Popen(["nvidia-smi", "-i", str(torch.cuda.current_device()), f"--query-gpu={QUERY}",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    start, n = time.perf_counter(), 0
    timed = None
    while time.perf_counter() - start < seconds:
        if timed is None and time.perf_counter() - start > 1.0:
            torch.cuda.synchronize()
            timed, n = (time.perf_counter(), torch.cuda.Event(enable_timing=True)), 0
            timed[1].record()
        for _ in range(10):
            fn()
        n += 10
        torch.cuda.synchronize()
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    torch.cuda.synchronize()
    ms = timed[1].elapsed_time(end) / n
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    samples = [[c.strip() for c in line.split(",")] for line in lines]
    keep = samples[len(samples) // max(1, int(seconds)):]  # drop the first second's share
    clocks = [float(s[1]) for s in keep if s[1].replace(".", "").isdigit()]
    power = [float(s[2]) for s in keep if s[2].replace(".", "").isdigit()]
    reasons = sorted({s[3] for s in keep if len(s) > 3})
    return dict(ms=ms, sm_clock_mhz=statistics.median(clocks) if clocks else None,
                power_w=statistics.median(power) if power else None, throttle_reasons=reasons, samples=len(keep))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args()
    b, h, d, s = 2, 16, 128, 8192
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    op = ringlse.get_block_op("triton", q.device, q.dtype)
    blk = dict(softmax_scale=d ** -0.5, causal=True, q_start=0, k_start=0)
    out, lse = op.forward(q, k, v, **blk)
    state = torch.zeros(q.shape, dtype=torch.float32, device=q.device), torch.full((b, h, s), float("-inf"), device=q.device)
    op.forward(q, k, v, **blk, out_acc=state[0], lse_acc=state[1])
    delta = op.compute_delta(dout, out)
    acc = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in (q, k, v)]
    sides = {
        "plain forward": lambda: op.forward(q, k, v, **blk),
        "merging forward": lambda: op.forward(q, k, v, **blk, out_acc=state[0], lse_acc=state[1]),
        "backward": lambda: op.backward(dout, q, k, v, out, lse, delta, **blk, dq_acc=acc[0], dk_acc=acc[1],
                                        dv_acc=acc[2]),
    }
    rows = []
    for rnd in range(2):  # twice, in turn: a drift over the run shows as a difference between rounds
        for name, fn in sides.items():
            row = dict(side=name, round=rnd, **sample_while(fn, args.seconds))
            rows.append(row)
            print(f"{name:<16} round {rnd}: {row['ms']:.4f} ms, SM {row['sm_clock_mhz']} MHz, {row['power_w']} W, "
                  f"{row['throttle_reasons']}", flush=True)
    if args.out:
        print("wrote", save_result(args.out, "clock_probe", dict(
            benchmark="clock_probe", gpu=torch.cuda.get_device_name(), torch=torch.__version__,
            triton=triton.__version__, command=f"python3 benchmarks/clock_probe.py --out DIR --seconds {args.seconds}",
            date=time.strftime("%Y-%m-%dT%H:%M:%S"), shape=dict(batch=b, heads=h, head_dim=d, seqlen=s, causal=True),
            rows=rows)))


if __name__ == "__main__":
    main()
