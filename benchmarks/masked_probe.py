"""Probe of the interval-mask kernels (windows, packed documents) on one H100/H200: where the masked
forward and backward lose against our dense causal, and which launch variants win.

For each of masked_attention.py's inputs (b1 h32 d128 bf16, S 32K) and two plain causal batches with the
same visible pairs as the packed documents (b8 x 4K, b64 x 512: what the documents would cost as a
batch), in one process: the forward per Gluon variant (one program per tile / persistent), the dk/dv and
the dq kernels timed apart (the launchers' choice: Gluon dk/dv, both adding their tiles through TMA; the
Triton kernels; both with a load, add and store), each variant's results compared with the default's.
Then dense blocks (issue 32's shapes): the whole backward both ways next to cuDNN's. TFLOP/s over
visible pairs (4 * h * d * pairs forward; dk/dv 4 GEMMs and dq 3 of the 5).

Usage (on a GPU): python benchmarks/masked_probe.py [--out DIR] [--seqlen S]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from block_attention import _bench, save_result, time_sdpa  # noqa: E402
from masked_attention import inputs, visible_pairs  # noqa: E402

# persistent programs lost to one program per tile on the masks (session 25, H100: 8 documents 2.39 vs
# 2.12 ms, 64 of 512 0.80 vs 0.64; a walk rotating each program's place per round, since reverted, won
# 1-5% on windows and 8 documents and lost 11% on log-uniform ones): benchmarks/NOTES.md
FWD_VARIANTS = {"m128": (128, False), "m128-P": (128, True)}
BWD_CONFIGS = {  # kv_block_n, kv_block_m, kv_warps, kv_stages, q_block_m, q_block_n, q_warps, q_stages
    "default": None,  # sm_90: the Gluon dk/dv kernel; dq the Triton kernel's first config
    "triton": (128, 64, 8, 3, 128, 64, 8, 3),  # both Triton kernels (smaller tiles lost: NOTES.md)
}


def cases(s: int) -> list[tuple[str, int, int, dict]]:
    """(name, batch, seqlen, mask kwargs) with the intervals on the GPU."""
    from ringlse.masks import Span, block_intervals

    out = []
    for name, rule in inputs(s).items():
        if rule.plain:
            out.append((name, 1, s, dict(causal=True), visible_pairs(rule, s)))
            continue
        iv = block_intervals(rule, Span(0, s), Span(0, s), "cuda")
        out.append((name, 1, s, dict(causal=False, key_lo=iv.key_lo.contiguous(), key_hi=iv.key_hi.contiguous(),
                                     query_lo=iv.query_lo.contiguous(), query_hi=iv.query_hi.contiguous()),
                    visible_pairs(rule, s)))
    for n in (8, 64):
        out.append((f"batch {n} x {s // n} causal", n, s // n, dict(causal=True), n * (s // n) * (s // n + 1) // 2))
    return out


def dense_rows() -> list[dict]:
    """Dense blocks (issue 32's shapes): the backward's kernels with their tiles added through TMA and
    through a load, add and store (forced by accumulators TMA cannot index: rows padded by 4 floats),
    next to cuDNN's backward in the same process."""
    from torch.nn.attention import SDPBackend

    from ringlse.kernels import attention_bwd as B
    from ringlse.kernels import attention_fwd as F

    rows = []
    for b, h, s, d in ((2, 16, 8192, 128), (2, 16, 8192, 64), (1, 32, 16384, 128)):
        for causal in (False, True):
            q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            scale = d**-0.5
            out, lse = F.attention_forward(q, k, v, softmax_scale=scale, causal=causal, q_start=0, k_start=0)
            delta = B.attention_delta(do, out)
            plain = [torch.zeros(b, s, h, d, device="cuda") for _ in range(3)]
            padded = [torch.zeros(b, s, h, d + 4, device="cuda")[..., :d] for _ in range(3)]
            kw = dict(qk_scale=scale * 1.4426950408889634, dq_scale=scale, dk_scale=scale, causal=causal, offset=0)
            fl = 4.0 * b * h * s * s * d / (2 if causal else 1) * 2.5
            row = {"batch": b, "heads": h, "seqlen": s, "head_dim": d, "causal": causal, "bwd_flop": fl}
            for name, accs, red in (("rmw", padded, False), ("tma", plain, True)):
                row[f"bwd_{name}_ms"] = _bench(lambda i, a=accs, r=red: B._backward_impl(
                    do, q, k, v, lse, delta, *a, dq_reduce=r, **kw), 1)
            row["cudnn_bwd_ms"] = time_sdpa(b, h, s, d, causal, SDPBackend.CUDNN_ATTENTION)["bwd"]
            for name in ("rmw", "tma"):
                row[f"bwd_{name}_vs_cudnn"] = row["cudnn_bwd_ms"] / row[f"bwd_{name}_ms"]
            print((b, h, s, d, causal), " ".join(f"{k_}={v_:.4g}" for k_, v_ in row.items()
                                                 if k_.endswith(("_ms", "_cudnn"))), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--seqlen", type=int, default=32768)
    args = ap.parse_args()
    import triton

    from ringlse.kernels import attention_bwd as B
    from ringlse.kernels import attention_fwd as F
    from ringlse.kernels import attention_fwd_hopper as G
    from ringlse.kernels.attention_common import BwdConfig

    h, d = 32, 128
    scale = d**-0.5
    qk = scale * 1.4426950408889634
    rows = []
    for name, b, s, mask, pairs in cases(args.seqlen):
        q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        fwd_mask = {key: val for key, val in mask.items() if key in ("causal", "key_lo", "key_hi")}
        bwd_mask = dict(mask)
        o = torch.empty_like(q)
        lse = torch.empty(b, h, s, dtype=torch.float32, device="cuda")
        fl = 4.0 * h * d * pairs
        row = {"input": name, "batch": b, "seqlen": s, "visible_pairs": pairs, "fwd_flop": fl}
        ref = None
        for vname, (bm, pers) in FWD_VARIANTS.items():
            def fwd(_i, bm=bm, pers=pers):
                G.hopper_forward(q, k, v, o, lse, softmax_scale=scale, offset=0, accum=False,
                                 config=G.HopperConfig(bm, pers), **fwd_mask)
            fwd(0)
            got = (o.float().clone(), lse.clone())
            if ref is None:
                ref = got
            else:
                row[f"fwd_{vname}_diff"] = max((got[0] - ref[0]).abs().max().item(),
                                               (got[1] - ref[1]).nan_to_num(0.0).abs().max().item())
            row[f"fwd_{vname}_ms"] = _bench(fwd, 1)
            row[f"fwd_{vname}_tflops"] = fl / row[f"fwd_{vname}_ms"] / 1e9
        F._forward_impl(q, k, v, o, lse, softmax_scale=scale, offset=0, accum=False, **fwd_mask)
        delta = B.attention_delta(do, o)
        dq = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
        dk, dv = torch.zeros_like(dq), torch.zeros_like(dq)
        base = None
        for cname, cfg in BWD_CONFIGS.items():
            config = None if cfg is None else BwdConfig(*cfg)
            # the Triton configs add dq by a load, add and store, as before the TMA add (their label)
            kw = dict(qk_scale=qk, dq_scale=scale, dk_scale=scale, offset=0, config=config,
                      dq_reduce=None if cfg is None else False, **bwd_mask)

            def dkdv(_i, kw=kw):
                B._backward_impl(do, q, k, v, lse, delta, None, dk, dv, **kw)

            def dqk(_i, kw=kw):
                B._backward_impl(do, q, k, v, lse, delta, dq, None, None, **kw)
            try:
                for t in (dq, dk, dv):
                    t.zero_()
                dkdv(0)
                dqk(0)
                got = (dq.clone(), dk.clone(), dv.clone())
                if base is None:
                    base = got
                else:
                    row[f"bwd_{cname}_diff"] = max((x - y).abs().max().item() for x, y in zip(got, base))
                row[f"dkdv_{cname}_ms"] = _bench(dkdv, 1)
                row[f"dq_{cname}_ms"] = _bench(dqk, 1)
                row[f"dkdv_{cname}_tflops"] = 2 * fl / row[f"dkdv_{cname}_ms"] / 1e9
                row[f"dq_{cname}_tflops"] = 1.5 * fl / row[f"dq_{cname}_ms"] / 1e9
            except Exception as e:  # a config that does not fit is recorded
                row[f"bwd_{cname}_error"] = str(e).splitlines()[0][:200]
        # the launchers add the tiles through TMA (dk/dv and dq); against a load, add and store: dq forced,
        # dk/dv through accumulators TMA cannot index (rows padded by 4 floats), into the same nonzero values
        start = [torch.randn_like(t) for t in (dq, dk, dv)]
        padded = [torch.zeros(b, s, h, d + 4, device="cuda")[..., :d] for _ in range(3)]
        for t, t0 in zip((dq, dk, dv), start):
            t.copy_(t0)
        B._backward_impl(do, q, k, v, lse, delta, dq, dk, dv, qk_scale=qk, dq_scale=scale, dk_scale=scale,
                         offset=0, **bwd_mask)
        for t, t0 in zip(padded, start):
            t.copy_(t0)

        def rmw(_i, dkdv: bool):
            B._backward_impl(do, q, k, v, lse, delta, None if dkdv else padded[0], *(padded[1:] if dkdv else (None, None)),
                             qk_scale=qk, dq_scale=scale, dk_scale=scale, offset=0, dq_reduce=False, **bwd_mask)
        rmw(0, True)
        rmw(0, False)
        row["tma_vs_rmw_diff"] = max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip((dq, dk, dv), padded))
        row["dkdv_rmw_ms"] = _bench(lambda i: rmw(i, True), 1)
        row["dq_rmw_ms"] = _bench(lambda i: rmw(i, False), 1)
        rows.append(row)
        print(name, " ".join(f"{key}={val:.4g}" for key, val in row.items()
                             if key.endswith(("_ms", "_diff"))), flush=True)
    dense = rows[0]
    for row in rows:
        for key in [k_ for k_ in row if k_.endswith("_tflops")]:
            row[key.replace("_tflops", "_vs_dense")] = row[key] / dense[key]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "command": " ".join(sys.argv), "fwd_variants": FWD_VARIANTS,
              "bwd_configs": BWD_CONFIGS, "rows": rows, "dense_rows": dense_rows()}
    if args.out:
        print(save_result(args.out, "masked_probe", result))


if __name__ == "__main__":
    main()
