"""Ring attention speed on one node, next to PyTorch context parallel (CONVENTIONS.md §8), under torchrun:

    torchrun --nproc_per_node=4 benchmarks/ring.py [--seqlens 32768 131072] [--backends triton sdpa] [--quick]
    torchrun --nproc_per_node=4 benchmarks/ring.py --documents    # packed documents, every layout
    torchrun --nproc_per_node=4 benchmarks/ring.py --hybrid --budget-s 0.25   # head parallelism x ring

For every shape (batch 1 x 32 heads x head dim 128, bf16; total S; causal or not; forward or
forward+backward; MHA and GQA 32/8) it times, on all ranks at once (median of CUDA-event timings, max over
ranks):
  - ringlse `ring_attention` per backend, and the same backend on the full sequence on one GPU;
  - PyTorch context parallel (`context_parallel` + `F.scaled_dot_product_attention`, both rotate
    methods, the better reported) and SDPA on the full sequence on one GPU.
Efficiency = T(full sequence, one GPU, same block op) / (W * T(ring)). Rank 0 shows progress, writes
`benchmarks/results/ring-<W>x<gpu>.json` and a PNG of efficiency and TFLOP/s per GPU versus S.
`--documents` runs `ring_documents.py` instead (its own shape and file, `ring_documents-<W>x<gpu>.json`).
`--hybrid`: head parallelism x ring grids instead (`benchmarks/ring_hybrid.py`), `ring_hybrid-<W>x<gpu>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ringlse
from timing import environment  # GPU, versions, command, NCCL settings of a run

try:
    from tqdm import tqdm
except ImportError:  # progress bars are a convenience only
    tqdm = None


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--backends", nargs="+", default=None, help="default: every GPU backend available")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--gqa-kv-heads", type=int, default=8, help="also run GQA with this many kv heads (0: skip)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--causal", nargs="+", default=["yes", "no"], choices=["yes", "no"])
    p.add_argument("--no-peer", action="store_true", help="skip PyTorch context parallel")
    p.add_argument("--masks", action="store_true", help="also windows of 4K and packed documents (log-uniform "
                   "256-32K) at the largest S, causal fwd+bwd, MHA (no peer: context parallel takes neither)")
    p.add_argument("--only-masks", action="store_true", help="the --masks rows alone")
    p.add_argument("--documents", action="store_true", help="packed documents in every layout, 8K tokens per GPU, "
                   "GQA 64/8 (benchmarks/ring_documents.py; its own result file)")
    p.add_argument("--budget-s", type=float, default=1.5, help="target seconds of timed runs per measurement")
    p.add_argument("--hybrid", action="store_true", help="head parallelism x ring (U x R grids, causal fwd+bwd; "
                   "benchmarks/ring_hybrid.py) next to the plain ring and context parallel")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    return p.parse_args()


def gpu_name_tag(gpu: str) -> str:
    """The GPU as result file names carry it: `NVIDIA H100 80GB HBM3` -> `H100-80GB-HBM3`."""
    return gpu.replace("NVIDIA ", "").replace(" ", "-")


def attention_flops(b: int, h: int, s: int, d: int, causal: bool, mode: str) -> float:
    """CONVENTIONS.md §8: 4·B·H·S²·D, halved for causal; backward = 2.5x forward."""
    f = 4.0 * b * h * s * s * d / (2 if causal else 1)
    return f * (3.5 if mode == "fwd+bwd" else 1.0)


def event_ms(fn) -> float:
    """Milliseconds of one `fn()` between two CUDA events, waited for."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def timed_ms(fn, budget_s: float) -> float:
    """Median milliseconds of `fn()` over repeated runs on every rank, max over ranks."""
    fn()  # warm-up: compilation, autotuning, allocator
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = time.perf_counter() - t0
    # every rank must run the same number of barriers: agree on the repetition count
    reps_t = torch.tensor([max(3, min(20, int(budget_s / max(est, 1e-4))))], device="cuda")
    dist.all_reduce(reps_t, op=dist.ReduceOp.MAX)
    reps = int(reps_t.item())
    times = []
    for _ in range(reps):
        dist.barrier()  # start together: the ring waits for its slowest rank anyway
        times.append(event_ms(fn))
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def make_step(attn, q, k, v, dout, mode: str):
    """A closure running one forward (no grad) or forward+backward of `attn(q, k, v) -> out`."""
    if mode == "fwd":
        def step():
            with torch.no_grad():
                attn(q, k, v)
        return step
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def step():
        for t in leaves:
            t.grad = None
        attn(*leaves).backward(dout)
    return step


def rand(*shape, device):
    return torch.randn(*shape, device=device, dtype=torch.bfloat16)


