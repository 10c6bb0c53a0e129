"""Markdown tables of the measured results, read only from benchmarks/results/*.json (the README's figures
are pasted from this output, never typed in).

    python3 benchmarks/report.py [--results DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _fmt(x, spec=".2f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "–"


def block_attention(d: dict) -> list[str]:
    lines = [f"**Block attention** ({d['gpu']}, torch {d['torch']}, triton {d['triton']}; `{d['command']}`), "
             "bf16, TFLOP/s (ratio ours / peer):", "",
             "| B×H | S | d | causal | ours fwd | FA2 fwd | cuDNN fwd | ours bwd | FA2 bwd | cuDNN bwd |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in d["rows"]:
        lines.append(
            f"| {r['batch']}×{r['heads']} | {r['seqlen']} | {r['head_dim']} | {r['causal']} | "
            f"{r['ours_fwd_tflops']:.0f} | {r['sdpa_flash_fwd_tflops']:.0f} ({r['fwd_ratio_vs_sdpa_flash']:.2f}×) | "
            f"{r['cudnn_fwd_tflops']:.0f} ({r['fwd_ratio_vs_cudnn']:.2f}×) | {r['ours_bwd_tflops']:.0f} | "
            f"{r['sdpa_flash_bwd_tflops']:.0f} ({r['bwd_ratio_vs_sdpa_flash']:.2f}×) | "
            f"{r['cudnn_bwd_tflops']:.0f} ({r['bwd_ratio_vs_cudnn']:.2f}×) |")
    return lines


def ring(d: dict) -> list[str]:
    env = d["environment"]
    lines = [f"**Ring attention** ({env['gpus']}× {env['gpu']}, torch {env['torch']}, triton {env['triton']}; "
             f"`{env['command']}`), batch 1 × 32 heads × d 128, bf16; efficiency = T(1 GPU, full S) / (W·T(ring)); "
             "ratio = ringlse time / PyTorch context-parallel time (< 1 is faster):", "",
             "| impl | S | kv heads | causal | mode | ms | efficiency | TFLOP/s/GPU | time ratio vs torch CP |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(d["records"], key=lambda r: (r["mode"], r["seqlen"], r["kv_heads"], not r["causal"], r["impl"])):
        ms = _fmt(r.get("ms")) if r.get("ms") is not None else "failed: " + r.get("error", "?")[:60]
        lines.append(f"| {r['impl']}{' (' + r['rotate'] + ')' if r.get('rotate') else ''} | {r['seqlen']} | "
                     f"{r['kv_heads']} | {r['causal']} | {r['mode']} | {ms} | {_fmt(r.get('efficiency'))} | "
                     f"{_fmt(r.get('tflops_per_gpu'), '.0f')} | {_fmt(r.get('time_ratio_to_torch_cp'))} |")
    return lines


def merge(d: dict) -> list[str]:
    lines = [f"**Fused merge** ({d['gpu']}, torch {d['torch']}, triton {d['triton']}); device copy "
             f"{d['copy']['gbs']:.0f} GB/s measured in the same run:", "",
             "| what | shape | block dtype | fused ms | GB/s | × copy | × eager |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in d["rows"]:
        lines.append(f"| {r['what']} | {tuple(r['shape'])} | {r.get('block_dtype') or '–'} | {r['fused_ms']:.3f} | "
                     f"{r['fused_gbs']:.0f} | {_fmt(r.get('fused_vs_copy'))} | {_fmt(r.get('speedup_vs_eager'))} |")
    return lines


def lse_toolkit(d: dict) -> list[str]:
    lines = [f"**LSE toolkit** ({d['gpu']}, torch {d['torch']}, triton {d['triton']}); device copy "
             f"{d['copy_GBps']:.0f} GB/s; speedups are vs `torch.softmax` / `torch.log_softmax` / "
             "`torch.logsumexp` in the same run; eager calls (`do_bench`), and GPU time (CUDA-graph replay, "
             "no host time) where recorded:", "",
             "| op | rows × cols | dtype | fwd GB/s | fwd × copy | fwd × copy, GPU time | fwd × torch | bwd × torch "
             "| GPU time fwd / bwd × torch |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in d["softmax_family"]:
        o = r["ours"]
        gpu = (f"{r['fwd_gpu_speedup']:.2f} / {r['bwd_gpu_speedup']:.2f}" if "fwd_gpu_speedup" in r else "–")
        # the same bytes over the kernels' GPU time (no host time)
        gpu_copy = f"{o['fwd_vs_copy'] * o['fwd_ms'] / o['fwd_gpu_ms']:.2f}" if "fwd_gpu_ms" in o else "–"
        lines.append(f"| {r['op']} | {r['rows']} × {r['cols']} | {r['dtype']} | {o['fwd_GBps']:.0f} | "
                     f"{o['fwd_vs_copy']:.2f} | {gpu_copy} | {r['fwd_speedup']:.2f} | {r['bwd_speedup']:.2f} | {gpu} |")
    lines += ["", "| log_bmm B×N×M×P | ours fwd ms | naive fwd ms | fwd × naive | ours bwd ms | naive bwd ms | bwd × naive "
              "| our peak / (in+out) | naive peak GB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in d["log_bmm"]:
        lines.append(f"| {r['B']}×{r['N']}×{r['M']}×{r['P']} | {r['ours_fwd_ms']:.2f} | {r['naive_fwd_ms']:.2f} | "
                     f"{r['fwd_speedup']:.1f} | {r['ours_bwd_ms']:.2f} | {r['naive_bwd_ms']:.2f} | {r['bwd_speedup']:.1f} | "
                     f"{r['ours_fwd_peak_vs_io']:.2f} | {r['naive_fwd_peak_GB']:.1f} |")
    return lines


def error_growth(d: dict) -> list[str]:
    env, shape = d["environment"], d["shape"]
    w = shape["world"]
    lines = [f"**Error growth with the world size** ({w}× {env['gpu']}, torch {env['torch']}; `{env['command']}`), "
             f"{shape['dtype']}, S {shape['seqlen']}, {shape['heads']} heads × d {shape['head_dim']}, causal "
             f"{shape['layout']}; error at W = {w} / error at W = 1 on the same inputs, range over seeds; RMS errors "
             "averaged over seeds:", "",
             f"| backend | kv heads | result | seeds | RMS error ratio | max error ratio | RMS error W = 1 → W = {w} | "
             "every result within its bound |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in d["summary"]:
        rs = [x for x in d["records"] if x["backend"] == r["backend"] and x["kv_heads"] == r["kv_heads"]]
        one, many = (sum(x["errors"][k]["rms"][r["result"]] for x in rs) / len(rs) for k in ("W1", f"W{w}"))
        lines.append(f"| {r['backend']} | {r['kv_heads']} | {r['result']} | {r['seeds']} | "
                     f"{r['rms_ratio_min']:.3f}–{r['rms_ratio_max']:.3f} | {r['max_ratio_min']:.2f}–{r['max_ratio_max']:.2f} | "
                     f"{one:.2e} → {many:.2e} | {'yes' if r['all_within_bound'] else 'no'} |")
    return lines


def host_time(d: dict) -> list[str]:
    lines = [f"**Host time per call of the LSE launchers** ({d['gpu']}, torch {d['torch']}, triton "
             f"{d['triton']}; `{d['command']}`): {d['method']}; the L2 flush before each `do_bench` call takes "
             f"{d['do_bench_flush_gpu_us']:.1f} µs of GPU time:", "",
             "| rows × cols | dtype | call | host µs per call | kernel launches |", "| --- | --- | --- | --- | --- |"]
    for r in d["calls"]:
        n = "–" if r.get("launches") is None else r["launches"]
        lines.append(f"| {r['rows']} × {r['cols']} | {r['dtype']} | `{r['call']}` | {r['host_us_per_call']:.1f} | {n} |")
    return lines


def generic(name: str, d: dict) -> list[str]:
    """Other result files report their own summary rows (merge, LSE toolkit)."""
    env = {k: d[k] for k in ("gpu", "torch", "triton", "command") if k in d}
    rows = d.get("summary") or d.get("rows") or d.get("records") or []
    lines = [f"**{name}** ({', '.join(f'{k} {v}' for k, v in env.items())}):", ""]
    if rows and isinstance(rows, list) and isinstance(rows[0], dict):
        keys = list(rows[0].keys())[:10]
        lines += ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
        for r in rows:
            lines.append("| " + " | ".join(_fmt(r.get(k), ".3g") if isinstance(r.get(k), float) else str(r.get(k))
                                           for k in keys) + " |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args()
    for path in sorted(Path(args.results).glob("*.json")):
        if "sweep" in path.name:
            continue
        d = json.loads(path.read_text())
        if path.name.startswith("block_attention"):
            lines = block_attention(d)
        elif path.name.startswith("ring"):
            lines = ring(d)
        elif path.name.startswith("merge"):
            lines = merge(d)
        elif path.name.startswith("error_growth"):
            lines = error_growth(d)
        elif path.name.startswith("lse_toolkit"):
            lines = lse_toolkit(d)
        elif path.name.startswith("host_time"):
            lines = host_time(d)
        else:
            lines = generic(path.stem, d)
        print(f"<!-- from benchmarks/results/{path.name} -->")
        print("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
