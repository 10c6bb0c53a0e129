"""Block attention under windows and packed documents on one GPU: TFLOP/s over *visible* pairs.

bf16, batch 1, 32 heads, head dim 128, S = 32K, causal. Inputs: dense causal; 8 documents of 4K; 64
of 512; log-uniform document lengths in [256, 8K]; windows of 1K, 4K, 8K. Ours: the `triton` block op
with the mask's per-row intervals (computed once, on the GPU, as `ringlse.masks.block_intervals`
does for every call; their cost is timed apart); dense causal through the plain causal path. Peers,
in the same process on the same inputs: with --flex, PyTorch's FlexAttention (compiled, block mask);
with --fa4, FlashAttention-4 (`flash_attn.cute`: windows as `window_size`, documents through
`flash_attn_varlen_func`), timed as ours are, with its own masked/dense ratios (issue 28's bar for 64
short documents and the 1K window is ours at least FA4's ratio).
FLOPs: 4 * B * H * D * visible pairs (forward), 2.5x that (backward). Times: triton.testing.do_bench
medians, our dense causal block timed again next to each input (the ratios to it).

Usage: python3 benchmarks/masked_attention.py [--out DIR] [--flex] [--fa4] [--seqlen S]
    writes DIR/masked_attention-<gpu>.json and .png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from triton.testing import do_bench

import ringlse
from ringlse.masks import Rule, Span, block_intervals

sys.path.insert(0, os.path.dirname(__file__))
from mask_balance import log_uniform_documents, visible_per_position  # noqa: E402


def inputs(s: int) -> dict[str, Rule]:
    return {
        "dense causal": Rule(True),
        "8 documents of 4K": Rule(True, docs=tuple(range(0, s + 1, s // 8))),
        "64 documents of 512": Rule(True, docs=tuple(range(0, s + 1, s // 64))),
        "log-uniform documents 256-8K": Rule(True, docs=log_uniform_documents(s, 256, 8192, 0)),
        "window 1K": Rule(True, window=(1024, 0)),
        "window 4K": Rule(True, window=(4096, 0)),
        "window 8K": Rule(True, window=(8192, 0)),
    }


def ours_calls(q, k, v, rule: Rule):
    """`(fwd, bwd, zero, intervals_ms)`: our forward and backward under `rule` as calls of one argument
    (the timers' form), the accumulators' zeroing that `bwd` includes, and the intervals' time."""
    op = ringlse.get_block_op("triton", q.device, q.dtype, masked=True)
    s = q.shape[1]
    if rule.plain:
        block, iv_ms = dict(causal=True, q_start=0, k_start=0), 0.0
    else:
        iv_ms = do_bench(lambda: block_intervals(rule, Span(0, s), Span(0, s), device=q.device), return_mode="median")
        block = dict(causal=False, q_start=0, k_start=0, intervals=block_intervals(rule, Span(0, s), Span(0, s), q.device))
    scale = q.shape[-1] ** -0.5
    out, lse = op.forward(q, k, v, softmax_scale=scale, **block)
    dout = torch.randn_like(q)
    delta = op.compute_delta(dout, out)
    acc = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in (q, k, v)]

    def bwd(_i):
        for a in acc:
            a.zero_()
        op.backward(dout, q, k, v, out, lse, delta, softmax_scale=scale, **block, dq_acc=acc[0], dk_acc=acc[1],
                    dv_acc=acc[2])
    def fwd(_i):
        op.forward(q, k, v, softmax_scale=scale, **block)

    def zero(_i):
        for a in acc:
            a.zero_()
    return fwd, bwd, zero, iv_ms


def time_ours(q, k, v, rule: Rule, dense) -> tuple[float, float, float, float, float]:
    """`(fwd_ms, bwd_ms, dense_fwd_ms, dense_bwd_ms, intervals_ms)`: the block under `rule` and the dense
    causal one (`dense`: `ours_calls`' first three) timed next to it, each by `do_bench` on its own (a
    kernel in its own steady state, as the peers' figures were measured). The dense block timed once at
    the start let the ratios move by ~0.02 from run to run; launches interleaved with it lowered the masked
    ratios by 0.01-0.04 more (each kernel then starts in the power state the other left; session 32)."""
    fwd, bwd, zero, iv_ms = ours_calls(q, k, v, rule)
    runs = {"dense_fwd": [], "fwd": [], "dense_bwd": [], "bwd": [], "zero": []}
    for _ in range(3):
        # three rounds, the median of each one's three medians (a single round's backward moved by up to 5%)
        for name, fn in zip(runs, (dense[0], fwd, dense[1], bwd, zero)):
            # a warm-up long enough for the clock to settle at this kernel's own power draw: after 300 ms of
            # the dense backward, a window's backward read 7% slower with do_bench's 25 ms (session 32)
            runs[name].append(do_bench(lambda fn=fn: fn(0), warmup=250, return_mode="median"))
    ms = {name: sorted(x)[1] for name, x in runs.items()}
    return (ms["fwd"], ms["bwd"] - ms["zero"], ms["dense_fwd"], ms["dense_bwd"] - ms["zero"], iv_ms)


