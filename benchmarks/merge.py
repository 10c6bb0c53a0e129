"""Fused merge bandwidth against the device copy and the eager PyTorch merge (CONVENTIONS.md §8, §9).

For each shape: the in-place `update_out_and_lse(..., inplace=True)` (fused Triton kernel), the eager
PyTorch merge (`ringlse.merge_states._MergeStates`, what `update_out_and_lse` runs without the kernel), and a
device copy `dst.copy_(src)` of a 1 GiB buffer as the bandwidth ceiling. Bytes counted (CONVENTIONS.md §9):
read state out (fp32) + block out + state lse + block lse, write state out + state lse.
Times are `triton.testing.do_bench` medians (it flushes L2 before each run; every state here is
larger than L2 anyway). The main shape also gets a sweep of launch configurations.

Usage: python benchmarks/merge.py [--out DIR]   (writes DIR/merge-<gpu>.json, default benchmarks/results)
       python benchmarks/merge.py --engines --out FILE.json [--plot FILE.png]   (the engines' conventions:
       benchmarks/merge_engines.py)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch
import triton
from triton.testing import do_bench

from ringlse.kernels import merge as km
from ringlse.merge_states import _MergeStates, merge_attn_states, update_out_and_lse

MAIN = ((1, 32768, 32, 128), torch.bfloat16)
SHAPES = [
    MAIN,
    ((1, 8192, 32, 128), torch.bfloat16),
    ((1, 32768, 32, 128), torch.float32),
    ((2, 16384, 8, 80), torch.float16),
]
SWEEP = [(r, w) for r in (8, 16, 32, 64) for w in (4, 8)]


def _bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def _state(shape, block_dtype):
    b, s, h, d = shape
    out = torch.randn(shape, device="cuda", dtype=torch.float32)
    lse = torch.randn(b, h, s, device="cuda") * 3
    blk = torch.randn(shape, device="cuda", dtype=torch.float32).to(block_dtype)
    blk_lse = torch.randn(b, h, s, device="cuda") * 3
    return out, lse, blk, blk_lse


def _bytes(shape, block_dtype) -> int:
    b, s, h, d = shape
    n, rows = b * s * h * d, b * s * h
    return n * (4 + torch.finfo(block_dtype).bits // 8 + 4) + rows * 4 * 4


def _check(out, lse, blk, blk_lse) -> float:
    """max |kernel - eager| / max |eager| of one in-place merge (the timed kernel must be right)."""
    ref_out, ref_lse = _MergeStates.apply(2, out, blk, lse, blk_lse)
    o, l = out.clone(), lse.clone()
    km.update_state_(o, l, blk, blk_lse)
    err = max((o - ref_out).abs().max().item() / ref_out.abs().max().item(), (l - ref_lse).abs().max().item() / ref_lse.abs().max().item())
    return err


def main() -> None:
    if "--engines" in sys.argv[1:]:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from merge_engines import main as engines_main

        engines_main([a for a in sys.argv[1:] if a != "--engines"])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()

    # the ceiling: a large device copy, bytes read + written
    src = torch.randn(256 * 1024 * 1024, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = _bench(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() * 4 / copy_ms / 1e6
    del src, dst

    rows = []
    for shape, bdt in SHAPES:
        out, lse, blk, blk_lse = _state(shape, bdt)
        err = _check(out, lse, blk, blk_lse)
        nbytes = _bytes(shape, bdt)
        fused_ms = _bench(lambda: update_out_and_lse(out, lse, blk, blk_lse, inplace=True))
        with torch.no_grad():
            eager_ms = _bench(lambda: _MergeStates.apply(2, out, blk, lse, blk_lse))
        rows.append(dict(
            what="update_out_and_lse inplace", shape=list(shape), state_dtype="float32", block_dtype=str(bdt).split(".")[-1],
            bytes=nbytes, max_rel_err_vs_eager=err, config=list(km.default_config(shape[-1], 2)),
            fused_ms=fused_ms, fused_gbs=nbytes / fused_ms / 1e6, eager_ms=eager_ms, eager_gbs=nbytes / eager_ms / 1e6,
            fused_vs_copy=(nbytes / fused_ms / 1e6) / copy_gbs, eager_vs_copy=(nbytes / eager_ms / 1e6) / copy_gbs,
            speedup_vs_eager=eager_ms / fused_ms,
        ))
        del out, lse, blk, blk_lse
        torch.cuda.empty_cache()

    # the ring's case: the state is a strided half of a larger buffer
    shape, bdt = MAIN
    b, s, h, d = shape
    buf = torch.randn(b, 2 * s, h, d, device="cuda")
    lbuf = torch.randn(b, h, 2 * s, device="cuda")
    _, _, blk, blk_lse = _state(shape, bdt)
    view_out, view_lse = buf[:, s:], lbuf[:, :, s:]
    view_ms = _bench(lambda: update_out_and_lse(view_out, view_lse, blk, blk_lse, inplace=True))
    nbytes = _bytes(shape, bdt)
    rows.append(dict(
        what="update_out_and_lse inplace, state = buf[:, S:] view", shape=list(shape), state_dtype="float32",
        block_dtype=str(bdt).split(".")[-1], bytes=nbytes, fused_ms=view_ms, fused_gbs=nbytes / view_ms / 1e6,
        fused_vs_copy=(nbytes / view_ms / 1e6) / copy_gbs,
    ))
    del buf, lbuf

    # launch-configuration sweep on the main shape (raw launcher)
    out, lse, blk, blk_lse = _state(shape, bdt)
    sweep = []
    for block_rows, num_warps in SWEEP:
        ms = _bench(lambda: km.update_state_(out, lse, blk, blk_lse, block_rows=block_rows, num_warps=num_warps))
        sweep.append(dict(block_rows=block_rows, num_warps=num_warps, ms=ms, gbs=nbytes / ms / 1e6,
                          vs_copy=(nbytes / ms / 1e6) / copy_gbs))
    del out, lse

    # N-way merge_attn_states (4 bf16 states -> bf16)
    outs = [torch.randn(shape, device="cuda").to(bdt) for _ in range(4)]
    lses = [torch.randn(b, h, s, device="cuda") for _ in range(4)]
    n_bytes = 4 * (outs[0].numel() * 2 + lses[0].numel() * 4) + outs[0].numel() * 2 + lses[0].numel() * 4
    n_ms = _bench(lambda: merge_attn_states(outs, lses))
    rows.append(dict(what="merge_attn_states N=4 (bf16 -> bf16)", shape=list(shape), bytes=n_bytes, fused_ms=n_ms,
                     fused_gbs=n_bytes / n_ms / 1e6, fused_vs_copy=(n_bytes / n_ms / 1e6) / copy_gbs))

    result = dict(
        gpu=gpu, torch=torch.__version__, triton=triton.__version__, command=" ".join([sys.executable, *sys.argv]),
        date=time.strftime("%Y-%m-%d %H:%M:%S"), timing="triton.testing.do_bench median (warmup 25 ms, rep 200 ms)",
        bytes_counted="read state out fp32 + block out + state lse + block lse; write state out + lse",
        copy=dict(what="dst.copy_(src), 1 GiB fp32", ms=copy_ms, gbs=copy_gbs),
        rows=rows, sweep_main_shape=sweep,
    )
    os.makedirs(args.out, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    path = os.path.join(args.out, f"merge-{slug}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)

    print(f"{gpu}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"device copy: {copy_ms:.3f} ms, {copy_gbs:.0f} GB/s")
    print(f"{'what':<52} {'shape':<22} {'blk':<9} {'fused ms':>9} {'GB/s':>6} {'x copy':>7} {'eager GB/s':>10} {'speedup':>8}")
    for r in rows:
        print(
            f"{r['what']:<52} {str(tuple(r['shape'])):<22} {r.get('block_dtype', ''):<9} {r['fused_ms']:>9.3f} "
            f"{r['fused_gbs']:>6.0f} {r['fused_vs_copy']:>7.3f} {r.get('eager_gbs', float('nan')):>10.0f} "
            f"{r.get('speedup_vs_eager', float('nan')):>8.2f}"
        )
    print("sweep on", MAIN[0], ":", ", ".join(f"({x['block_rows']},{x['num_warps']}) {x['vs_copy']:.3f}" for x in sweep))
    print("wrote", path)


if __name__ == "__main__":
    main()
