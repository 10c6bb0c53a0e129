"""Block attention under windows and packed documents on one GPU: TFLOP/s over *visible* pairs.

bf16, batch 1, 32 heads, head dim 128, S = 32K, causal. Inputs: dense causal; 8 documents of 4K; 64
of 512; log-uniform document lengths in [256, 8K]; windows of 1K, 4K, 8K. Ours: the `triton` block op
with the mask's per-row intervals (computed once, on the GPU, as `ringlse.masks.block_intervals`
does for every call; their cost is timed apart); dense causal through the plain causal path. Peers,
in the same process on the same inputs: with --flex, PyTorch's FlexAttention (compiled, block mask);
with --fa4, FlashAttention-4 (`flash_attn.cute`: windows as `window_size`, documents through
`flash_attn_varlen_func`), timed as ours are, with its own masked/dense ratios (for 64 short documents
and the 1K window the fair bar is FA4's own masked/dense ratio).
FLOPs: 4 * B * H * D * visible pairs (forward), 2.5x that (backward). Times (`timing.abba_ms`): 5 s of
every side in turn to warm the card, then each side `do_bench`'s median after 2 s of it alone, the
whole list in order and in reverse, the mean of the two readings; the dense block is listed
first and again last, and the two should agree.
(Timed next to each input as before, the dense block read 0.89x of itself on an H100: the card slows as
it warms, so whatever runs second reads slow.)

Usage: python3 benchmarks/masked_attention.py [--out DIR] [--flex] [--fa4] [--seqlen S]
    writes DIR/masked_attention-<gpu>.json and .png
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from triton.testing import do_bench

import ringlse
from ringlse.masks import Rule, Span, block_intervals

# benchmarks/ is sys.path[0] when a script of it runs
from mask_balance import log_uniform_documents  # noqa: E402
from ringlse.masks import visible_per_position  # noqa: E402
from timing import abba_ms  # noqa: E402


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
    """`(fwd, bwd, zero, intervals_ms)`: our forward and backward under `rule` as calls of no argument,
    the accumulators' zeroing that `bwd` includes, and the intervals' time."""
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

    def bwd():
        for a in acc:
            a.zero_()
        op.backward(dout, q, k, v, out, lse, delta, softmax_scale=scale, **block, dq_acc=acc[0], dk_acc=acc[1],
                    dv_acc=acc[2])

    def fwd():
        op.forward(q, k, v, softmax_scale=scale, **block)

    def zero():
        for a in acc:
            a.zero_()
    return fwd, bwd, zero, iv_ms


def flex_calls(q, k, v, rule: Rule):
    """`(fwd, bwd)`: PyTorch's FlexAttention (compiled, block mask) under `rule`, calls of no argument
    (the backward replays the graph of one forward)."""
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
    o = flex(qt, kt, vt, block_mask=bm)
    g = torch.randn_like(o)
    return (lambda: flex(qt, kt, vt, block_mask=bm),
            lambda: torch.autograd.grad(o, (qt, kt, vt), g, retain_graph=True))


def fa4_calls(q, k, v, rule: Rule):
    """`(fwd, fwd_bwd)`: FlashAttention-4 under `rule` as calls of no argument: causal with
    `window_size=(left, 0)`, documents as varlen (`[total, h, d]`, `cu_seqlens`); the backward through
    autograd (`out.backward`), so it is timed with its forward."""
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

    out = first(call())
    dout = torch.randn_like(out)

    def fwd():
        with torch.no_grad():
            call()

    def fwd_bwd():
        for t in (qt, kt, vt):
            t.grad = None
        first(call()).backward(dout)

    return fwd, fwd_bwd


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
    rules = inputs(s)
    # every side of every input as a call of no argument: `name/side -> fn`; the peers' failures are kept
    calls, ivs, errors = {}, {}, {}
    for name, rule in rules.items():
        fwd, bwd, zero, ivs[name] = ours_calls(q, k, v, rule)
        calls.update({f"{name}/ours fwd": fwd, f"{name}/ours bwd": bwd, f"{name}/zero": zero})
        for peer, make, flag in (("flex", flex_calls, args.flex), ("fa4", fa4_calls, args.fa4)):
            if flag:
                try:
                    pf, pb = make(q, k, v, rule)
                    pf(), pb()
                    calls.update({f"{name}/{peer} fwd": pf, f"{name}/{peer} bwd": pb})
                except Exception as e:  # a peer that fails is recorded, not fatal
                    errors[(name, peer)] = str(e).splitlines()[0][:200]
    # the dense block once more, last: after ABBA it should read as the first one (the method's check)
    calls["dense causal, again/ours fwd"], calls["dense causal, again/ours bwd"] = (calls["dense causal/ours fwd"],
                                                                                 calls["dense causal/ours bwd"])
    readings = abba_ms(calls)
    ms = {key: sum(r) / len(r) for key, r in readings.items()}
    rows = []
    for name, rule in rules.items():
        pairs = visible_pairs(rule, s)
        flop = 4 * b * h * d * pairs
        fwd, bwd = ms[f"{name}/ours fwd"], ms[f"{name}/ours bwd"] - ms[f"{name}/zero"]
        row = dict(input=name, docs=len(rule.docs) - 1 if rule.docs else 1, window=rule.window, visible_pairs=pairs,
                   ours_fwd_ms=fwd, ours_bwd_ms=bwd, intervals_ms=ivs[name], ours_fwd_tflops=flop / fwd / 1e9,
                   ours_bwd_tflops=2.5 * flop / bwd / 1e9,
                   # both readings of each side (in order, in reverse): how far the clock drifted
                   readings_ms={key.split("/")[1]: v for key, v in readings.items() if key.split("/")[0] == name})
        for peer in ("flex", "fa4"):
            if f"{name}/{peer} fwd" in ms:
                pf = ms[f"{name}/{peer} fwd"]
                # FA4's backward runs through autograd with its forward: its time less the forward's
                pb = ms[f"{name}/{peer} bwd"] - (pf if peer == "fa4" else 0.0)
                row.update({f"{peer}_fwd_ms": pf, f"{peer}_bwd_ms": pb, f"{peer}_fwd_tflops": flop / pf / 1e9,
                            f"{peer}_bwd_tflops": 2.5 * flop / pb / 1e9})
            elif (name, peer) in errors:
                row[f"{peer}_error"] = errors[(name, peer)]
        rows.append(row)
    dense = rows[0]
    again = ms["dense causal, again/ours fwd"], ms["dense causal, again/ours bwd"] - ms["dense causal/zero"]
    check = dict(fwd=dense["ours_fwd_ms"] / again[0], bwd=dense["ours_bwd_ms"] / again[1])
    for row in rows:
        row["fwd_vs_own_dense"] = row["ours_fwd_tflops"] / dense["ours_fwd_tflops"]
        row["bwd_vs_own_dense"] = row["ours_bwd_tflops"] / dense["ours_bwd_tflops"]
        for peer in ("flex", "fa4"):
            if f"{peer}_fwd_tflops" in row and f"{peer}_fwd_tflops" in dense:
                # the peer's own masked/dense ratios in this run
                row[f"{peer}_fwd_vs_{peer}_dense"] = row[f"{peer}_fwd_tflops"] / dense[f"{peer}_fwd_tflops"]
                row[f"{peer}_bwd_vs_{peer}_dense"] = row[f"{peer}_bwd_tflops"] / dense[f"{peer}_bwd_tflops"]
        if "flex_fwd_tflops" in row:
            row["fwd_vs_flex"] = row["ours_fwd_tflops"] / row["flex_fwd_tflops"]
            row["bwd_vs_flex"] = row["ours_bwd_tflops"] / row["flex_bwd_tflops"]
        print(f"{row['input']:<30} fwd {row['ours_fwd_tflops']:6.1f} bwd {row['ours_bwd_tflops']:6.1f} TFLOP/s, "
              f"x dense {row['fwd_vs_own_dense']:.3f} / {row['bwd_vs_own_dense']:.3f} "
              f"(intervals {row['intervals_ms']:.3f} ms)"
              + "".join(f" | {p} fwd {row[p + '_fwd_tflops']:6.1f} bwd {row[p + '_bwd_tflops']:6.1f}, x its dense "
                        f"{row[p + '_fwd_vs_' + p + '_dense']:.3f} / {row[p + '_bwd_vs_' + p + '_dense']:.3f}"
                        if p + "_fwd_vs_" + p + "_dense" in row else (f" | {p}: {row[p + '_error']}" if p + "_error" in row
                                                                      else "") for p in ("flex", "fa4")), flush=True)
    print(f"dense causal timed first and last, ratio of the two (1.0: no drift left): fwd {check['fwd']:.3f}, "
          f"bwd {check['bwd']:.3f}")
    gpu = torch.cuda.get_device_name()
    import triton
    result = dict(benchmark="masked_attention", gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                  command="python3 benchmarks/masked_attention.py" + (" --flex" if args.flex else "")
                  + (" --fa4" if args.fa4 else ""),
                  date=time.strftime("%Y-%m-%dT%H:%M:%S"), shape=dict(batch=b, heads=h, head_dim=d, seqlen=s),
                  dtype="bfloat16", flops="4*B*H*D*visible pairs; backward 2.5x",
                  method="5 s of every side in turn; then each side do_bench's median (300 ms) after 2 s of it alone, "
                         "the list in order and in reverse; the mean of the two (benchmarks/timing.abba_ms)",
                  dense_first_over_last=check, rows=rows)
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
