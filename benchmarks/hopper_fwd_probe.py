"""Probe of the Gluon Hopper forward (`ringlse.kernels.attention_fwd_hopper`) on one H100/H200: checks
each variant against a float64 reference (and our Triton forward's error), then times the variants next
to our Triton forward and cuDNN in one process.

Usage (on a GPU): python benchmarks/hopper_fwd_probe.py [--out DIR] [--quick]
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

VARIANTS = {  # name -> (block_m, persistent); 128-key tiles, 2 slots (benchmarks/NOTES.md has the others)
    "m128-P": (128, True),
    "m128": (128, False),
    "m192": (192, False),
    "m192-P": (192, True),
}


def reference(q, k, v, scale, causal, offset):
    """float64 attention with (out, lse) in [b, s, h, d] / [b, h, s]; GQA by repeating K/V here."""
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    q64, k64, v64 = (t.double().transpose(1, 2) for t in (q, k, v))
    k64 = k64.repeat_interleave(h // hkv, 1)
    v64 = v64.repeat_interleave(h // hkv, 1)
    s = (q64 @ k64.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(k.shape[1], device=q.device)[None, :]
        s = s.masked_fill(j > i + offset, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = (p @ v64).transpose(1, 2)
    return out, lse


def check(variant, dtype=torch.bfloat16) -> list[str]:
    from ringlse.kernels import attention_fwd as F
    from ringlse.kernels import attention_fwd_hopper as G

    bm, pers = VARIANTS[variant]
    fails = []
    cases = [  # b, sq, sk, h, hkv, d, causal, offset, accum
        (2, 300, 300, 4, 4, 128, False, 0, False),
        (1, 1025, 1025, 2, 2, 128, True, 0, False),
        (2, 97, 333, 4, 2, 64, True, 236, False),
        (1, 640, 256, 2, 1, 64, True, -130, False),
        (1, 513, 700, 3, 3, 128, False, 0, True),
        (2, 256, 384, 4, 2, 64, True, 128, True),
        (1, 4096, 4096, 2, 2, 128, True, 0, False),
    ]
    for b, sq, sk, h, hkv, d, causal, offset, accum in cases:
        if bm > 128 and d > 64:  # 3 consumers have no registers for head dim 128
            continue
        q = torch.randn(b, sq, h, d, dtype=dtype, device="cuda")
        k = torch.randn(b, sk, hkv, d, dtype=dtype, device="cuda")
        v = torch.randn(b, sk, hkv, d, dtype=dtype, device="cuda")
        scale = d**-0.5
        ref_o, ref_l = reference(q, k, v, scale, causal, offset)
        if accum:
            o0 = torch.randn(b, sq, h, d, dtype=torch.float32, device="cuda")
            l0 = torch.randn(b, h, sq, dtype=torch.float32, device="cuda")
            l0[:, :, ::7] = float("-inf")
            o0[:, ::7] = 0
            # merged reference
            m = torch.maximum(ref_l, l0.double())
            ms = torch.where(torch.isinf(m), 0.0, m)
            w1, w0 = torch.exp(ref_l - ms), torch.exp(l0.double() - ms)
            t = w1 + w0
            ref_o = (ref_o * w1.transpose(1, 2)[..., None] + o0.double() * w0.transpose(1, 2)[..., None]) / \
                torch.where(t > 0, t, 1.0).transpose(1, 2)[..., None]
            ref_l = torch.where(t > 0, ms + torch.log(torch.where(t > 0, t, 1.0)), float("-inf"))
            outs = {}
            for name in ("tl", "gluon"):
                o, lse = o0.clone(), l0.clone()
                if name == "tl":
                    F._forward_impl(q, k, v, o, lse, softmax_scale=scale, causal=causal, offset=offset, accum=True)
                else:
                    G.hopper_forward(q, k, v, o, lse, softmax_scale=scale, causal=causal, offset=offset, accum=True,
                                     config=G.HopperConfig(bm, pers))
                outs[name] = (o, lse)
        else:
            outs = {}
            for name in ("tl", "gluon"):
                o = torch.full_like(q, float("nan"))
                lse = torch.full((b, h, sq), float("nan"), dtype=torch.float32, device="cuda")
                if name == "tl":
                    F._forward_impl(q, k, v, o, lse, softmax_scale=scale, causal=causal, offset=offset,
                                    accum=False)
                else:
                    G.hopper_forward(q, k, v, o, lse, softmax_scale=scale, causal=causal, offset=offset,
                                     accum=False, config=G.HopperConfig(bm, pers))
                outs[name] = (o, lse)
        torch.cuda.synchronize()
        errs = {}
        for name, (o, lse) in outs.items():
            if torch.isnan(o).any() or torch.isnan(lse).any():
                errs[name] = (float("nan"), float("nan"))
                continue
            if not torch.equal(torch.isinf(lse), torch.isinf(ref_l)):
                errs[name] = (float("inf"), float("inf"))
                continue
            fin = ~torch.isinf(ref_l)
            e_o = ((o.double() - ref_o).abs().max() / ref_o.abs().max().clamp_min(1e-30)).item()
            e_l = (lse.double()[fin] - ref_l[fin]).abs().max().item() if fin.any() else 0.0
            errs[name] = (e_o, e_l)
        ok = all(math.isfinite(x) for x in errs["gluon"]) and errs["gluon"][0] <= 2 * errs["tl"][0] + 1e-3 and \
            errs["gluon"][1] <= 2 * errs["tl"][1] + 1e-3
        line = f"{variant} {(b, sq, sk, h, hkv, d, causal, offset, accum)} tl {errs['tl']} gluon {errs['gluon']}"
        print(("ok   " if ok else "FAIL ") + line, flush=True)
        if not ok:
            fails.append(line)
    return fails


def time_variants(shapes, variants, dtype=torch.bfloat16) -> list[dict]:
    from ringlse.kernels import attention_fwd as F
    from ringlse.kernels import attention_fwd_hopper as G
    from torch.nn.attention import SDPBackend

    rows = []
    for b, h, s, d in shapes:
        for causal in (False, True):
            n = _n_sets(b, h, s, d, dtype)
            sets = _make_sets(b, h, s, d, dtype, n)
            scale = d**-0.5
            o = torch.empty_like(sets[0][0])
            lse = torch.empty(b, h, s, dtype=torch.float32, device="cuda")
            acc = torch.zeros(b, s, h, d, dtype=torch.float32, device="cuda")
            lacc = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device="cuda")
            flop = attn_flops(b, h, s, s, d, causal)
            row = {"batch": b, "heads": h, "seqlen": s, "head_dim": d, "causal": causal, "fwd_flop": flop}
            row["tl_ms"] = _bench(lambda i: F._forward_impl(sets[i][0], sets[i][1], sets[i][2], o, lse,
                                                            softmax_scale=scale, causal=causal, offset=0,
                                                            accum=False), n)
            for name in variants:
                bm, pers = VARIANTS[name]
                if bm > 128 and d > 64:
                    continue
                try:
                    row[f"{name}_ms"] = _bench(lambda i: G.hopper_forward(
                        sets[i][0], sets[i][1], sets[i][2], o, lse, softmax_scale=scale, causal=causal, offset=0,
                        accum=False, config=G.HopperConfig(bm, pers)), n)
                    row[f"{name}_merge_ms"] = _bench(lambda i: G.hopper_forward(
                        sets[i][0], sets[i][1], sets[i][2], acc, lacc, softmax_scale=scale, causal=causal,
                        offset=0, accum=True, config=G.HopperConfig(bm, pers)), n)
                except Exception as err:  # a variant that does not compile or fit: recorded, not fatal
                    row[f"{name}_error"] = repr(err)[:300]
            row["cudnn_ms"] = time_sdpa(b, h, s, d, causal, SDPBackend.CUDNN_ATTENTION)["fwd"]
            for key in [k for k in row if k.endswith("_ms")]:
                row[key.replace("_ms", "_tflops")] = flop / row[key] / 1e9
            line = " ".join(f"{k[:-7]} {v:5.0f}" for k, v in row.items() if k.endswith("_tflops"))
            print(f"{(b, h, s, d, causal)} {line}", flush=True)
            rows.append(row)
    return rows


def time_masks(variants, seqlen: int = 32768, dtype=torch.bfloat16) -> list[dict]:
    """Interval masks (masked_attention.py's inputs: b1 h32 d128, S 32K, causal), each variant checked
    against the Triton kernel on the same inputs and timed; TFLOP/s over visible pairs."""
    from masked_attention import inputs, visible_pairs
    from ringlse.kernels import attention_fwd as F
    from ringlse.kernels import attention_fwd_hopper as G
    from ringlse.masks import Span, block_intervals

    b, h, d, s = 1, 32, 128, seqlen
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
    scale = d**-0.5
    o = torch.empty_like(q)
    lse = torch.empty(b, h, s, dtype=torch.float32, device="cuda")
    rows = []
    rules = dict(inputs(s))
    rules["causal as intervals"] = None  # the dense causal pattern through the interval path
    for name, rule in rules.items():
        if rule is None:
            pos = torch.arange(s, device=q.device, dtype=torch.int32)
            flop = 4 * b * h * d * s * (s + 1) // 2
            kw = dict(causal=False, key_lo=torch.zeros_like(pos), key_hi=pos + 1)
        elif rule.plain:
            flop = 4 * b * h * d * visible_pairs(rule, s)
            kw = dict(causal=True)
        else:
            flop = 4 * b * h * d * visible_pairs(rule, s)
            iv = block_intervals(rule, Span(0, s), Span(0, s), q.device)
            kw = dict(causal=False, key_lo=iv.key_lo.contiguous(), key_hi=iv.key_hi.contiguous())
        F._forward_impl(q, k, v, o, lse, softmax_scale=scale, offset=0, accum=False, **kw)
        ref_o, ref_l = o.float().clone(), lse.clone()
        row = {"input": name, "fwd_flop": flop,
               "tl_ms": _bench(lambda i: F._forward_impl(q, k, v, o, lse, softmax_scale=scale, offset=0, accum=False,
                                                         **kw), 1)}
        for vname in variants:
            bm, pers = VARIANTS[vname]
            if bm > 128:
                continue
            o.fill_(float("nan"))
            G.hopper_forward(q, k, v, o, lse, softmax_scale=scale, offset=0, accum=False,
                             config=G.HopperConfig(bm, pers), **kw)
            row[f"{vname}_diff_vs_tl"] = max((o.float() - ref_o).abs().max().item(),
                                             (lse - ref_l).nan_to_num(0.0).abs().max().item())
            row[f"{vname}_ms"] = _bench(lambda i: G.hopper_forward(
                q, k, v, o, lse, softmax_scale=scale, offset=0, accum=False, config=G.HopperConfig(bm, pers), **kw), 1)
        for key in [k_ for k_ in row if k_.endswith("_ms")]:
            row[key.replace("_ms", "_tflops")] = flop / row[key] / 1e9
        print(name, " ".join(f"{k_[:-7]} {v_:5.0f}" for k_, v_ in row.items() if k_.endswith("_tflops")),
              " ".join(f"{k_}={v_:.3g}" for k_, v_ in row.items() if k_.endswith("_diff_vs_tl")), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--masks", action="store_true", help="also time the interval masks of masked_attention.py")
    args = ap.parse_args()
    import triton

    fails = []
    for name in args.variants:
        fails += check(name)
    shapes = [(2, 16, 8192, 128), (2, 16, 8192, 64)] if args.quick else \
        [(2, 16, 8192, 128), (1, 32, 16384, 128), (2, 16, 8192, 64), (1, 32, 16384, 64), (1, 32, 32768, 64)]
    rows = time_variants(shapes, args.variants)
    mask_rows = time_masks(args.variants) if args.masks else []
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "command": " ".join(sys.argv), "variants": VARIANTS,
              "check_failures": fails, "rows": rows,
              "mask_rows": mask_rows}
    if args.out:
        save_result(args.out, "hopper_fwd_probe", result)
    print("check failures:", len(fails))


if __name__ == "__main__":
    main()