def time_flex(q, k, v, rule: Rule):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    s = q.shape[1]
    docs = None if rule.docs is None else torch.tensor(rule.docs, device=q.device)
    doc_id = None if docs is None else torch.searchsorted(docs, torch.arange(s, device=q.device), right=True)
    left = rule.window[0]

    def mask_mod(b, h, qi, ki):
        ok = ki <= qi
        if left >= 0:
            ok = ok & (ki >= qi - left)
        if doc_id is not None:
            ok = ok & (doc_id[qi] == doc_id[ki])
        return ok

    bm = create_block_mask(mask_mod, None, None, s, s, device=q.device)
    flex = torch.compile(flex_attention, dynamic=False)
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    fwd_ms = do_bench(lambda: flex(qt, kt, vt, block_mask=bm), return_mode="median")
    o = flex(qt, kt, vt, block_mask=bm)
    g = torch.randn_like(o)
    bwd_ms = do_bench(lambda: torch.autograd.grad(o, (qt, kt, vt), g, retain_graph=True), return_mode="median")
    return fwd_ms, bwd_ms


def steady_ms(fn) -> float:
    """The median of three `do_bench` medians, each after 250 ms of warm-up (`time_ours`' method)."""
    return sorted(do_bench(fn, warmup=250, return_mode="median") for _ in range(3))[1]