def bench_ringlse(backend, b, h, hkv, s, d, causal, mode, world, device, budget, mask=None):
    """(ring ms, one GPU ms) of `backend`; `mask`: `window_size` / `cu_seqlens` (global) for both."""
    ring_ms = bench_ring_call(backend, b, h, hkv, s // world, d, causal, mode, device, budget, mask or {})
    return ring_ms, bench_single(backend, b, h, hkv, s, d, causal, mode, device, budget, mask)


def bench_ring_call(backend, b, h, hkv, n, d, causal, mode, device, budget, kwargs: dict) -> float:
    """ms of `ring_attention` on `n` local tokens per rank, with `kwargs` (mask, groups) for the call."""
    q, dout = rand(b, n, h, d, device=device), rand(b, n, h, d, device=device)
    k, v = rand(b, n, hkv, d, device=device), rand(b, n, hkv, d, device=device)
    ring = make_step(lambda q_, k_, v_: ringlse.ring_attention(q_, k_, v_, causal=causal, backend=backend, **kwargs),
                     q, k, v, dout, mode)
    return timed_ms(ring, budget)


def bench_single(backend, b, h, hkv, s, d, causal, mode, device, budget, mask=None) -> float:
    """ms of `backend` on the full sequence on one GPU (every rank times its own), with the ring's mask."""
    qf, doutf = rand(b, s, h, d, device=device), rand(b, s, h, d, device=device)
    kf, vf = rand(b, s, hkv, d, device=device), rand(b, s, hkv, d, device=device)
    full_mask = {k_: v_ for k_, v_ in (mask or {}).items() if k_ != "layout"}
    single = make_step(lambda q_, k_, v_: ringlse.attention(q_, k_, v_, causal=causal, backend=backend, **full_mask),
                       qf, kf, vf, doutf, mode)
    return timed_ms(single, budget)


def sdpa_bhsd(causal, gqa):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def bench_sdpa_single(b, h, hkv, s, d, causal, mode, device, budget):
    q, dout = rand(b, h, s, d, device=device), rand(b, h, s, d, device=device)
    k, v = rand(b, hkv, s, d, device=device), rand(b, hkv, s, d, device=device)
    return timed_ms(make_step(sdpa_bhsd(causal, hkv != h), q, k, v, dout, mode), budget)


def bench_context_parallel(mesh, rotate, b, h, hkv, s, d, causal, mode, device, budget):
    """PyTorch context parallel with the CONVENTIONS.md §8 settings (load balancing = causal)."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    _cp_options.enable_load_balance = causal
    set_rotate_method(rotate)
    q, dout = rand(b, h, s, d, device=device), rand(b, h, s, d, device=device)
    k, v = rand(b, hkv, s, d, device=device), rand(b, hkv, s, d, device=device)
    bufs = [q, k, v, dout]
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
        return timed_ms(make_step(sdpa_bhsd(causal, hkv != h), q, k, v, dout, mode), budget)


def mask_inputs(s: int, world: int) -> dict[str, dict]:
    """Windows of 4K (the default layout, zigzag) and packed documents (log-uniform lengths in [256, 32K],
    seed 0) in the `zigzag` and `stripe` layouts (zigzag's work imbalance is 1.2-1.7 at W = 4 there,
    stripe's 1.00: mask_balance.json) over S: the ring's keyword arguments, the visible pairs and the
    causal work imbalance (max/mean over ranks) of the layout."""
    from mask_balance import log_uniform_documents

    from ringlse.masks import Rule, visible_per_position
    from ringlse.ring.layout import imbalance

    docs = log_uniform_documents(s, 256, 32768, 0)
    doc_rule = Rule(True, docs=docs)
    out = {}
    for name, kwargs, rule in (("window 4K", dict(window_size=(4096, 0), layout="zigzag"), Rule(True, window=(4096, 0))),
                               *((f"{len(docs) - 1} documents, log-uniform 256-32K, {layout}",
                                  dict(cu_seqlens=docs, layout=layout), doc_rule) for layout in ("zigzag", "stripe"))):
        out[name] = dict(kwargs=kwargs, visible_pairs=int(visible_per_position(rule, s).sum()),
                         layout=kwargs["layout"], imbalance=imbalance(rule, kwargs["layout"], world, s))
    return out


def plot(records: list[dict], path: Path, world: int, gpu: str) -> None:
    series: dict[str, list] = {}
    for r in records:
        if r["mode"] != "fwd+bwd" or r["kv_heads"] != r["heads"] or r.get("ms") is None or "mask" in r:
            continue
        series.setdefault(f"{r['impl']} {'causal' if r['causal'] else 'full'}", []).append(r)
    plot_series(series, ("ring efficiency (fwd+bwd)", "TFLOP/s per GPU (fwd+bwd)"),
                f"{world}x {gpu}, batch 1, 32 heads, head dim 128, bf16", path, legend_size=8)


def plot_series(series: dict[str, list[dict]], titles: tuple[str, str], suptitle: str, path: Path,
                legend_size: int) -> None:
    """Efficiency (left) and TFLOP/s per GPU (right) of each series of records over the total sequence
    length (log 2): PyTorch's dashed, masked ones (a `[...]` in the key) as crosses; the figure saved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["seqlen"])
        xs = [r["seqlen"] for r in rs]
        style = "--" if key.startswith("torch") else ("" if "[" in key else "-")
        for ax, field in zip(axes, ("efficiency", "tflops_per_gpu")):
            ys = [r[field] for r in rs]
            if all(y is not None for y in ys):
                ax.plot(xs, ys, style, marker="x" if "[" in key else "o", label=key)
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("total sequence length")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=legend_size)
    fig.suptitle(suptitle)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    ringlse.tune_nccl_env()  # the same NCCL settings for ringlse and the peer
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10),
                            pg_options=ringlse.nccl_options(datetime.timedelta(minutes=10)))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if args.documents:
        from ring_documents import run

        path = run(args, environment(world) if rank == 0 else {}, rank, world, device)
        if rank == 0:
            print(f"wrote {path}")
        dist.barrier()
        dist.destroy_process_group()
        return 0
    if args.hybrid:
        from ring_hybrid import run_hybrid

        return run_hybrid(args, rank, world, device)
    backends = args.backends or [b for b in ("triton", "sdpa", "flash") if b in ringlse.available_backends(device)]
    b, h, d = 1, args.heads, args.head_dim
    shapes = []
    for s in args.seqlens:
        for causal in [c == "yes" for c in args.causal]:
            for mode in args.modes:
                shapes.append((s, h, causal, mode))
                if args.gqa_kv_heads and mode == "fwd+bwd" and s == min(args.seqlens):
                    shapes.append((s, args.gqa_kv_heads, causal, mode))
    masks = mask_inputs(max(args.seqlens), world) if args.masks or args.only_masks else {}
    if args.only_masks:
        shapes = []
    records: list[dict] = []

    def record(impl, s, hkv, causal, mode, ms, single_ms, **extra):
        flops = attention_flops(b, h, s, d, causal, mode)
        if "visible_pairs" in extra:  # masks: FLOPs over the visible pairs
            flops = 4.0 * b * h * d * extra["visible_pairs"] * (3.5 if mode == "fwd+bwd" else 1.0)
        rec = dict(impl=impl, seqlen=s, heads=h, kv_heads=hkv, head_dim=d, batch=b, causal=causal, mode=mode,
                   ms=ms, single_gpu_ms=single_ms,
                   efficiency=None if ms is None or single_ms is None else single_ms / (world * ms),
                   tflops_per_gpu=None if ms is None else flops / (world * ms * 1e-3) / 1e12, **extra)
        records.append(rec)
        return rec

    # ringlse first, then the peer's single-GPU SDPA, and context parallel last: an exception inside a
    # context_parallel block can leave its SDPA dispatcher active (CONVENTIONS.md §8).
    todo = [("ringlse", be, shp) for shp in shapes for be in backends]
    todo += [("ringlse-mask", be, (max(args.seqlens), h, True, "fwd+bwd", name)) for name in masks for be in backends]
    if not args.no_peer:
        todo += [("sdpa-single", None, shp) for shp in shapes] + [("cp", None, shp) for shp in shapes]
    env = environment(world) if rank == 0 else {}
    out_dir = Path(args.out)

    def save() -> Path:
        """Write what was measured so far (rank 0): a run cut short still leaves its numbers."""
        peer = {(r["seqlen"], r["kv_heads"], r["causal"], r["mode"]): r for r in records if r["impl"] == "torch-cp"}
        for r in records:  # wall-clock ratio to the peer at the same shape (< 1 is faster)
            p = peer.get((r["seqlen"], r["kv_heads"], r["causal"], r["mode"]))
            if r["impl"].startswith("ringlse") and "mask" not in r and p and p.get("ms") and r.get("ms"):
                r["time_ratio_to_torch_cp"] = r["ms"] / p["ms"]
        gpu_tag = gpu_name_tag(env["gpu"])
        out_dir.mkdir(parents=True, exist_ok=True)
        result = {
            "benchmark": "ring attention vs PyTorch context parallel",
            "environment": env,
            "definitions": {
                "efficiency": "T(full sequence on 1 GPU, same block op) / (W * T(ring on W GPUs))",
                "tflops_per_gpu": "4*B*H*S^2*D (halved for causal, x3.5 for fwd+bwd) / (W * time)",
                "time_ratio_to_torch_cp": "ringlse time / PyTorch context parallel time, same shape (< 1: faster)",
                "timing": "median of CUDA-event timings after warm-up, max over ranks, barrier before each run",
            },
            "complete": len(records) >= len(todo) - len(shapes),
            "records": records,
        }
        path = out_dir / f"ring-{world}x{gpu_tag}.json"
        path.write_text(json.dumps(result, indent=1))
        return path

    bar = tqdm(todo, desc="ring bench", disable=rank != 0 or tqdm is None, file=sys.stdout)
    single_sdpa: dict = {}
    mesh = None
    for kind, be, (s, hkv, causal, mode, *mask_name) in bar:
        label = f"{kind}{':' + be if be else ''} S={s} hkv={hkv} causal={causal} {mode} {' '.join(mask_name)}"
        if tqdm is None and rank == 0:
            print(label, flush=True)
        else:
            bar.set_postfix_str(label)
        try:
            if kind == "ringlse":
                ring_ms, single_ms = bench_ringlse(be, b, h, hkv, s, d, causal, mode, world, device, args.budget_s)
                rec = record(f"ringlse-{be}", s, hkv, causal, mode, ring_ms, single_ms)
            elif kind == "ringlse-mask":
                m = masks[mask_name[0]]
                ring_ms, single_ms = bench_ringlse(be, b, h, hkv, s, d, causal, mode, world, device, args.budget_s,
                                                   mask=m["kwargs"])
                rec = record(f"ringlse-{be}", s, hkv, causal, mode, ring_ms, single_ms, mask=mask_name[0],
                             **{k_: v_ for k_, v_ in m.items() if k_ != "kwargs"})
            elif kind == "sdpa-single":
                single_sdpa[(s, hkv, causal, mode)] = bench_sdpa_single(b, h, hkv, s, d, causal, mode, device, args.budget_s)
                continue
            else:
                if mesh is None:
                    from torch.distributed.device_mesh import init_device_mesh

                    mesh = init_device_mesh("cuda", (world,))
                per_rotate = {}
                for rotate in ("allgather", "alltoall"):
                    try:
                        per_rotate[rotate] = bench_context_parallel(mesh, rotate, b, h, hkv, s, d, causal, mode,
                                                                    device, args.budget_s)
                    except Exception as e:  # record the peer's failure rather than abort the run
                        per_rotate[rotate] = f"error: {type(e).__name__}: {e}"[:300]
                ok = {r: t for r, t in per_rotate.items() if isinstance(t, float)}
                best = min(ok, key=ok.get) if ok else None
                rec = record("torch-cp", s, hkv, causal, mode, ok.get(best), single_sdpa.get((s, hkv, causal, mode)),
                             rotate=best, per_rotate=per_rotate)
        except Exception as e:
            rec = record(f"ringlse-{be}" if kind.startswith("ringlse") else "torch-cp", s, hkv, causal, mode, None,
                         None, error=f"{type(e).__name__}: {e}"[:300], **({"mask": mask_name[0]} if mask_name else {}))
            torch.cuda.empty_cache()
        if rank == 0:
            eff = f"{rec['efficiency']:.2f}" if rec.get("efficiency") else "-"
            ms = f"{rec['ms']:.2f} ms" if rec.get("ms") else rec.get("error", "failed")
            (bar.write if tqdm is not None else print)(f"{rec['impl']:<15} S={s:<7} hkv={hkv:<3} causal={causal!s:<5} "
                                                       f"{mode:<8} {' '.join(mask_name)} {ms}  eff {eff}")
            save()
        torch.cuda.empty_cache()

    if rank == 0:
        path = save()
        try:
            gpu_tag = gpu_name_tag(env["gpu"])
            plot(records, out_dir / f"ring-{world}x{gpu_tag}.png", world, env["gpu"])
        except Exception as e:
            print(f"plot failed: {e}")
        print(f"\nwrote {path}")
        print(f"{'impl':<15} {'S':>7} {'hkv':>4} {'causal':>6} {'mode':>8} {'ms':>9} {'eff':>5} {'TF/gpu':>7} {'vs cp':>6}")
        for r in records:
            f = lambda x, fmt: format(x, fmt) if isinstance(x, float) else "-"
            print(f"{r['impl']:<15} {r['seqlen']:>7} {r['kv_heads']:>4} {r['causal']!s:>6} {r['mode']:>8} "
                  f"{f(r['ms'], '9.2f')} {f(r['efficiency'], '5.2f')} {f(r['tflops_per_gpu'], '7.1f')} "
                  f"{f(r.get('time_ratio_to_torch_cp'), '6.2f')}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
