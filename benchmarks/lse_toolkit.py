"""LSE toolkit against PyTorch: softmax / log_softmax / logsumexp and the log-semiring bmm (DESIGN §8, §9).

Softmax family, per `rows x cols` (about 64M elements each, so every tensor is several times the L2):
ours (the `ringlse.lse.kernels.softmax` launchers) vs `torch.softmax` / `torch.log_softmax` /
`torch.logsumexp`, forward and backward (PyTorch's backward: the ops its autograd runs, see `_fns`;
neither side pays autograd overhead), as time, GB/s and GB/s over the device copy
bandwidth measured in this same run (`dst.copy_(src)` of 1 GiB, read + write). Bytes counted: forward
softmax/log_softmax read x and write y; logsumexp reads x (and writes one value per row); backward
softmax/log_softmax read y and g and write dx; logsumexp backward reads x and writes dx.

log_bmm: ours vs the naive PyTorch form `(a[:, :, :, None] + b[:, None]).logsumexp(2)`, forward and
backward (naive backward: autograd through the naive form when it fits in memory, else the same per
batch element, summed; the JSON says which), time and peak memory.

Times are `triton.testing.do_bench` medians (it flushes L2 before each run): eager calls, host time
included where it exceeds the flush. The softmax family also gets GPU time (`*_gpu_ms`): 20 calls
captured in one CUDA graph, replayed and timed with CUDA events, cycling over input copies when one
input fits in L2, for both sides; small inputs are launch-bound in eager mode and this column says
what the kernels take. The run tunes first: short
sweeps of the dispatch constants (row-block limit, long-row chunk and warps, split threshold, the
cooperative kernels' pieces, log_bmm tiles) pick the winners, under which the main measurements run
(`config_override` of `ringlse.lse.kernels.softmax` and `ringlse.lse.kernels.log_bmm`); the JSON records them
(`tuned_*`, `variants`, `log_bmm_variants`, and the whole configs measured: `tuning_*`); the committed
constants (`CONFIG`) are those winners.

Usage: python benchmarks/lse_toolkit.py [--out DIR] [--quick] [--skip tune,family,log_bmm] [--no-coop]
    writes DIR/lse_toolkit-<gpu>.json and DIR/lse_toolkit-<gpu>-{softmax,log_bmm}.png; --quick: the
    committed constants (no sweeps), float32 cases and three log_bmm sizes only

On one H200 a full run takes about 2 minutes after the kernels compile.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
import time

import torch
import triton
from triton.testing import do_bench

from ringlse.lse.kernels import log_bmm as kl
from ringlse.lse.kernels import softmax as ks

# DESIGN §9, one H200, torch 2.11, triton 3.6
PEER_FIGURES = {
    "copy_TBps": 4.27,
    "torch_softmax_fp32_fwd_TBps": [2.0, 2.7],
    "torch_softmax_fp32_bwd_TBps": [1.7, 1.9],
    "torch_logsumexp_fp32_TBps": [0.44, 0.60],
    "naive_log_bmm_8x1024x1024x1024_fp32": {"ms": 78, "peak_GB": 66},
}
BARS = {
    "softmax_fwd_vs_copy": 0.85,
    "softmax_bf16_fwd_vs_copy": 0.82,  # (lower: each output is rounded once from float32)
    "softmax_fwd_vs_torch": 1.3,
    "softmax_bwd_vs_torch": 1.2,
    "logsumexp_vs_torch": 4.0,
    "log_bmm_fwd_vs_naive": 20.0,
    "log_bmm_bwd_vs_naive": 20.0,
    "log_bmm_peak_vs_io": 2.0,
}

# the cooperative kernels for no row count (the two-pass kernels take their rows)
NO_COOP = {"coop_min_rows": 1 << 62, "coop_min_elems_fwd": 1 << 62}
COOP_ON = {"coop_min_rows": ks.CONFIG.coop_min_rows, "coop_min_elems_fwd": ks.CONFIG.coop_min_elems_fwd}

TOTAL = 1 << 26  # elements per softmax case
COLS = [1024, 4096, 16384, 32768, 65536, 131072, 1 << 20]
EXTRA = [(4, 1 << 20, torch.float32), (8, 131072, torch.float32), (16384, 4096, torch.bfloat16),
         (512, 131072, torch.bfloat16), (1 << 20, 97, torch.float32), (2048, 32768, torch.bfloat16),
         (32, 1 << 21, torch.float32),
         # rows off 16-byte boundaries (odd lengths; 50257: GPT-2's vocabulary)
         (1300, 50257, torch.float32), (1300, 50257, torch.bfloat16), (16384, 4097, torch.float32),
         (16384, 4097, torch.bfloat16), (4096, 16383, torch.bfloat16)]
LOG_BMM = [(8, 1024, 1024, 1024), (8, 512, 512, 512), (4, 256, 256, 256), (2, 97, 1000, 130)]


def bench(fn, rep: int = 100) -> float:
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def graph_ms(fns: list, calls: int = 20) -> float:
    """GPU time per call (ms): `calls` calls cycling over `fns` (one closure per input copy, so that
    inputs that fit in L2 are rotated) captured in one CUDA graph, replayed, timed with CUDA events.
    No host time: small inputs are launch-bound in eager mode (the `ms` columns), this says what the
    kernels themselves take."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (allocator, lazy inits)
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    n = max(calls, len(fns))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for k in range(n):
            fns[k % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n)
    del graph
    return sorted(times)[len(times) // 2]


def peak_gb(fn) -> float:
    """Peak device memory allocated while `fn` runs, above what was allocated before (GB)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def copy_gbps() -> float:
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), rep=200)
    return 2 * src.numel() * 4 / ms / 1e6


# ----------------------------------------------------------------------------------------------------
# softmax family

def _fns(op: str, x: torch.Tensor):
    """(ours fwd, ours bwd, torch fwd, torch bwd) closures for `op` on `x`: the launchers without
    autograd on our side, and on PyTorch's the ops its autograd runs (aten `_softmax_backward_data` /
    `_log_softmax_backward_data`, and for logsumexp its eager formula `g * exp(x - lse)`)."""
    dt = x.dtype
    if op == "logsumexp":
        lse = ks.logsumexp_forward(x)
        tl_ = torch.logsumexp(x, -1)
        g = torch.randn_like(tl_)
        return (
            lambda: ks.logsumexp_forward(x),
            lambda: ks.logsumexp_backward(x, lse, g),
            lambda: torch.logsumexp(x, -1),
            lambda: g.unsqueeze(-1) * (x - tl_.unsqueeze(-1)).exp(),
        )
    log = op == "log_softmax"
    y = ks.softmax_forward(x, log=log)
    ty = torch.log_softmax(x, -1) if log else torch.softmax(x, -1)
    g = torch.randn_like(y)
    tbwd = torch.ops.aten._log_softmax_backward_data if log else torch.ops.aten._softmax_backward_data
    return (
        lambda: ks.softmax_forward(x, log=log),
        lambda: ks.softmax_backward(y, g, log=log),
        (lambda: torch.log_softmax(x, -1)) if log else (lambda: torch.softmax(x, -1)),
        lambda: tbwd(g, ty, -1, dt),
    )


def family_case(rows: int, cols: int, dtype: torch.dtype, copy: float) -> list[dict]:
    x = torch.randn(rows, cols, device="cuda", dtype=dtype) * 3
    es = x.element_size()
    n = rows * cols
    records = []
    for op in ("softmax", "log_softmax", "logsumexp"):
        rec = {"op": op, "rows": rows, "cols": cols, "dtype": str(dtype).split(".")[-1]}
        fwd_bytes = 2 * n * es if op != "logsumexp" else n * es + rows * es
        bwd_bytes = 3 * n * es if op != "logsumexp" else 2 * n * es
        ours_f, ours_b, torch_f, torch_b = _fns(op, x)
        ref = torch_f().float()
        finite = torch.isfinite(ref)
        rec["fwd_max_abs_err_vs_torch"] = (ours_f().float() - ref)[finite].abs().max().item()
        rec["bwd_max_abs_err_vs_torch"] = (ours_b().float() - torch_b().float()).abs().max().item()
        del ref, finite
        # graph replay over enough input copies to outgrow L2 (100 MB) when one input fits in it
        copies = [x] + [x.clone() for _ in range(min(15, -(-100_000_000 // (n * es)) - 1))]
        closures = [_fns(op, xc) for xc in copies]
        for idx, (who, f, b) in enumerate((("ours", ours_f, ours_b), ("torch", torch_f, torch_b))):
            f_ms, b_ms = bench(f), bench(b)
            f_gpu = graph_ms([c[2 * idx] for c in closures])
            b_gpu = graph_ms([c[2 * idx + 1] for c in closures])
            rec[who] = {
                "fwd_ms": f_ms, "bwd_ms": b_ms, "fwd_gpu_ms": f_gpu, "bwd_gpu_ms": b_gpu,
                "fwd_GBps": fwd_bytes / f_ms / 1e6, "bwd_GBps": bwd_bytes / b_ms / 1e6,
                "fwd_vs_copy": fwd_bytes / f_ms / 1e6 / copy, "bwd_vs_copy": bwd_bytes / b_ms / 1e6 / copy,
                "fwd_peak_GB": peak_gb(f), "bwd_peak_GB": peak_gb(b),
            }
        rec["fwd_speedup"] = rec["torch"]["fwd_ms"] / rec["ours"]["fwd_ms"]
        rec["bwd_speedup"] = rec["torch"]["bwd_ms"] / rec["ours"]["bwd_ms"]
        rec["fwd_gpu_speedup"] = rec["torch"]["fwd_gpu_ms"] / rec["ours"]["fwd_gpu_ms"]
        rec["bwd_gpu_speedup"] = rec["torch"]["bwd_gpu_ms"] / rec["ours"]["bwd_gpu_ms"]
        records.append(rec)
        del ours_f, ours_b, torch_f, torch_b, closures, copies
    return records


def _time_knobs(knobs: dict, cases: list[tuple[int, int]], what: str, dtype: torch.dtype = torch.float32,
                base: dict | None = None) -> dict:
    """GPU ms (`graph_ms`) of `what` (fwd: softmax forward; bwd: softmax backward; both: their sum;
    lse: logsumexp forward; fwd+lse: softmax and logsumexp forward) per `dtype` case with the config's
    fields `base` and then `knobs` replaced (`config_override`). GPU time, not eager time: a small
    case's eager time can be its host time, and one slow host call once picked the wrong chunk size for
    every few-row launch (4x1M: 19 -> 49 us in one sweep)."""
    rec = {"knobs": knobs, "what": what, "dtype": str(dtype), "ms": {}, "timing": "graph_ms"}
    try:
        with ks.config_override(**{**(base or {}), **knobs}):
            for rows, cols in cases:
                # enough input copies to outgrow L2 (100 MB) when one input fits in it, as in family_case
                n_copies = min(16, -(-100_000_000 // (rows * cols * dtype.itemsize)))
                xs = [torch.randn(rows, cols, device="cuda", dtype=dtype) * 3 for _ in range(n_copies)]
                fwd = [lambda x=x: ks.softmax_forward(x) for x in xs]
                lse = [lambda x=x: ks.logsumexp_forward(x) for x in xs]
                if what == "lse":
                    ms = graph_ms(lse)
                elif what == "fwd":
                    ms = graph_ms(fwd)
                elif what == "fwd+lse":
                    ms = graph_ms(fwd) + graph_ms(lse)
                else:
                    ys = [ks.softmax_forward(x) for x in xs]
                    ms = graph_ms([lambda y=y, g=torch.randn_like(y): ks.softmax_backward(y, g) for y in ys])
                    if what == "both":
                        ms += graph_ms(fwd)
                rec["ms"][f"{rows}x{cols}"] = ms
                del xs, fwd
        rec["total_ms"] = sum(rec["ms"].values())
    except Exception as e:  # a variant that does not compile or fit is data too
        rec["error"] = repr(e)[:300]
        rec["total_ms"] = float("inf")
    print(f"  variant {what} {knobs}: {rec['ms']} total {rec['total_ms']:.4g} ms", flush=True)
    return rec


def tune_softmax(coop: bool = True) -> tuple[dict, list[dict], dict]:
    """Pick the dispatch constants from a small sweep (fp32, 64M-element cases): returns the winners,
    the sweep's records, and the fields to override for the main measurements (the winners, and with
    `coop` off the cooperative kernels off too)."""
    log = []
    chosen = {}
    # the base paths first, without the cooperative kernels; those are then compared with their winners
    applied = dict(NO_COOP)

    def pick(group, variants, cases, what, dtype=torch.float32):
        recs = [_time_knobs(k, cases, what, dtype, base=applied) for k in variants]
        log.extend(dict(r, group=group) for r in recs)
        best = min(recs, key=lambda r: r["total_ms"])
        chosen.update(best["knobs"])
        applied.update(best["knobs"])

    mid = [(TOTAL // 16384, 16384), (TOTAL // 32768, 32768)]
    pick("row block (fwd)", [{"max_row_block": v} for v in (8192, 16384, 32768)], mid, "fwd")
    long = [(TOTAL // 131072, 131072), (TOTAL // (1 << 20), 1 << 20), (4, 1 << 20)]
    pick("long-row chunk (fwd)", [{"chunk": c, "chunk_warps": w} for c, w in ((2048, 4), (4096, 8), (8192, 8), (8192, 16))],
         long, "fwd")
    pick("split threshold (fwd)", [{"split_rows": v} for v in (None, 64, 1 << 30)], long[:2], "fwd")
    # the cooperative kernels apply to many rows (>= coop_min_rows): few-row cases would only add their
    # timing noise there
    coop_cases = [(TOTAL // 65536, 65536), (TOTAL // 131072, 131072), (TOTAL >> 20, 1 << 20)]
    if coop:  # last: the other knobs are what it is compared with (NO_COOP: none of them)
        for which in ("fwd", "bwd"):
            pick(f"cooperative long rows ({which})",
                 [NO_COOP] + [{**COOP_ON, f"coop_piece_{which}": p, f"coop_warps_{which}": w}
                              for p, w in ((1024, 2), (2048, 4), (4096, 4), (4096, 8))],
                 coop_cases, which)
        # the plan for rows that fit once in flight with the pieces above (`_coop_launch`); rows of 2M
        # too: uncapped, their 512 pieces are more programs than the GPU holds at once, so they leave
        # the cooperative kernel (H200, 32 x 2M: 0.90 -> 0.59x copy), which 64 x 1M alone, where the
        # variants tie, does not show
        pick("cooperative, rows of 1M (fwd)",
             [{"coop_piece_fwd_long": p, "coop_warps_fwd_long": w, "coop_maxnreg_fwd_long": r}
              for p, w, r in ((4096, 4, 128), (8192, 8, 128), (4096, 4, None))],
             coop_cases[2:] + [(TOTAL >> 21, 1 << 21)], "fwd")
        # 2-byte rows, read as pairs: the register cap sets how many programs an SM holds. Rows off
        # 16-byte boundaries too (too long for the row kernels), softmax and logsumexp (its MODE 2): the
        # knobs serve them as well, and variants that tie on the first two cases differ there (H200,
        # bf16 16384 x 4097, then in these kernels: 0.69x copy with 1024/1/96, 0.78x with 2048/1/168,
        # which had tied; timed on the softmax alone, 1024/1/96 once won by 1% and took bf16 1300 x 50257
        # logsumexp from 0.69x to 0.49x half a copy in GPU time)
        pick("cooperative long rows (fwd, bf16)",
             [{"coop_piece_fwd_16": p, "coop_warps_fwd_16": w, "coop_maxnreg_fwd_16": r}
              for p, w, r in ((2048, 1, 168), (2048, 1, 128), (2048, 1, None), (1024, 1, 96), (4096, 2, 168))],
             coop_cases[:2] + [(TOTAL // 32767, 32767), (TOTAL // 50257, 50257)], "fwd+lse", torch.bfloat16)
    bmid = [(TOTAL // 8192, 8192), (TOTAL // 16384, 16384)]
    pick("row block (bwd)", [{"max_row_block_bwd": v} for v in (4096, 8192, 16384)], bmid, "bwd")
    return chosen, log, applied


# ----------------------------------------------------------------------------------------------------
# log_bmm


def naive_log_bmm(a, b):
    return (a[:, :, :, None] + b[:, None, :, :]).logsumexp(2)


def log_bmm_case(B, N, M, P) -> dict:
    a = torch.randn(B, N, M, device="cuda") * 2
    b = torch.randn(B, M, P, device="cuda") * 2
    g = torch.randn(B, N, P, device="cuda")
    io_gb = (a.numel() + b.numel() + B * N * P) * 4 / 1e9
    rec = {"B": B, "N": N, "M": M, "P": P, "terms": B * N * M * P, "inputs_plus_output_GB": io_gb}
    out = kl.log_bmm_forward(a, b)
    rec["ours_fwd_ms"] = bench(lambda: kl.log_bmm_forward(a, b))
    rec["ours_fwd_peak_GB"] = peak_gb(lambda: kl.log_bmm_forward(a, b))
    rec["ours_bwd_ms"] = bench(lambda: kl.log_bmm_backward(a, b, out, g))
    rec["ours_bwd_peak_GB"] = peak_gb(lambda: kl.log_bmm_backward(a, b, out, g))
    rec["ours_Gterms_per_s_fwd"] = B * N * M * P / rec["ours_fwd_ms"] / 1e6
    rec["ours_Gterms_per_s_bwd"] = 2 * B * N * M * P / rec["ours_bwd_ms"] / 1e6
    # naive forward
    try:
        ref = naive_log_bmm(a, b)
        rec["fwd_max_abs_err_vs_naive"] = (out - ref).abs().max().item()
        del ref
        rec["naive_fwd_ms"] = bench(lambda: naive_log_bmm(a, b), rep=20)
        rec["naive_fwd_peak_GB"] = peak_gb(lambda: naive_log_bmm(a, b))
        rec["fwd_speedup"] = rec["naive_fwd_ms"] / rec["ours_fwd_ms"]
    except torch.OutOfMemoryError:
        rec["naive_fwd"] = "out of memory"
    torch.cuda.empty_cache()
    # naive backward: autograd through the naive form (graph built once, backward timed), or per batch
    ar, br = a.clone().requires_grad_(), b.clone().requires_grad_()
    try:
        o = naive_log_bmm(ar, br)
        rec["naive_bwd_ms"] = bench(lambda: torch.autograd.grad(o, (ar, br), g, retain_graph=True), rep=20)
        rec["naive_bwd_peak_GB"] = peak_gb(lambda: torch.autograd.grad(o, (ar, br), g, retain_graph=True))
        rec["naive_bwd_method"] = "autograd through the naive form, whole batch"
        ga, gb = torch.autograd.grad(o, (ar, br), g)
        oga, ogb = kl.log_bmm_backward(a, b, out, g)
        rec["bwd_max_rel_err_vs_naive"] = max(
            ((oga - ga).abs().max() / ga.abs().max()).item(), ((ogb - gb).abs().max() / gb.abs().max()).item()
        )
        del o, ga, gb, oga, ogb
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        # one batch element's graph fits: time its backward and scale by B (elements are alike)
        ai, bi = a[:1].clone().requires_grad_(), b[:1].clone().requires_grad_()
        oi = naive_log_bmm(ai, bi)
        t1 = bench(lambda: torch.autograd.grad(oi, (ai, bi), g[:1], retain_graph=True), rep=20)
        rec["naive_bwd_ms"] = t1 * B
        rec["naive_bwd_method"] = f"autograd through the naive form per batch element (1 of {B} timed, x{B})"
        rec["naive_bwd_peak_GB"] = peak_gb(lambda: torch.autograd.grad(oi, (ai, bi), g[:1], retain_graph=True))
        del oi, ai, bi
    if "naive_bwd_ms" in rec:
        rec["bwd_speedup"] = rec["naive_bwd_ms"] / rec["ours_bwd_ms"]
    # total peak (the inputs, already allocated, plus what the call allocates) over inputs + outputs
    in_gb = (a.numel() + b.numel()) * 4 / 1e9
    rec["ours_fwd_peak_vs_io"] = (in_gb + rec["ours_fwd_peak_GB"]) / io_gb
    if "naive_fwd_peak_GB" in rec:
        rec["naive_fwd_peak_vs_io"] = (in_gb + rec["naive_fwd_peak_GB"]) / io_gb
    bwd_in = in_gb + 2 * B * N * P * 4 / 1e9  # a, b, out, g
    rec["ours_bwd_peak_vs_io"] = (bwd_in + rec["ours_bwd_peak_GB"]) / (bwd_in + in_gb)
    del ar, br
    torch.cuda.empty_cache()
    return rec


def tune_log_bmm() -> tuple[dict, list[dict]]:
    """Pick forward and backward tiles (warps, 16-byte vectors per thread, unroll) at 8x512^3. The
    backward's knobs tune the exact kernel, so it is timed alone (`bwd_dot` off): at this size the
    factored kernel would run instead and the pick would be noise; the exact kernel serves problems of
    few tiles and the tiles the factored kernel leaves."""
    B, N, M, P = 8, 512, 512, 512
    a = torch.randn(B, N, M, device="cuda")
    b = torch.randn(B, M, P, device="cuda")
    g = torch.randn(B, N, P, device="cuda")
    out = kl.log_bmm_forward(a, b)
    log = []
    best = {"fwd": (float("inf"), None), "bwd": (float("inf"), None)}
    for warps, vecs, unroll in [(4, 8, 2), (4, 8, 4), (4, 4, 4), (8, 8, 2), (4, 16, 2), (2, 8, 4), (8, 4, 4)]:
        rec = {"warps": warps, "vecs": vecs, "unroll": unroll}
        for which in ("fwd", "bwd"):
            knobs = {f"{which}_warps": warps, f"{which}_vecs": vecs, f"{which}_unroll": unroll}
            exact = {"dot_min_tiles": 1 << 62} if which == "bwd" else {}  # (the exact kernel alone)
            try:
                with kl.config_override(**knobs, **exact):
                    fn = (lambda: kl.log_bmm_forward(a, b)) if which == "fwd" else (lambda: kl.log_bmm_backward(a, b, out, g))
                    rec[f"{which}_ms"] = ms = bench(fn)
                if ms < best[which][0]:
                    best[which] = (ms, knobs)
            except Exception as e:
                rec[f"{which}_error"] = repr(e)[:300]
        print(f"  log_bmm variant {rec}", flush=True)
        log.append(rec)
    chosen = {**best["fwd"][1], **best["bwd"][1]}
    return chosen, log


# ----------------------------------------------------------------------------------------------------


def plots(result: dict, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fam = [r for r in result["softmax_family"] if r["dtype"] == "float32" and r["rows"] * r["cols"] == TOTAL]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for op, color in (("softmax", "C0"), ("log_softmax", "C1"), ("logsumexp", "C2")):
        rs = sorted([r for r in fam if r["op"] == op], key=lambda r: r["cols"])
        cols = [r["cols"] for r in rs]
        for who, ls in (("ours", "-"), ("torch", "--")):
            axes[0].plot(cols, [r[who]["fwd_ms"] for r in rs], ls, color=color, marker="o", label=f"{op} fwd {who}")
            axes[1].plot(cols, [r[who]["bwd_ms"] for r in rs], ls, color=color, marker="o", label=f"{op} bwd {who}")
            axes[2].plot(cols, [r[who]["fwd_peak_GB"] + r[who]["bwd_peak_GB"] for r in rs], ls, color=color,
                         marker="o", label=f"{op} {who}")
    for ax, title in zip(axes, ("forward time (ms)", "backward time (ms)", "peak extra memory fwd+bwd (GB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"columns (rows = 2^26 / columns), fp32, {result['gpu']}")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    p = f"{stem}-softmax.png"
    fig.savefig(p, dpi=110)
    paths.append(p)
    plt.close(fig)

    lb = sorted(result["log_bmm"], key=lambda r: r["terms"])
    if lb:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
        terms = [r["terms"] for r in lb]
        axes[0].plot(terms, [r["ours_fwd_ms"] for r in lb], "-o", label="ours fwd")
        axes[0].plot(terms, [r["ours_bwd_ms"] for r in lb], "-s", label="ours bwd")
        axes[0].plot(terms, [r.get("naive_fwd_ms", float("nan")) for r in lb], "--o", label="naive fwd")
        axes[0].plot(terms, [r.get("naive_bwd_ms", float("nan")) for r in lb], "--s", label="naive bwd")
        axes[1].plot(terms, [r["ours_fwd_peak_GB"] for r in lb], "-o", label="ours fwd")
        axes[1].plot(terms, [r["ours_bwd_peak_GB"] for r in lb], "-s", label="ours bwd")
        axes[1].plot(terms, [r.get("naive_fwd_peak_GB", float("nan")) for r in lb], "--o", label="naive fwd")
        axes[1].plot(terms, [r.get("naive_bwd_peak_GB", float("nan")) for r in lb], "--s", label="naive bwd")
        axes[1].plot(terms, [r["inputs_plus_output_GB"] for r in lb], ":", color="k", label="inputs + output")
        for ax, title in zip(axes, ("time (ms)", "peak extra memory (GB)")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(f"B*N*M*P (fp32), {result['gpu']}")
            ax.set_title(f"log_bmm {title}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        p = f"{stem}-log_bmm.png"
        fig.savefig(p, dpi=110)
        paths.append(p)
        plt.close(fig)
    return paths


def summarize(result: dict) -> dict:
    fam = result["softmax_family"]
    big32 = [r for r in fam if r["dtype"] == "float32" and r["cols"] >= 4096]
    big16 = [r for r in fam if r["dtype"] == "bfloat16" and r["cols"] >= 4096 and r["rows"] * r["cols"] >= TOTAL // 4]

    def mn(vals):
        return min(vals) if vals else None

    s = {
        "softmax_fwd_vs_copy_min_cols_ge_4K": mn([r["ours"]["fwd_vs_copy"] for r in big32 if r["op"] == "softmax"]),
        # (bf16 inputs of at least 32 MB: the EXTRA cases)
        "softmax_bf16_fwd_vs_copy_min_cols_ge_4K": mn([r["ours"]["fwd_vs_copy"] for r in big16 if r["op"] == "softmax"]),
        "softmax_fwd_vs_torch_min_cols_ge_4K": mn([r["fwd_speedup"] for r in big32 if r["op"] == "softmax"]),
        "softmax_bwd_vs_torch_min_cols_ge_4K": mn([r["bwd_speedup"] for r in big32 if r["op"] == "softmax"]),
        "logsumexp_fwd_vs_torch_min_cols_ge_4K": mn([r["fwd_speedup"] for r in big32 if r["op"] == "logsumexp"]),
        # the same minimums on GPU time (graph replay, no host time)
        "softmax_fwd_vs_torch_gpu_min_cols_ge_4K": mn([r["fwd_gpu_speedup"] for r in big32 if r["op"] == "softmax"]),
        "softmax_bwd_vs_torch_gpu_min_cols_ge_4K": mn([r["bwd_gpu_speedup"] for r in big32 if r["op"] == "softmax"]),
        "logsumexp_fwd_vs_torch_gpu_min_cols_ge_4K": mn(
            [r["fwd_gpu_speedup"] for r in big32 if r["op"] == "logsumexp"]),
        "log_softmax_bwd_vs_torch_min_cols_ge_4K": mn([r["bwd_speedup"] for r in big32 if r["op"] == "log_softmax"]),
        "log_bmm_fwd_vs_naive": {f"{r['B']}x{r['N']}x{r['M']}x{r['P']}": r.get("fwd_speedup") for r in result["log_bmm"]},
        "log_bmm_bwd_vs_naive": {f"{r['B']}x{r['N']}x{r['M']}x{r['P']}": r.get("bwd_speedup") for r in result["log_bmm"]},
        "log_bmm_fwd_peak_vs_io": {f"{r['B']}x{r['N']}x{r['M']}x{r['P']}": r.get("ours_fwd_peak_vs_io") for r in result["log_bmm"]},
    }
    return s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--quick", action="store_true",
                    help="no variant sweeps (the committed constants), float32 cases only, three log_bmm sizes")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: tune,family,log_bmm")
    ap.add_argument("--no-coop", action="store_true", help="measure without the cooperative long-row kernels")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    if args.quick:
        skip.add("tune")
    # the whole run under the configs it measures: the sweeps' winners once picked (`config_override`)
    configs = contextlib.ExitStack()
    if args.no_coop:
        configs.enter_context(ks.config_override(**NO_COOP))
    os.makedirs(args.out, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    stem = os.path.join(args.out, f"lse_toolkit-{slug}")
    result = {
        "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "timing": "triton.testing.do_bench median (L2 flushed per run); *_gpu_ms: CUDA-graph replay of 20 "
                  "calls over rotated input copies, CUDA events, median of 15 replays; the softmax knob sweep "
                  "(variants) picks by that GPU time",
        "peer_figures_DESIGN_s9": PEER_FIGURES, "bars": BARS,
        "tuning_softmax": dataclasses.asdict(ks.active_config()),
        "tuning_log_bmm": dataclasses.asdict(kl.active_config()),
        "softmax_family": [], "variants": [], "log_bmm": [], "log_bmm_variants": [],
    }

    def save():
        result["summary"] = summarize(result) if result["softmax_family"] else {}
        with open(f"{stem}.json", "w") as f:
            json.dump(result, f, indent=1)

    t0 = time.time()
    copy = copy_gbps()
    result["copy_GBps"] = copy
    print(f"{gpu}: device copy {copy:.0f} GB/s (read + write)", flush=True)
    def family(cases):
        for rows, cols, dtype in cases:
            result["softmax_family"] += family_case(rows, cols, dtype, copy)
            r = result["softmax_family"][-3]
            print(f"  {rows}x{cols} {dtype}: softmax fwd {r['ours']['fwd_vs_copy']:.2f} of copy, "
                  f"x{r['fwd_speedup']:.2f} torch ({time.time() - t0:.0f}s)", flush=True)
            save()

    def plot():
        try:
            result["plots"] = [os.path.basename(p) for p in plots(result, stem)]
            save()
        except Exception as e:
            print(f"plots failed: {e!r}")

    # tune first (short sweeps), then measure with the winners; most important measurements first, so
    # that a run cut short by its time limit still leaves a JSON of what it measured
    if "tune" not in skip:
        result["tuned_softmax"], result["variants"], applied = tune_softmax(coop=not args.no_coop)
        configs.enter_context(ks.config_override(**applied))
        result["tuning_softmax"] = dataclasses.asdict(ks.active_config())
        save()
    if "family" not in skip:
        family([(TOTAL // c, c, torch.float32) for c in COLS])
    if "tune" not in skip:
        result["tuned_log_bmm"], result["log_bmm_variants"] = tune_log_bmm()
        configs.enter_context(kl.config_override(**result["tuned_log_bmm"]))
        result["tuning_log_bmm"] = dataclasses.asdict(kl.active_config())
        save()
    if "log_bmm" not in skip:
        for dims in LOG_BMM[1:] if args.quick else LOG_BMM:
            try:
                result["log_bmm"].append(log_bmm_case(*dims))
            except Exception as e:
                result["log_bmm"].append({"dims": dims, "error": repr(e)[:300]})
            short = {k: v for k, v in result["log_bmm"][-1].items() if "ms" in k or "speedup" in k or "err" in k}
            print(f"  log_bmm {dims}: {short} ({time.time() - t0:.0f}s)", flush=True)
            save()
    plot()
    if not args.quick and "family" not in skip:
        family(EXTRA)
    plot()

    # compact table
    print(f"\n{gpu}, torch {torch.__version__}, triton {triton.__version__}, copy {copy:.0f} GB/s")
    print(f"{'op':<12}{'rows x cols':>16}{'dtype':>9}{'fwd ms':>9}{'torch':>9}{'x':>6}{'of copy':>8}"
          f"{'bwd ms':>9}{'torch':>9}{'x':>6}{'gpu x f/b':>12}")
    for r in result["softmax_family"]:
        o, t = r["ours"], r["torch"]
        print(f"{r['op']:<12}{str(r['rows']) + 'x' + str(r['cols']):>16}{r['dtype']:>9}{o['fwd_ms']:>9.3f}"
              f"{t['fwd_ms']:>9.3f}{r['fwd_speedup']:>6.2f}{o['fwd_vs_copy']:>8.2f}{o['bwd_ms']:>9.3f}"
              f"{t['bwd_ms']:>9.3f}{r['bwd_speedup']:>6.2f}{r['fwd_gpu_speedup']:>6.2f}/{r['bwd_gpu_speedup']:.2f}")
    for r in result["log_bmm"]:
        if "error" in r:
            print("log_bmm", r)
            continue
        print(f"log_bmm {r['B']}x{r['N']}x{r['M']}x{r['P']}: fwd {r['ours_fwd_ms']:.2f} ms vs naive "
              f"{r.get('naive_fwd_ms', float('nan')):.2f} (x{r.get('fwd_speedup', float('nan')):.1f}), bwd "
              f"{r['ours_bwd_ms']:.2f} vs {r.get('naive_bwd_ms', float('nan')):.2f} (x{r.get('bwd_speedup', float('nan')):.1f}); "
              f"peak fwd {r['ours_fwd_peak_GB']:.3f} GB ({r['ours_fwd_peak_vs_io']:.2f}x io), naive "
              f"{r.get('naive_fwd_peak_GB', float('nan')):.1f} GB")
    print("summary:", json.dumps(result.get("summary", {})))
    print(f"wrote {stem}.json ({time.time() - t0:.0f}s)")
    configs.close()


if __name__ == "__main__":
    main()