def time_fa4(q, k, v, rule: Rule) -> tuple[float, float]:
    """`(fwd_ms, bwd_ms)` of FlashAttention-4 under `rule`: causal with `window_size=(left, 0)`, documents
    as varlen (`[total, h, d]`, `cu_seqlens`); the backward through autograd (`out.backward`)."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    scale = q.shape[-1] ** -0.5
    if rule.docs is not None:
        cu = torch.tensor(rule.docs, dtype=torch.int32, device=q.device)
        longest = max(b - a for a, b in zip(rule.docs, rule.docs[1:]))
        qt, kt, vt = (x[0].detach().requires_grad_() for x in (q, k, v))

        def call():
            return flash_attn_varlen_func(qt, kt, vt, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                          max_seqlen_k=longest, softmax_scale=scale, causal=True)
    else:
        qt, kt, vt = (x.detach().requires_grad_() for x in (q, k, v))
        window = (rule.window[0] if rule.window[0] >= 0 else None, 0 if rule.window[0] >= 0 else None)

        def call():
            return flash_attn_func(qt, kt, vt, softmax_scale=scale, causal=True, window_size=window)

    def first(x):
        return x[0] if isinstance(x, tuple) else x

    with torch.no_grad():
        fwd_ms = steady_ms(call)
    out = first(call())
    dout = torch.randn_like(out)

    def fwd_bwd():
        for t in (qt, kt, vt):
            t.grad = None
        first(call()).backward(dout)

    return fwd_ms, steady_ms(fwd_bwd) - fwd_ms


def visible_pairs(rule: Rule, s: int) -> int:
    return int(visible_per_position(rule, s).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--flex", action="store_true", help="also time FlexAttention (compiled) on the same inputs")
    ap.add_argument("--fa4", action="store_true", help="also time FlashAttention-4 on the same inputs")
    args = ap.parse_args()
    b, h, d, s = 1, 32, 128, args.seqlen
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    rows = []
    dense_rule = inputs(s)["dense causal"]
    dense = ours_calls(q, k, v, dense_rule)[:3]
    dense_flop = 4 * b * h * d * visible_pairs(dense_rule, s)
    for name, rule in inputs(s).items():
        pairs = visible_pairs(rule, s)
        flop = 4 * b * h * d * pairs
        fwd, bwd, dense_fwd, dense_bwd, iv = time_ours(q, k, v, rule, dense)
        row = dict(input=name, docs=len(rule.docs) - 1 if rule.docs else 1, window=rule.window, visible_pairs=pairs,
                   ours_fwd_ms=fwd, ours_bwd_ms=bwd, intervals_ms=iv, ours_fwd_tflops=flop / fwd / 1e9,
                   ours_bwd_tflops=2.5 * flop / bwd / 1e9,
                   # the ratios to our dense causal block, timed next to this one
                   fwd_vs_own_dense=(flop / fwd) / (dense_flop / dense_fwd),
                   bwd_vs_own_dense=(flop / bwd) / (dense_flop / dense_bwd))
        if args.flex:
            try:
                ffwd, fbwd = time_flex(q, k, v, rule)
                row.update(flex_fwd_ms=ffwd, flex_bwd_ms=fbwd, flex_fwd_tflops=flop / ffwd / 1e9,
                           flex_bwd_tflops=2.5 * flop / fbwd / 1e9)
            except Exception as e:  # a peer that fails is recorded, not fatal
                row.update(flex_error=str(e).splitlines()[0][:200])
        if args.fa4:
            try:
                afwd, abwd = time_fa4(q, k, v, rule)
                row.update(fa4_fwd_ms=afwd, fa4_bwd_ms=abwd, fa4_fwd_tflops=flop / afwd / 1e9,
                           fa4_bwd_tflops=2.5 * flop / abwd / 1e9)
            except Exception as e:  # a peer that fails is recorded, not fatal
                row.update(fa4_error=str(e).splitlines()[0][:200])
        rows.append(row)
        print(f"{name:<30} fwd {row['ours_fwd_tflops']:6.1f} bwd {row['ours_bwd_tflops']:6.1f} TFLOP/s, "
              f"x dense {row['fwd_vs_own_dense']:.3f} / {row['bwd_vs_own_dense']:.3f} (intervals {iv:.3f} ms)" + (f" | flex fwd {row['flex_fwd_tflops']:6.1f} bwd {row['flex_bwd_tflops']:6.1f}"
                                            if "flex_fwd_tflops" in row else "")
              + (f" | fa4 fwd {row['fa4_fwd_tflops']:6.1f} bwd {row['fa4_bwd_tflops']:6.1f}" if "fa4_fwd_tflops" in row
                 else (f" | fa4: {row['fa4_error']}" if "fa4_error" in row else "")), flush=True)
    dense = rows[0]
    for row in rows:
        if "fa4_fwd_tflops" in row and "fa4_fwd_tflops" in dense:
            # FA4's own masked/dense ratios, from its dense causal row of this run
            row["fa4_fwd_vs_fa4_dense"] = row["fa4_fwd_tflops"] / dense["fa4_fwd_tflops"]
            row["fa4_bwd_vs_fa4_dense"] = row["fa4_bwd_tflops"] / dense["fa4_bwd_tflops"]
        if "flex_fwd_tflops" in row and "flex_fwd_tflops" in dense:
            row["fwd_vs_flex"] = row["ours_fwd_tflops"] / row["flex_fwd_tflops"]
            row["bwd_vs_flex"] = row["ours_bwd_tflops"] / row["flex_bwd_tflops"]
    gpu = torch.cuda.get_device_name()
    import triton
    result = dict(benchmark="masked_attention", gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                  command="python3 benchmarks/masked_attention.py" + (" --flex" if args.flex else "")
                  + (" --fa4" if args.fa4 else ""),
                  date=time.strftime("%Y-%m-%dT%H:%M:%S"), shape=dict(batch=b, heads=h, head_dim=d, seqlen=s),
                  dtype="bfloat16", flops="4*B*H*D*visible pairs; backward 2.5x", rows=rows)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"masked_attention-{gpu.replace(' ', '_')}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 4))
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["ours_fwd_tflops"] for r in rows], 0.2, label="ours fwd")
        ax.bar([i for i in x], [r["ours_bwd_tflops"] for r in rows], 0.2, label="ours bwd")
        if all("flex_fwd_tflops" in r for r in rows):
            ax.bar([i + 0.2 for i in x], [r["flex_fwd_tflops"] for r in rows], 0.2, label="flex fwd")
        ax.set_xticks(list(x), [r["input"] for r in rows], rotation=20, ha="right", fontsize=7)
        ax.set_ylabel("TFLOP/s over visible pairs")
        ax.set_title(f"{gpu}, bf16, 32 heads x d 128, S {s}, causal")
        ax.legend()
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=110)
    except ImportError:
        pass
    print(f"wrote {stem}.json")


if __name__ == "__main__":
    main()
