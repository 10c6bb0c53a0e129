"""Is bare FlashAttention-4's backward right for a head dim? Independent of ringlse: FA4's own forward and
backward against a float64 autograd reference, bf16, 1x512x4 heads, causal and not; prints the largest
relative error of out, dq, dk, dv (bf16 rounding gives ~3e-3; a wrong kernel ~1).

    python benchmarks/fa4_head_dims.py [HEAD_DIM ...]

Found with it (H200, flash-attn-4 4.0.0b36): dq wrong for 8, 16, 40, 48, 72, 80, 104 (head dim mod 32 in
{8, 16}), right for 24, 32, 56, 64, 88, 96, 128: `ringlse.blocks.fa4.VERIFIED_HEAD_DIMS`.
"""

import sys

import torch
from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

torch.manual_seed(0)
for d in [int(x) for x in sys.argv[1:]] or (32, 40, 48, 56, 64, 80, 128):
    for causal in (True, False):
        q, k, v = (torch.randn(1, 512, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        dout = torch.randn_like(q)
        out, lse = _flash_attn_fwd(q, k, v, causal=causal, return_lse=True)[:2]
        dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout, lse, causal=causal)[:3]
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        s = torch.einsum("bqhd,bkhd->bhqk", q64, k64) * d ** -0.5
        if causal:
            s = s.masked_fill(torch.ones(512, 512, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v64)
        gq, gk, gv = torch.autograd.grad(o, (q64, k64, v64), dout.double())
        rel = lambda a, b: ((a.double() - b).abs().max() / b.abs().max()).item()
        print(f"d={d:3d} causal={causal!s:5}  out {rel(out, o):.1e}  dq {rel(dq, gq):.1e}  dk {rel(dk, gk):.1e}  dv {rel(dv, gv):.1e}")
