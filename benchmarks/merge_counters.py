"""Hardware counters of the plain and the merging Hopper forward, for Nsight Compute: is the merge's
~5% at 8K d 128 causal the float32 state's bytes through an L2 the forward already keeps busy?

Launches, per shape, the plain forward (bf16 O by TMA) and the merging one (a float32 state read and
written) through the launcher, `--repeat` times each after one untimed launch of each (compilation);
run it under `ncu` with a kernel filter so that only the forwards are profiled, e.g.

    ncu --clock-control none -k regex:_attn_fwd_hopper --launch-skip 2 \
        --section SpeedOfLight --metrics lts__t_bytes.sum,dram__bytes_read.sum,dram__bytes_write.sum \
        --csv --page raw python3 benchmarks/merge_counters.py

The shapes are `merge_probe.py`'s: the row over 3% and the rows under it for contrast.
"""
from __future__ import annotations

import argparse

import torch

SHAPES = ((2, 16, 16, 8192, 128, True), (2, 16, 16, 8192, 128, False), (1, 32, 32, 32768, 128, True),
          (2, 16, 16, 4096, 128, True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--shapes", type=int, nargs="*", default=None, help="indices into SHAPES (default: all)")
    args = ap.parse_args()
    from ringlse.kernels import attention_fwd_hopper as H

    for b, h, hkv, s, d, causal in (SHAPES if args.shapes is None else [SHAPES[i] for i in args.shapes]):
        q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out, lse = torch.empty_like(q), torch.empty(b, h, s, device="cuda")
        state = torch.randn(b, s, h, d, device="cuda"), torch.randn(b, h, s, device="cuda")
        kw = dict(softmax_scale=d**-0.5, causal=causal, offset=0)
        for _ in range(1 + args.repeat):
            H.hopper_forward(q, k, v, out, lse, **kw, accum=False)
            H.hopper_forward(q, k, v, *state, **kw, accum=True)
        torch.cuda.synchronize()
        print(f"b{b} h{h}/{hkv} s{s} d{d} causal={causal:d}: plain, merge x{args.repeat} after one of each", flush=True)


if __name__ == "__main__":
    main()
