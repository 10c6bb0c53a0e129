"""`merge_attn_states` in the inference engines' conventions against the device copy and the engines'
formulas (CONVENTIONS.md §3, §8, §9).

Cases (bf16 outs, float32 lse, H 32, D 128, T in {1, 64, 1K, 8K, 32K}, N in {2, 4, 8, 16}):
- `vllm-seq`: N separate tensors `[T, H, D]` and lses `[H, T]`, natural log (vLLM's
  `merge_attn_states`, ringlse's default);
- `heads-first-stacked`: one `[N, T, H, D]` / `[N, H, T]` tensor each, `dim=0`;
- `flashinfer-stacked`: `v [T, N, H, D]`, `s [T, N, H]`, base 2, `dim=1` (FlashInfer's `merge_states`);
- `fa4-stacked`: `[N, T, H, D]` / `[N, T, H]`, natural log, `dim=0` (FA4's `flash_attn_combine`);
- `flashinfer-seq` (N = 2): FlashInfer's `merge_state(v_a, s_a, v_b, s_b)` convention.
Each row times, launches interleaved (`timing.interleaved_ms`, an L2 flush before each): the fused
merge (`ringlse.merge_attn_states`), a device copy `dst.copy_(src)` moving the same bytes (read +
written), the engine's formula written in PyTorch (eager, float32 math: what one writes without a
fused kernel), and FlashInfer's own kernels when `import flashinfer` works. Bytes: every input read
once (N outs + N lses), the output and its lse written once.

Also: the stacked kernel against the four-slot one at N = 2, 4 and against the tuple one at N = 8, 16
(which the dispatch should pick), and a launch-configuration sweep of the stacked kernel.

Usage: python benchmarks/merge_engines.py --out FILE.json [--plot FILE.png] [--quick]
       python benchmarks/merge_engines.py --plot-from FILE.json --plot FILE.png   (plot only, no GPU)
(`python benchmarks/merge.py --engines ...` runs this too.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

H, D = 32, 128
TS = [1, 64, 1024, 8192, 32768]
NS = [2, 4, 8, 16]
KERNEL_TS = [8192, 32768]  # the kernel-choice rows and the configuration sweep (the last one)
CASES = ["vllm-seq", "heads-first-stacked", "flashinfer-stacked", "fa4-stacked", "flashinfer-seq"]
DEV = "cuda"  # the CPU smoke test (tests/test_merge_engines_bench.py) sets "cpu"


# ---------------------------------------------------------------------------------------------------
# the engines' formulas in PyTorch (eager, float32 math)


def vllm_formula(outs, lses):
    """vLLM's merge (natural log, lse `[H, T]`), N-way: max, exp, weights, weighted sum."""
    l = torch.stack(lses)  # [N, H, T]
    m = l.amax(0)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(l - m)
    t = e.sum(0)
    w = (e / torch.where(t == 0, torch.ones_like(t), t)).transpose(-1, -2).unsqueeze(-1)  # [N, T, H, 1]
    out = (torch.stack(outs).float() * w).sum(0).to(outs[0].dtype)
    return out, torch.log(t) + m


