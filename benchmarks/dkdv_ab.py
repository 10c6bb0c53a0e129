"""A/B of the Hopper dk/dv kernel in one process: a former version (a copy of
`kernels/attention_bwd_hopper.py`, e.g. `git show REV:kernels/attention_bwd_hopper.py > FILE`) against the
installed one, on masked_attention.py's inputs (b1 h32 d128 bf16, S 32K; the plain causal batches with the
same pairs) and dense blocks (d 64 and 128, causal and not), each adding one block's dk/dv into float32
accumulators that TMA indexes. Timed in alternation, twice over (the better of each one's two medians);
their dk/dv from zero compared.

Usage (on a GPU): python benchmarks/dkdv_ab.py --before FILE [--out DIR] [--seqlen S]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from fwd_ab import ab_row, all_cases, load_module, save  # noqa: E402


DENSE = ((2, 16, 8192, 128), (2, 16, 8192, 64))  # (batch, heads, seqlen, head dim)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="a former attention_bwd_hopper.py")
    ap.add_argument("--out", default=None)
    ap.add_argument("--seqlen", type=int, default=32768)
    args = ap.parse_args()
    from ringlse.kernels import attention_bwd as B
    from ringlse.kernels import attention_bwd_hopper as after
    from ringlse.kernels import attention_fwd as F

    before = load_module(args.before, "attention_bwd_hopper_before")
    rows = []
    for name, b, s, h, d, mask, pairs in all_cases(args.seqlen, ("causal", "query_lo", "query_hi"), DENSE):
        q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        fwd_mask = {}
        if "query_lo" in mask:
            from masked_attention import inputs

            from ringlse.masks import Span, block_intervals
            iv = block_intervals(inputs(s)[name], Span(0, s), Span(0, s), "cuda")
            fwd_mask = dict(key_lo=iv.key_lo.contiguous(), key_hi=iv.key_hi.contiguous())
        out, lse = F.attention_forward(q, k, v, softmax_scale=d**-0.5, causal=mask.get("causal", False), q_start=0,
                                       k_start=0, **fwd_mask)
        delta = B.attention_delta(do, out)
        accs = {}
        fns = {}
        for side, mod in (("before", before), ("after", after)):
            dk, dv = (torch.zeros(b, s, h, d, device="cuda") for _ in range(2))

            def fn(_i, mod=mod, dk=dk, dv=dv):
                mod.hopper_dkdv(do, q, k, v, lse, delta, dk, dv, qk_scale=d**-0.5 * 1.4426950408889634,
                                dk_scale=d**-0.5, offset=0, causal=mask.get("causal", False),
                                query_lo=mask.get("query_lo"), query_hi=mask.get("query_hi"))
            fn(0)
            accs[side] = (dk.clone(), dv.clone())
            fns[side] = fn
        # dk/dv: 4 of the backward's 5 GEMMs
        rows.append(ab_row(dict(input=name, batch=b, seqlen=s, heads=h, head_dim=d, visible_pairs=pairs), fns, accs,
                           2 * 4.0 * h * d * pairs))
    save(args.out, "dkdv_ab", rows)


if __name__ == "__main__":
    main()
