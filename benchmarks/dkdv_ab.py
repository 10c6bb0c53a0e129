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
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from block_attention import _bench, save_result  # noqa: E402
from fwd_ab import load_module  # noqa: E402
from masked_probe import cases  # noqa: E402


def all_cases(s: int) -> list[tuple[str, int, int, int, int, dict, int]]:
    """(name, batch, seqlen, heads, head dim, mask kwargs, visible pairs per head)."""
    out = [(name, b, sb, 32, 128, {k_: v_ for k_, v_ in mask.items() if k_ in ("causal", "query_lo", "query_hi")},
            pairs) for name, b, sb, mask, pairs in cases(s)]
    for b, h, sd, d in ((2, 16, 8192, 128), (2, 16, 8192, 64)):
        for causal in (False, True):
            pairs = b * (sd * (sd + 1) // 2 if causal else sd * sd)
            out.append((f"dense b{b} h{h} s{sd} d{d} {'causal' if causal else 'full'}", b, sd, h, d,
                        dict(causal=causal), pairs))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="a former attention_bwd_hopper.py")
    ap.add_argument("--out", default=None)
    ap.add_argument("--seqlen", type=int, default=32768)
    args = ap.parse_args()
    import triton

    from ringlse.kernels import attention_bwd as B
    from ringlse.kernels import attention_bwd_hopper as after
    from ringlse.kernels import attention_fwd as F

    before = load_module(args.before, "attention_bwd_hopper_before")
    rows = []
    for name, b, s, h, d, mask, pairs in all_cases(args.seqlen):
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
        diff = max((x - y).abs().max().item() for x, y in zip(accs["before"], accs["after"]))
        ms = {side: [] for side in fns}
        for _ in range(2):
            for side in fns:
                ms[side].append(_bench(fns[side], 1))
        fl = 2 * 4.0 * h * d * pairs  # dk/dv: 4 of the backward's 5 GEMMs
        row = {"input": name, "batch": b, "seqlen": s, "heads": h, "head_dim": d, "visible_pairs": pairs,
               "max_abs_diff": diff, "before_ms": min(ms["before"]), "after_ms": min(ms["after"]),
               "before_ms_runs": ms["before"], "after_ms_runs": ms["after"]}
        row["before_tflops"] = fl / row["before_ms"] / 1e9
        row["after_tflops"] = fl / row["after_ms"] / 1e9
        row["speedup"] = row["before_ms"] / row["after_ms"]
        rows.append(row)
        print(f"{name:<34} diff {diff:.3g}  before {row['before_tflops']:6.1f}  after {row['after_tflops']:6.1f}"
              f"  x{row['speedup']:.3f}", flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "command": " ".join(sys.argv), "rows": rows}
    if args.out:
        print(save_result(args.out, "dkdv_ab", result))


if __name__ == "__main__":
    main()
