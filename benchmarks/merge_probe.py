"""What the in-kernel merge costs (issue 32: "the merging forward within 3% of the plain one"), measured
two ways on one H100/H200 so that the two benchmarks that report it can be checked against each other:
through the public call (`attention_forward` with and without `out_acc`/`lse_acc`, as
`block_attention.py` times it, the state starting at `(0, -inf)`) and through the Hopper launcher
directly (as `fwd_ab.py --accum` does, a random state), plus the merging forward under the other
launch configurations (persistent programs taking tiles from a counter; one program per tile). And the
first block of a row range as the ring and `chunked_attention` run it: before session 33, zeroed
accumulators (a fill) merged into; now written fresh (`fresh=True`: no fill, no read).
Every function is timed with the launches interleaved (`timing.interleaved_ms`), medians.

Usage (on a GPU): python benchmarks/merge_probe.py [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from block_attention import save_result  # noqa: E402
from timing import interleaved_ms  # noqa: E402

# (batch, heads, kv heads, seqlen, head dim, causal): block_attention's rows where the ratio is largest
SHAPES = ((2, 16, 16, 4096, 128, True), (2, 16, 16, 8192, 128, True), (2, 16, 16, 8192, 128, False),
          (2, 16, 16, 8192, 64, True), (1, 32, 8, 16384, 128, True), (1, 32, 32, 32768, 128, True))


def probe(b: int, h: int, hkv: int, s: int, d: int, causal: bool) -> dict:
    from ringlse.kernels import attention_fwd as F
    from ringlse.kernels import attention_fwd_hopper as H

    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    scale = d**-0.5
    out, lse = torch.empty_like(q), torch.empty(b, h, s, device="cuda")
    empty = (torch.zeros(b, s, h, d, device="cuda"), torch.full((b, h, s), float("-inf"), device="cuda"))
    fresh = (torch.empty(b, s, h, d, device="cuda"), torch.empty(b, h, s, device="cuda"))
    states = {name: (torch.randn(b, s, h, d, device="cuda"), torch.randn(b, h, s, device="cuda"))
              for name in ("launcher", "persistent", "per_tile")}
    public = dict(softmax_scale=scale, causal=causal, q_start=0, k_start=0)
    direct = dict(softmax_scale=scale, causal=causal, offset=0)
    fns = {
        "public_plain": lambda _i: F.attention_forward(q, k, v, **public),
        "public_merge": lambda _i: F.attention_forward(q, k, v, **public, out_acc=empty[0], lse_acc=empty[1]),
        "public_fresh": lambda _i: F.attention_forward(q, k, v, **public, out_acc=fresh[0], lse_acc=fresh[1],
                                                       fresh=True),
        "fill": lambda _i: (empty[0].zero_(), empty[1].fill_(float("-inf"))),
        "launcher_plain": lambda _i: H.hopper_forward(q, k, v, out, lse, **direct, accum=False),
        "launcher_merge": lambda _i: H.hopper_forward(q, k, v, *states["launcher"], **direct, accum=True),
    }
    if d == 128:
        fns["merge_persistent"] = lambda _i: H.hopper_forward(q, k, v, *states["persistent"], **direct, accum=True,
                                                              config=H.HopperConfig(128, True))
        fns["merge_per_tile"] = lambda _i: H.hopper_forward(q, k, v, *states["per_tile"], **direct, accum=True,
                                                            config=H.HopperConfig(128, False))
    best = interleaved_ms(fns)
    row = dict(batch=b, heads=h, kv_heads=hkv, seqlen=s, head_dim=d, causal=causal, ms=best,
               public_merge_ratio=best["public_merge"] / best["public_plain"],
               launcher_merge_ratio=best["launcher_merge"] / best["launcher_plain"],
               # a row range's first block: zeroed accumulators merged into (before), written fresh (now)
               first_block_before_ratio=(best["fill"] + best["public_merge"]) / best["public_plain"],
               first_block_fresh_ratio=best["public_fresh"] / best["public_plain"])
    for name in ("merge_persistent", "merge_per_tile"):
        if name in best:
            row[f"{name}_ratio"] = best[name] / best["launcher_plain"]
    print(f"b{b} h{h}/{hkv} s{s} d{d} causal={causal:d}: " + "  ".join(
        f"{k_[:-6]} {v_:.3f}" for k_, v_ in row.items() if k_.endswith("_ratio")), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    import triton

    rows = [probe(*shape) for shape in SHAPES]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "command": " ".join(sys.argv),
              "ratio": "merging forward time / plain forward time", "rows": rows}
    print(save_result(args.out, "merge_probe", result))


if __name__ == "__main__":
    main()
