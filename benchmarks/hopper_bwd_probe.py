"""Probe of the Gluon Hopper dk/dv kernel (`ringlse.kernels.attention_bwd_hopper`) on one H100/H200:
checks dk/dv against float64 autograd (next to our Triton kernel's error on the same inputs), then times
the backward with it and with the Triton dk/dv kernel, next to cuDNN, in one process.

Usage (on a GPU): python benchmarks/hopper_bwd_probe.py [--out DIR]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from block_attention import _bench, save_result, _make_sets, _n_sets, attn_flops, time_sdpa  # noqa: E402


def _grads_ref(q, k, v, do, scale, causal, offset):
    """float64 (dk, dv) of sum(out * do), GQA by repeating K/V (summed back)."""
    h, hkv = q.shape[2], k.shape[2]
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    kk = k64.transpose(1, 2).repeat_interleave(h // hkv, 1)
    vv = v64.transpose(1, 2).repeat_interleave(h // hkv, 1)
    s = (q64.transpose(1, 2) @ kk.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(q.shape[1], device=q.device)[:, None]
        j = torch.arange(k.shape[1], device=q.device)[None, :]
        s = s.masked_fill(j > i + offset, float("-inf"))
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.where(torch.isinf(lse), 0.0, torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)))
    out = (p @ vv).transpose(1, 2)
    (out * do.double()).sum().backward()
    return k64.grad, v64.grad


def check(block_m=None) -> list[str]:
    from ringlse.kernels import attention_bwd as B
    from ringlse.kernels import attention_bwd_hopper as H
    from ringlse.kernels import attention_fwd as F
    from ringlse.kernels.attention_common import bwd_configs

    fails = []
    cases = [  # b, sq, sk, h, hkv, d, causal, offset
        (2, 300, 300, 4, 4, 128, False, 0),
        (1, 1025, 1025, 4, 2, 128, True, 0),
        (2, 97, 333, 4, 2, 64, True, 236),
        (1, 640, 256, 2, 1, 64, True, -130),
        (1, 513, 700, 3, 3, 128, False, 0),
        (1, 2048, 2048, 8, 2, 64, True, 0),
    ]
    for b, sq, sk, h, hkv, d, causal, offset in cases:
        if block_m is not None and d == 64 and block_m < 64:
            continue
        q = torch.randn(b, sq, h, d, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.randn(b, sk, hkv, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        do = torch.randn_like(q)
        scale = d**-0.5
        out, lse = torch.empty_like(q), torch.empty(b, h, sq, dtype=torch.float32, device="cuda")
        F._forward_impl(q, k, v, out, lse, softmax_scale=scale, causal=causal, offset=offset, accum=False)
        delta = B.attention_delta(do, out)
        ref_dk, ref_dv = _grads_ref(q, k, v, do, scale, causal, offset)
        errs = {}
        for name in ("tl", "gluon"):
            dq = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
            dk = torch.zeros(k.shape, dtype=torch.float32, device="cuda")
            dv = torch.zeros_like(dk)
            kw = dict(qk_scale=scale * 1.4426950408889634, causal=causal, offset=offset)
            if name == "tl":
                B._backward_impl(do, q, k, v, lse, delta, dq, dk, dv, dq_scale=scale, dk_scale=scale,
                                 config=bwd_configs(d, q.dtype, causal)[0], **kw)
            else:
                H.hopper_dkdv(do, q, k, v, lse, delta, dk, dv, dk_scale=scale, block_m=block_m, **kw)
            torch.cuda.synchronize()
            e = []
            for got, ref in ((dk, ref_dk), (dv, ref_dv)):
                e.append(float("nan") if torch.isnan(got).any() else
                         ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item())
            errs[name] = tuple(e)
        ok = all(math.isfinite(x) for x in errs["gluon"]) and all(
            g <= 2 * t + 1e-3 for g, t in zip(errs["gluon"], errs["tl"]))
        line = f"bm={block_m} {(b, sq, sk, h, hkv, d, causal, offset)} dk/dv tl {errs['tl']} gluon {errs['gluon']}"
        print(("ok   " if ok else "FAIL ") + line, flush=True)
        if not ok:
            fails.append(line)
    return fails


def time_rows(shapes, variants) -> list[dict]:
    from torch.nn.attention import SDPBackend

    from ringlse.kernels import attention_bwd as B
    from ringlse.kernels import attention_bwd_hopper as H
    from ringlse.kernels import attention_fwd as F
    from ringlse.kernels.attention_common import bwd_configs

    rows = []
    for b, h, s, d, hkv in shapes:
        for causal in (False, True):
            n = _n_sets(b, h, s, d, torch.bfloat16)
            sets = _make_sets(b, h, s, d, torch.bfloat16, n, hkv=hkv)
            scale = d**-0.5
            outs = [F.attention_forward(q, k, v, softmax_scale=scale, causal=causal, q_start=0, k_start=0)
                    for q, k, v, _ in sets]
            deltas = [B.attention_delta(st[3], o[0]) for st, o in zip(sets, outs)]
            dq = torch.zeros(b, s, h, d, dtype=torch.float32, device="cuda")
            dk = torch.zeros(sets[0][1].shape, dtype=torch.float32, device="cuda")
            dv = torch.zeros_like(dk)
            kw = dict(qk_scale=scale * 1.4426950408889634, causal=causal, offset=0)
            fl = attn_flops(b, h, s, s, d, causal) * 2.5
            row = {"batch": b, "heads": h, "kv_heads": hkv, "seqlen": s, "head_dim": d, "causal": causal,
                   "bwd_flop": fl}

            def tl_bwd(i):
                q, k, v, do = sets[i]
                B._backward_impl(do, q, k, v, outs[i][1], deltas[i], dq, dk, dv, dq_scale=scale, dk_scale=scale,
                                 config=bwd_configs(d, q.dtype, causal)[0], **kw)

            def new_bwd(i):
                q, k, v, do = sets[i]
                B._backward_impl(do, q, k, v, outs[i][1], deltas[i], dq, dk, dv, dq_scale=scale, dk_scale=scale,
                                 **kw)

            row["tl_bwd_ms"] = _bench(tl_bwd, n)
            row["new_bwd_ms"] = _bench(new_bwd, n)
            for bm in variants:
                if d == 64 and bm < 64:
                    continue
                row[f"gluon_dkdv_bm{bm}_ms"] = _bench(lambda i, bm=bm: H.hopper_dkdv(
                    sets[i][3], sets[i][0], sets[i][1], sets[i][2], outs[i][1], deltas[i], dk, dv, dk_scale=scale,
                    block_m=bm, **kw), n)
            row["cudnn_bwd_ms"] = time_sdpa(b, h, s, d, causal, SDPBackend.CUDNN_ATTENTION, hkv=hkv)["bwd"]
            for key in [k for k in row if k.endswith("_ms")]:
                row[key.replace("_ms", "_tflops")] = fl / row[key] / 1e9
            print(f"{(b, h, s, d, hkv, causal)} " + " ".join(f"{k[:-3]} {v:7.3f}" for k, v in row.items()
                                                          if k.endswith("_ms")) +
                  f" | new/cudnn {row['cudnn_bwd_ms'] / row['new_bwd_ms']:.2f} tl/cudnn "
                  f"{row['cudnn_bwd_ms'] / row['tl_bwd_ms']:.2f}", flush=True)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import triton

    fails = check() + check(block_m=64)
    shapes = [(2, 16, 8192, 128, 16), (1, 32, 16384, 128, 16), (2, 16, 8192, 64, 16), (1, 32, 16384, 64, 8)]
    rows = time_rows(shapes, [32, 64])
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "command": " ".join(sys.argv), "check_failures": fails,
              "rows": rows}
    if args.out:
        save_result(args.out, "hopper_bwd_probe", result)
    print("check failures:", len(fails))


if __name__ == "__main__":
    main()
