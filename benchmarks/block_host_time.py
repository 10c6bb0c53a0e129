"""Host time per block-op call of the attention backends, at the block shapes a ring runs, and where the
`triton` op's host time goes.

Why: profiled on 4xH100 (`ring-profile-session33-4xH100.log`), a cold causal fwd+bwd call of the `triton`
ring at 32K took 9-15 ms of host time to return, the `sdpa` ring's 5 ms, and the `triton` ring's compute
stream sat idle 3-6 ms of its ~20 ms: a ring step that costs the host about what it costs the GPU
leaves the GPU waiting wherever the host falls behind.

Host time per call, as `host_time.py` measures it: `CALLS` calls issued while the GPU is held busy by a
sleep kernel queued first, so no call waits for the GPU; the loop's wall time over `CALLS`, the median of
`REPEATS` loops. Then `cProfile` over the `triton` op's
backward calls: the functions with the most cumulative time.

Usage: python benchmarks/block_host_time.py [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import triton

import ringlse

sys.path.insert(0, os.path.dirname(__file__))
from block_attention import save_result  # noqa: E402

CALLS, REPEATS = 20, 5
# (name, sq, sk, causal): the own block and the remote pieces of a 32K zigzag ring at W = 4 (8K per rank,
# dk/dv in 4 pieces of keys)
SHAPES = (("own 8K x 8K causal", 8192, 8192, True), ("remote 8K x 4K", 8192, 4096, False),
          ("piece 8K x 1K", 8192, 1024, False))


def host_us(fn) -> float | None:
    """Median host microseconds per call of `fn`, the GPU kept busy meanwhile."""
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(REPEATS):
        torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU time at ~2 GHz: longer than any loop below
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        dt = time.perf_counter() - t0
        runs.append(dt / CALLS * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs)


def calls(backend: str, sq: int, sk: int, causal: bool) -> dict:
    h, d = 32, 128
    q, dout = (torch.randn(1, sq, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, sk, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    op = ringlse.get_block_op(backend, q.device, q.dtype)
    blk = dict(softmax_scale=d**-0.5, causal=causal, q_start=sk - sq if causal else 0, k_start=0)
    out, lse = op.forward(q, k, v, **blk)
    delta = op.compute_delta(dout, out) if op.uses_delta else None
    fns = {"forward": lambda: op.forward(q, k, v, **blk)}
    if op.forward_parts is None:
        acc = torch.zeros(q.shape, device="cuda"), torch.full((1, h, sq), float("-inf"), device="cuda")
        fns["forward, merged"] = lambda: op.forward(q, k, v, **blk, out_acc=acc[0], lse_acc=acc[1])
        fns["forward, fresh"] = lambda: op.forward(q, k, v, **blk, out_acc=acc[0], lse_acc=acc[1], fresh=True)
        grads = [torch.zeros(t.shape, device="cuda") for t in (q, k, v)]
        fns["backward"] = lambda: op.backward(dout, q, k, v, out, lse, delta, **blk, dq_acc=grads[0],
                                              dk_acc=grads[1], dv_acc=grads[2])
    else:
        fns["forward, parts"] = lambda: op.forward_parts(q, k, v, **blk)
        fns["backward, parts"] = lambda: op.backward_parts(dout, q, k, v, out, lse, delta, **blk)
    return fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    profiles = {}
    for name, sq, sk, causal in SHAPES:
        for backend in ("triton", "sdpa"):
            for side, fn in calls(backend, sq, sk, causal).items():
                us = host_us(fn)
                rows.append(dict(shape=name, backend=backend, call=side, host_us=us))
                print(f"{name:<20} {backend:<7} {side:<18} {us:8.1f} us", flush=True)
                if backend == "triton" and side == "backward" and name.startswith("piece"):
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(CALLS):
                        fn()
                    prof.disable()
                    torch.cuda.synchronize()
                    text = io.StringIO()
                    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
                    profiles[f"{name} {side}"] = text.getvalue()
                    print(text.getvalue())
    if args.out:
        print("wrote", save_result(args.out, "block_host_time", dict(
            benchmark="block_host_time", gpu=torch.cuda.get_device_name(), torch=torch.__version__,
            triton=triton.__version__, command="python3 benchmarks/block_host_time.py --out DIR",
            date=time.strftime("%Y-%m-%dT%H:%M:%S"), calls=CALLS, repeats=REPEATS, rows=rows, profiles=profiles)))


if __name__ == "__main__":
    main()
