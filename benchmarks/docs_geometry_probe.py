"""Packed equal documents against the same work as a batch: where the interval path's time goes.

Eight documents of 4K packed in one 32K row (the interval kernels, `masked_attention.py`'s input) do
exactly the work of a batch of eight 4K causal blocks. This times, in one process on the same tensors
(the batch is a view of the packed row), forward and backward:
- `packed intervals`: the interval kernels over the packed row (persistent, tiles from a counter);
- `packed intervals, one program per tile` (forward): the same without the persistent programs;
- `batch causal`: the causal kernels over the `[8, 4K]` view;
- `batch intervals`: the interval kernels over the same view, causal intervals;
- the same for 64 documents of 512, and the dense causal 32K block the masked ratios divide by.
FLOPs over visible pairs, as `masked_attention.py` counts them. Times: `timing.abba_ms` (the card
warmed, each side after 2 s of it alone, in order and in reverse, the mean), as
`masked_attention.py`; then the
forward sides again with launches interleaved (`timing.interleaved_ms`).

Usage: python3 benchmarks/docs_geometry_probe.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton

import ringlse
from ringlse.masks import Rule, Span, block_intervals

sys.path.insert(0, os.path.dirname(__file__))
from block_attention import save_result  # noqa: E402
from timing import abba_ms, interleaved_ms  # noqa: E402
from ringlse.kernels.attention_fwd_hopper import HopperConfig, hopper_forward  # noqa: E402


def calls(q, k, v, rule: Rule | None, causal: bool, config: HopperConfig | None = None):
    """`(fwd, bwd)` over `q, k, v` (`[b, s, h, d]`): `rule`'s intervals, or plain causal blocks; `config`
    replaces the forward's launch configuration (the forward then runs through the launcher)."""
    op = ringlse.get_block_op("triton", q.device, q.dtype, masked=True)
    b, s, h, d = q.shape
    if rule is None:
        block = dict(causal=causal, q_start=0, k_start=0)
    else:
        block = dict(causal=False, q_start=0, k_start=0,
                     intervals=block_intervals(rule, Span(0, s), Span(0, s), q.device))
    scale = d ** -0.5
    out, lse = op.forward(q, k, v, softmax_scale=scale, **block)
    dout = torch.randn_like(q)
    delta = op.compute_delta(dout, out)
    acc = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in (q, k, v)]

    o2, l2 = torch.empty_like(q), torch.empty_like(lse)
    iv = block.get("intervals")
    lo, hi = (None, None) if iv is None else (iv.key_lo.to(q.device), iv.key_hi.to(q.device))

    def fwd(_i):
        if config is None:
            op.forward(q, k, v, softmax_scale=scale, **block)
        else:  # the launcher with another configuration
            hopper_forward(q, k, v, o2, l2, softmax_scale=scale, causal=causal and rule is None, offset=0,
                           accum=False, config=config, key_lo=lo, key_hi=hi)

    def bwd(_i):
        for a in acc:
            a.zero_()
        op.backward(dout, q, k, v, out, lse, delta, softmax_scale=scale, **block, dq_acc=acc[0], dk_acc=acc[1],
                    dv_acc=acc[2])

    return fwd, bwd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    h, d, s = 32, 128, 32768
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    dense_flop = 4 * h * d * s * (s + 1) // 2
    dense = calls(q, k, v, None, True)
    rows = []
    for n in (8, 64):
        L = s // n
        view = [x.view(n, L, h, d) for x in (q, k, v)]
        flop = 4 * h * d * n * L * (L + 1) // 2
        sides = {
            "packed intervals": calls(q, k, v, Rule(True, docs=tuple(range(0, s + 1, L))), False),
            "packed intervals, one program per tile": (calls(q, k, v, Rule(True, docs=tuple(range(0, s + 1, L))),
                                                             False, HopperConfig(128, False))[0], None),
            "batch causal": calls(*view, None, True),
            "batch intervals": calls(*view, Rule(True), False),
            "dense causal 32K": dense,
        }
        fns = {f"{name}/fwd": (lambda f=f: f(0)) for name, (f, _) in sides.items()}
        fns.update({f"{name}/bwd": (lambda b=b: b(0)) for name, (_, b) in sides.items() if b is not None})
        ms = {key: sum(r) / len(r) for key, r in abba_ms(fns).items()}
        fwd_ms = {name: ms[f"{name}/fwd"] for name in sides}
        bwd_ms = {name: ms[f"{name}/bwd"] for name in sides if f"{name}/bwd" in ms}
        inter = interleaved_ms({name: f for name, (f, _) in sides.items()})
        for name in sides:
            fl = dense_flop if name.startswith("dense") else flop
            row = dict(documents=n, side=name, fwd_ms=fwd_ms[name], fwd_tflops=fl / fwd_ms[name] / 1e9,
                       fwd_interleaved_ms=inter[name], fwd_interleaved_tflops=fl / inter[name] / 1e9)
            if name in bwd_ms:
                row.update(bwd_ms=bwd_ms[name], bwd_tflops=2.5 * fl / bwd_ms[name] / 1e9)
            rows.append(row)
            print(f"{n:3d} docs  {name:<40} fwd {row['fwd_tflops']:6.1f} (interleaved {row['fwd_interleaved_tflops']:6.1f})"
                  + (f"  bwd {row['bwd_tflops']:6.1f}" if "bwd_tflops" in row else ""), flush=True)
    if args.out:
        gpu = torch.cuda.get_device_name()
        result = dict(benchmark="docs_geometry_probe", gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                      command="python3 benchmarks/docs_geometry_probe.py --out DIR",
                      date=time.strftime("%Y-%m-%dT%H:%M:%S"), shape=dict(heads=h, head_dim=d, seqlen=s),
                      dtype="bfloat16", flops="4*H*D*visible pairs; backward 2.5x", rows=rows)
        print("wrote", save_result(args.out, "docs_geometry_probe", result))


if __name__ == "__main__":
    main()