def flashinfer_formula(v, s, dim):
    """FlashInfer's merge (base 2, lse `[..., N, H]` along `dim`)."""
    m = s.amax(dim, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp2(s - m)
    t = e.sum(dim, keepdim=True)
    w = e / torch.where(t == 0, torch.ones_like(t), t)
    out = (v.float() * w.unsqueeze(-1)).sum(dim).to(v.dtype)
    return out, (m + torch.log2(t)).squeeze(dim)


def fa4_formula(o, l):
    """FA4's combine (natural log, `[N, T, H, D]`, `[N, T, H]`)."""
    lse = torch.logsumexp(l, 0)
    shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w = torch.exp(l - shift)
    return (o.float() * w.unsqueeze(-1)).sum(0).to(o.dtype), lse


def _flashinfer():
    try:
        import flashinfer  # noqa: F401

        return flashinfer, f"flashinfer {getattr(flashinfer, '__version__', '?')}"
    except Exception as err:  # noqa: BLE001 (any import failure: not available)
        return None, f"flashinfer not available ({type(err).__name__}: {str(err)[:200]})"


# ---------------------------------------------------------------------------------------------------
# cases


def make_case(case: str, t: int, n: int, fi):
    """`(fused, torch_formula, flashinfer_or_None, nbytes)`: callables of no argument."""
    import ringlse

    dev, bf = DEV, torch.bfloat16
    lse_bytes, out_bytes = t * H * 4, t * H * D * 2
    nbytes = n * (out_bytes + lse_bytes) + out_bytes + lse_bytes
    fi_fn = None
    if case == "vllm-seq":
        outs = [torch.randn(t, H, D, device=dev, dtype=bf) for _ in range(n)]
        lses = [torch.randn(H, t, device=dev) * 3 for _ in range(n)]
        fused = lambda: ringlse.merge_attn_states(outs, lses)  # noqa: E731
        formula = lambda: vllm_formula(outs, lses)  # noqa: E731
    elif case == "heads-first-stacked":
        o = torch.randn(n, t, H, D, device=dev, dtype=bf)
        l = torch.randn(n, H, t, device=dev) * 3
        fused = lambda: ringlse.merge_attn_states(o, l, dim=0)  # noqa: E731
        formula = lambda: vllm_formula(list(o), list(l))  # noqa: E731
    elif case == "flashinfer-stacked":
        v = torch.randn(t, n, H, D, device=dev, dtype=bf)
        s = torch.randn(t, n, H, device=dev) * 3
        fused = lambda: ringlse.merge_attn_states(v, s, dim=1, lse_layout="tokens_first", lse_base=2.0)  # noqa: E731
        formula = lambda: flashinfer_formula(v, s, 1)  # noqa: E731
        if fi is not None:
            fi_fn = lambda: fi.merge_states(v, s)  # noqa: E731
    elif case == "fa4-stacked":
        o = torch.randn(n, t, H, D, device=dev, dtype=bf)
        l = torch.randn(n, t, H, device=dev) * 3
        fused = lambda: ringlse.merge_attn_states(o, l, dim=0, lse_layout="tokens_first")  # noqa: E731
        formula = lambda: fa4_formula(o, l)  # noqa: E731
    elif case == "flashinfer-seq":
        va, vb = (torch.randn(t, H, D, device=dev, dtype=bf) for _ in range(2))
        sa, sb = (torch.randn(t, H, device=dev) * 3 for _ in range(2))
        fused = lambda: ringlse.merge_attn_states([va, vb], [sa, sb], lse_layout="tokens_first", lse_base=2.0)  # noqa: E731
        formula = lambda: flashinfer_formula(torch.stack([va, vb], 1), torch.stack([sa, sb], 1), 1)  # noqa: E731
        if fi is not None:
            fi_fn = lambda: fi.merge_state(va, sa, vb, sb)  # noqa: E731
    else:
        raise ValueError(case)
    return fused, formula, fi_fn, nbytes


def _rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    fin = torch.isfinite(b)
    return ((a - b).abs()[fin].max() / b.abs()[fin].max().clamp_min(1e-30)).item() if fin.any() else 0.0


def _copy_fn(nbytes: int):
    src = torch.empty(max(1, nbytes // 2), dtype=torch.uint8, device=DEV).random_(0, 255)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _graphed(fn):
    """`fn` captured in a CUDA graph: its replay (GPU time, no host time), or None if capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()
        return g.replay
    except Exception as err:  # noqa: BLE001 (a side that cannot be captured is timed eagerly only)
        print(f"  (no CUDA graph: {type(err).__name__}: {str(err)[:120]})", flush=True)
        return None


def run_row(case, t, n, fi, budget_s, with_formula=True):
    from timing import interleaved_ms

    fused, formula, fi_fn, nbytes = make_case(case, t, n, fi)
    with torch.no_grad():
        got = fused()
        ref = formula()
        err = max(_rel_err(got[0], ref[0]), _rel_err(got[1], ref[1]))
        del got, ref
        sides = {"fused": fused, "copy": _copy_fn(nbytes)}
        if with_formula:
            sides["torch_formula"] = formula
        if fi_fn is not None:
            sides["flashinfer"] = fi_fn
        # eager: what a caller sees (host time included: it dominates at small T)
        ms = interleaved_ms({k: (lambda f: lambda i: f())(f) for k, f in sides.items()}, budget_s=budget_s)
        # GPU time: each side replayed from a CUDA graph
        graphs = {k: _graphed(f) for k, f in sides.items()}
        graphs = {k: g for k, g in graphs.items() if g is not None}
        gms = interleaved_ms({k: (lambda g: lambda i: g())(g) for k, g in graphs.items()}, budget_s=budget_s) if graphs else {}
        del graphs
    row = dict(case=case, T=t, N=n, H=H, D=D, bytes=nbytes, max_rel_err_vs_formula=err)
    for tag, times in (("", ms), ("_graph", gms)):
        for name, v in times.items():
            row[f"{name}{tag}_ms"] = v
            row[f"{name}{tag}_gbs"] = nbytes / v / 1e6
        if "copy" in times:
            for name in times:
                if name != "copy":
                    row[f"{name}_vs_copy{tag}"] = times["copy"] / times[name]
        if "fused" in times:
            for name in times:
                if name not in ("copy", "fused"):
                    row[f"fused_speedup_vs_{name}{tag}"] = times[name] / times["fused"]
    return row


def kernel_rows(budget_s, quick):
    """The stacked kernel vs the four-slot one (N = 2, 4), and the stacked kernel's configurations."""
    from timing import interleaved_ms

    import ringlse.kernels.merge as km

    rows = []
    kts = KERNEL_TS[:1] if quick else KERNEL_TS
    for t in kts:
        for n in (2, 4):
            o = torch.randn(n, t, H, D, device=DEV, dtype=torch.bfloat16)
            l = torch.randn(n, t, H, device=DEV) * 3
            out = torch.empty(t, H, D, device=DEV, dtype=torch.bfloat16)
            out_lse = torch.empty(t, H, device=DEV)
            lv, olv = [x.transpose(-1, -2) for x in l], out_lse.transpose(-1, -2)
            nbytes = n * (o[0].numel() * 2 + l[0].numel() * 4) + out.numel() * 2 + out_lse.numel() * 4
            fns = {
                "slots": lambda i: km.merge_states(list(o), lv, out, olv, stacked=False),
                "stacked": lambda i: km.merge_states(list(o), lv, out, olv, stacked=True),
                "copy": (lambda c: (lambda i: c()))(_copy_fn(nbytes)),
            }
            ms = interleaved_ms(fns, budget_s=budget_s)
            rows.append(dict(what="kernel choice, fa4 layout", T=t, N=n, bytes=nbytes,
                             **{f"{k}_ms": v for k, v in ms.items()},
                             **{f"{k}_vs_copy": ms["copy"] / v for k, v in ms.items() if k != "copy"}))
    t = kts[-1]
    for n in (8, 16):  # the same equally spaced states through the stacked and the tuple kernel
        v = torch.randn(t, n, H, D, device=DEV, dtype=torch.bfloat16)
        s = torch.randn(t, n, H, device=DEV) * 3
        out = torch.empty(t, H, D, device=DEV, dtype=torch.bfloat16)
        out_lse = torch.empty(t, H, device=DEV)
        vs, sv, olv = list(v.unbind(1)), [x.transpose(-1, -2) for x in s.unbind(1)], out_lse.transpose(-1, -2)
        nbytes = n * (t * H * D * 2 + t * H * 4) + t * H * D * 2 + t * H * 4
        fns = {
            "stacked": lambda i: km._launch_stacked(n, vs[0], sv[0], v.stride(1), s.stride(1), out, olv, None, None, True),
            "tuple": lambda i: km._launch_tuple(vs, sv, out, olv, None, None, True),
            "copy": (lambda c: (lambda i: c()))(_copy_fn(nbytes)),
        }
        ms = interleaved_ms(fns, budget_s=budget_s)
        rows.append(dict(what="stacked vs tuple kernel, flashinfer layout", T=t, N=n, bytes=nbytes,
                         **{f"{k}_ms": x for k, x in ms.items()},
                         **{f"{k}_vs_copy": ms["copy"] / x for k, x in ms.items() if k != "copy"}))
    for n in (4, 16):
        v = torch.randn(t, n, H, D, device=DEV, dtype=torch.bfloat16)
        s = torch.randn(t, n, H, device=DEV) * 3
        out = torch.empty(t, H, D, device=DEV, dtype=torch.bfloat16)
        out_lse = torch.empty(t, H, device=DEV)
        sv, olv = [x.transpose(-1, -2) for x in s.unbind(1)], out_lse.transpose(-1, -2)
        nbytes = n * (t * H * D * 2 + t * H * 4) + t * H * D * 2 + t * H * 4
        fns = {"copy": (lambda c: (lambda i: c()))(_copy_fn(nbytes))}
        for br in (8, 16, 32):
            for nw in (4, 8):
                fns[f"rows{br}-warps{nw}"] = (lambda br, nw: lambda i: km.merge_states(
                    list(v.unbind(1)), sv, out, olv, base2=True, stacked=True, block_rows=br, num_warps=nw))(br, nw)
        ms = interleaved_ms(fns, budget_s=budget_s)
        rows.append(dict(what="stacked kernel configs, flashinfer layout", T=t, N=n, bytes=nbytes,
                         default=list(km.stacked_config(D, n)),
                         **{f"{k}_ms": x for k, x in ms.items()},
                         **{f"{k}_vs_copy": ms["copy"] / x for k, x in ms.items() if k != "copy"}))
    return rows


# ---------------------------------------------------------------------------------------------------
# plot


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "fused_vs_copy" in r]
    tag = "_graph" if all(f"fused_vs_copy_graph" in r for r in rows) else ""
    cases = [c for c in CASES if any(r["case"] == c for r in rows)]
    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 4), sharey=True, squeeze=False)
    for ax, case in zip(axes[0], cases):
        for j, n in enumerate(sorted({r["N"] for r in rows if r["case"] == case})):
            rs = sorted((r for r in rows if r["case"] == case and r["N"] == n), key=lambda r: r["T"])
            color = f"C{j}"
            ax.plot([r["T"] for r in rs], [r[f"fused_vs_copy{tag}"] for r in rs], "o-", color=color, label=f"ringlse N={n}")
            if any(f"torch_formula_vs_copy{tag}" in r for r in rs):
                ax.plot([r["T"] for r in rs], [r.get(f"torch_formula_vs_copy{tag}", float("nan")) for r in rs], "x:",
                        color=color, alpha=0.6, label=f"torch formula N={n}")
            if any(f"flashinfer_vs_copy{tag}" in r for r in rs):
                ax.plot([r["T"] for r in rs], [r.get(f"flashinfer_vs_copy{tag}", float("nan")) for r in rs], "s--",
                        color=color, alpha=0.6, label=f"FlashInfer N={n}")
        ax.axhline(0.9, color="k", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_title(case, fontsize=10)
        ax.set_xlabel("tokens T")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("bandwidth / device copy of the same bytes")
    axes[0][0].set_ylim(bottom=0)
    axes[0][0].legend(fontsize=7, loc="lower right")
    timing = "GPU time (CUDA-graph replay)" if tag else "eager"
    fig.suptitle(f"merge_attn_states, bf16, H {H}, D {D}, {timing} — {result['gpu']} ({result['flashinfer']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("wrote", path)


# ---------------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="JSON path")
    ap.add_argument("--plot", help="PNG path")
    ap.add_argument("--plot-from", help="plot an existing JSON (no GPU needed)")
    ap.add_argument("--quick", action="store_true", help="T <= 8K, fewer configurations")
    ap.add_argument("--budget-s", type=float, default=0.4, help="interleaved timing budget per row")
    args = ap.parse_args(argv)
    if args.plot_from:
        with open(args.plot_from) as f:
            plot(json.load(f), args.plot or os.path.splitext(args.plot_from)[0] + ".png")
        return
    import triton

    import ringlse

    gpu = torch.cuda.get_device_name()
    fi, fi_note = _flashinfer()
    print(f"{gpu}  torch {torch.__version__}  triton {triton.__version__}  ringlse {ringlse.__file__}  {fi_note}", flush=True)
    torch.manual_seed(0)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"merge_engines-{gpu.replace(' ', '_')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    result = dict(
        gpu=gpu, torch=torch.__version__, triton=triton.__version__, flashinfer=fi_note,
        command=" ".join([sys.executable, *sys.argv]), date=time.strftime("%Y-%m-%d %H:%M:%S"),
        method="timing.interleaved_ms: launches interleaved fused / copy / formula (/ flashinfer), L2 flushed "
               f"before each, CUDA events, medians, budget {args.budget_s} s per row, eager and again each side "
               "replayed from a CUDA graph (GPU time, *_graph keys); bf16 outs, float32 lse",
        bytes_counted="N outs + N lses read once, out + lse written once; copy: dst.copy_(src) of half those "
                      "bytes (so the same bytes are read + written)",
        rows=[], kernel_rows=[], failures=[], complete=False,
    )
    rows, failures = result["rows"], result["failures"]

    def save():  # after every T, so that a run cut short keeps what it measured
        def ratio(r):
            return r.get("fused_vs_copy_graph", r["fused_vs_copy"])

        ok = [r for r in rows if r["T"] >= 1024]
        if ok:
            worst = min(ok, key=ratio)
            result["headline"] = dict(
                ratio="fused / copy bandwidth, GPU time (CUDA-graph replay) where captured, else eager",
                min_fused_vs_copy_T_ge_1K=ratio(worst), at=dict(case=worst["case"], T=worst["T"], N=worst["N"]),
                below_0_9=[dict(case=r["case"], T=r["T"], N=r["N"], fused_vs_copy=round(ratio(r), 3),
                                eager=round(r["fused_vs_copy"], 3)) for r in rows if ratio(r) < 0.9],
            )
        with open(out, "w") as f:
            json.dump(result, f, indent=1)

    ts = [t for t in TS if not args.quick or t <= 8192]
    t0 = time.time()
    for t in ts:
        for case in CASES:
            for n in ([2] if case == "flashinfer-seq" else NS):
                try:
                    r = run_row(case, t, n, fi, args.budget_s)
                    rows.append(r)
                    print(f"{case:<20} T={t:<6} N={n:<3} fused {r['fused_ms']:.4f} ms {r['fused_gbs']:5.0f} GB/s "
                          f"x copy {r['fused_vs_copy']:.3f} (graph {r.get('fused_vs_copy_graph', float('nan')):.3f}) "
                          f"formula x copy {r.get('torch_formula_vs_copy_graph', float('nan')):.3f} "
                          f"flashinfer x copy {r.get('flashinfer_vs_copy_graph', float('nan')):.3f} "
                          f"err {r['max_rel_err_vs_formula']:.1e} [{time.time() - t0:.0f}s]", flush=True)
                except Exception as err:  # noqa: BLE001 (record, keep going)
                    traceback.print_exc()
                    failures.append(dict(case=case, T=t, N=n, error=f"{type(err).__name__}: {err}"[:500]))
                torch.cuda.empty_cache()
        save()
    try:
        result["kernel_rows"] = kernel_rows(args.budget_s, args.quick)
        for r in result["kernel_rows"]:
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if not k.endswith("_ms")}, flush=True)
    except Exception as err:  # noqa: BLE001
        traceback.print_exc()
        result["kernel_rows"] = [dict(error=f"{type(err).__name__}: {err}"[:500])]
    result["complete"] = True
    save()
    print("wrote", out, flush=True)
    print("headline:", json.dumps(result.get("headline")), flush=True)
    if failures:
        print("FAILURES:", failures, flush=True)
    if args.plot:
        try:
            plot(result, args.plot)
        except Exception as err:  # noqa: BLE001 (no matplotlib on the GPU box: plot later with --plot-from)
            print(f"no plot ({type(err).__name__}: {err}); run with --plot-from {out}", flush=True)


if __name__ == "__main__":
    main()
