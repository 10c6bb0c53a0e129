"""What the interval-mask path of the Hopper backward costs per step: a dense causal block (b1 h32 d128
bf16, S 8K and 32K) through the causal kernel and through the interval kernel with the same visibility
(key j seen by the queries `[j, S)`: the same walks, the same masked tiles), in one process, dk/dv with
dq fused. Then copies of the installed kernel with parts of the interval path taken out (source edits in
temporary modules; timing only, their gradients are not checked), to see which part costs: the mask of
the masked steps (`mask`), the final reset of keys no query sees with the keys' bounds it loads (`live`),
the consumers', loader's and writers' interval walks replaced by the causal ones (`cwalk`, `lwalk`,
`wwalk`; right for this input only). The forward both ways too. TFLOP/s over the visible pairs.

Usage (on a GPU): python benchmarks/interval_cost_probe.py [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from block_attention import _bench, save_result  # noqa: E402
from fused_dq_ab import variant_module  # noqa: E402

_CONSUMER_WALK = ("_key_tile(walk, BM, BN, CAUSAL, INTERVALS,\n" + " " * 79 + "FUSED)\n    k_rows")
_LOADER_WALK = ("_key_tile(walk, BM, BN, CAUSAL, INTERVALS,\n" + " " * 79 + "FUSED)\n    mbarrier.expect")
_WRITER_WALK = "_key_tile(walk, BM, BN, CAUSAL, INTERVALS,\n" + " " * 79 + "True)"
EDITS = {
    "mask": [("""            if INTERVALS:
                if (start_m < full_lo) | (start_m + BM > full_hi):
                    pt = gl.where((offs_m[None, :] >= col_lo[:, None]) & (offs_m[None, :] < col_hi[:, None]), pt, 0.0)
""", "")],
    "live": [("        dk = gl.where(live[:, None], dk, 0.0)\n        dv = gl.where(live[:, None], dv, 0.0)\n", "")],
    "cwalk": [(_CONSUMER_WALK, _CONSUMER_WALK.replace("CAUSAL, INTERVALS", "True, False"))],
    "lwalk": [(_LOADER_WALK, _LOADER_WALK.replace("CAUSAL, INTERVALS", "True, False"))],
    "wwalk": [(_WRITER_WALK, _WRITER_WALK.replace("CAUSAL, INTERVALS", "True, False")),
              ("_key_walk(n0 + BN, walk, BM, BN, CAUSAL, INTERVALS)", "_key_walk(n0 + BN, walk, BM, BN, True, False)")],
}
VARIANTS = ("mask", "mask+live", "mask+live+cwalk", "mask+live+cwalk+lwalk", "mask+live+cwalk+lwalk+wwalk",
            "cwalk+lwalk+wwalk")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import triton

    from ringlse.kernels import attention_bwd as B
    from ringlse.kernels import attention_bwd_hopper as G
    from ringlse.kernels import attention_fwd as F
    from ringlse.kernels import attention_fwd_hopper as H

    mods = {"installed": G}
    for name in VARIANTS:
        edits = [e for part in name.split("+") for e in EDITS[part]]
        mods[name] = variant_module(G.__file__, f"attention_bwd_hopper_no_{name.replace('+', '_')}", edits)
    rows = []
    for s in (8192, 32768):
        b, h, d = 1, 32, 128
        g = torch.Generator(device="cuda").manual_seed(s)
        q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        scale = d**-0.5
        ar = torch.arange(s, device="cuda", dtype=torch.int32)
        key_iv = dict(key_lo=torch.zeros_like(ar), key_hi=ar + 1)
        query_iv = dict(query_lo=ar.clone(), query_hi=torch.full_like(ar, s))
        out, lse = F.attention_forward(q, k, v, softmax_scale=scale, causal=True, q_start=0, k_start=0)
        delta = B.attention_delta(do, out)
        o, lse_o = torch.empty_like(q), torch.empty_like(lse)
        fns = {"fwd causal": lambda _i: H.hopper_forward(q, k, v, o, lse_o, softmax_scale=scale, causal=True,
                                                         offset=0, accum=False),
               "fwd intervals": lambda _i: H.hopper_forward(q, k, v, o, lse_o, softmax_scale=scale, causal=False,
                                                            offset=0, accum=False, **key_iv)}
        accs = [torch.zeros(t.shape, device="cuda") for t in (q, k, v)]
        common = dict(dq_acc=accs[0], dq_scale=scale, qk_scale=scale * F.LOG2E, dk_scale=scale, offset=0)
        fns["bwd causal"] = lambda _i: G.hopper_dkdv(do, q, k, v, lse, delta, accs[1], accs[2], causal=True, **common)
        for name, mod in mods.items():
            fns[f"bwd intervals {name}"] = (lambda _i, mod=mod: mod.hopper_dkdv(
                do, q, k, v, lse, delta, accs[1], accs[2], causal=False, **query_iv, **common))
        for fn in fns.values():
            fn(0)
        torch.cuda.synchronize()
        ms = {name: min(_bench(fn, 1) for _ in range(2)) for name, fn in fns.items()}
        flop = 4.0 * h * d * s * (s + 1) / 2
        row = {"seqlen": s, "batch": b, "heads": h, "head_dim": d, "ms": ms,
               "tflops": {name: flop * (2.5 if name.startswith("bwd") else 1.0) / t / 1e9 for name, t in ms.items()}}
        rows.append(row)
        print(s, {name: round(x, 1) for name, x in row["tflops"].items()}, flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "command": " ".join(sys.argv), "variants": list(VARIANTS),
              "rows": rows}
    if args.out:
        print(save_result(args.out, "interval_cost_probe", result))


if __name__ == "__main__":
    main()
