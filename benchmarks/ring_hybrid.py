"""Head parallelism x ring on one node, next to the plain ring and PyTorch context parallel
(`benchmarks/ring.py --hybrid`, under torchrun; CONVENTIONS.md §8):

    torchrun --nproc_per_node=4 benchmarks/ring.py --hybrid --budget-s 0.25

On W GPUs, batch 1 x 32 heads x d 128, bf16, causal fwd+bwd, S = `--seqlens` (default 32K and 128K), it
times `ring_attention` as U x R grids (U GPUs of a head group x a ring of R): 2 x W/2, the plain W-rank
ring (U = 1, no head group) and the pure W-way all-to-all (U = W, R = 1), per backend (default `triton`);
a 4K window and packed documents (log-uniform 256-32K, zigzag) on the 2 x W/2 grid at the largest S; and
PyTorch context parallel (both rotate methods, the better kept) with its single-GPU SDPA. Efficiency =
T(full sequence on 1 GPU, same block op) / (W · T). Rank 0 writes `results/ring_hybrid-<W>x<gpu>.json`
(records as `ring.py`'s, plus `grid`, so `report.py` lists them) and a PNG.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ring import (attention_flops, bench_context_parallel, bench_ring_call, bench_sdpa_single, bench_single,
                  mask_inputs, plot_series)
from timing import environment

MODE = "fwd+bwd"


def grids(world: int) -> list[tuple[int, int]]:
    """(U, R) grids timed on `world` GPUs: 2 x W/2, the plain ring (1 x W), the pure all-to-all (W x 1)."""
    out = [(2, world // 2)] if world % 2 == 0 and world > 2 else []
    return out + [(1, world), (world, 1)]


def make_groups(world: int, rank: int, shapes: list[tuple[int, int]]) -> dict[tuple[int, int], dict]:
    """The `ring_attention` keywords of this rank per grid: `group` (ring) and `head_group`; global rank
    `r·U + u` is rank u of head group r (neighbouring GPUs share heads). U = 1 is the plain ring over the
    world (no head group). Every rank creates every group in the same order."""
    out = {}
    for heads_ranks, ring_ranks in shapes:
        if heads_ranks == 1:
            out[(heads_ranks, ring_ranks)] = {}
            continue
        heads = [dist.new_group([r * heads_ranks + u for u in range(heads_ranks)]) for r in range(ring_ranks)]
        rings = [dist.new_group([r * heads_ranks + u for r in range(ring_ranks)]) for u in range(heads_ranks)]
        out[(heads_ranks, ring_ranks)] = dict(group=rings[rank % heads_ranks], head_group=heads[rank // heads_ranks])
    return out


def record(records: list, world: int, impl: str, s: int, b: int, h: int, d: int, ms, single_ms, **extra) -> dict:
    """A record in `ring.py`'s fields (causal fwd+bwd, MHA); masks: FLOPs over the visible pairs."""
    flops = attention_flops(b, h, s, d, True, MODE)
    if "visible_pairs" in extra:
        flops = 4.0 * b * h * d * extra["visible_pairs"] * 3.5
    rec = dict(impl=impl, seqlen=s, heads=h, kv_heads=h, head_dim=d, batch=b, causal=True, mode=MODE, ms=ms,
               single_gpu_ms=single_ms, efficiency=None if not ms or not single_ms else single_ms / (world * ms),
               tflops_per_gpu=None if not ms else flops / (world * ms * 1e-3) / 1e12, **extra)
    records.append(rec)
    return rec


def with_ratios(records: list[dict]) -> list[dict]:
    """Each ringlse record with its time over context parallel's at the same S (no mask)."""
    peer = {r["seqlen"]: r for r in records if r["impl"] == "torch-cp" and r.get("ms")}
    for r in records:
        p = peer.get(r["seqlen"])
        if r["impl"].startswith("ringlse") and "mask" not in r and p and r.get("ms"):
            r["time_ratio_to_torch_cp"] = r["ms"] / p["ms"]
    return records


def plot(records: list[dict], path: Path, world: int, gpu: str) -> None:
    series: dict[str, list] = {}
    for r in records:
        if r.get("ms") is not None:
            series.setdefault(r["impl"] + (f" [{r['mask']}]" if r.get("mask") else ""), []).append(r)
    plot_series(series, ("efficiency (causal fwd+bwd)", "TFLOP/s per GPU (causal fwd+bwd)"),
                f"head parallelism x ring, {world}x {gpu}, batch 1, 32 heads, head dim 128, bf16", path, legend_size=7)


def run_hybrid(args, rank: int, world: int, device: torch.device) -> int:
    """The `--hybrid` run of `ring.py` (its parsed `args`), after the process group exists."""
    b, h, d = 1, args.heads, args.head_dim
    backends = args.backends or ["triton"]
    shapes = grids(world)
    groups = make_groups(world, rank, shapes)
    masks = {name: m for name, m in mask_inputs(max(args.seqlens), shapes[0][1]).items()
             if m["layout"] == "zigzag"} if shapes[0][0] > 1 else {}
    env = environment(world) if rank == 0 else {}
    out_dir = Path(args.out)
    records: list[dict] = []
    singles: dict = {}

    def say(rec: dict) -> None:
        if rank == 0:
            ms = f"{rec['ms']:.2f} ms" if rec.get("ms") else rec.get("error", "failed")
            eff = f"{rec['efficiency']:.2f}" if rec.get("efficiency") else "-"
            print(f"{rec['impl']:<26} S={rec['seqlen']:<7} {rec.get('mask', '')} {ms}  eff {eff}", flush=True)

    def attempt(impl: str, s: int, fn, **extra) -> None:
        try:
            ms, single = fn()
            rec = record(records, world, impl, s, b, h, d, ms, single, **extra)
        except Exception as e:  # record the failure and go on with the other rows
            rec = record(records, world, impl, s, b, h, d, None, None, error=f"{type(e).__name__}: {e}"[:300],
                         **extra)
        torch.cuda.empty_cache()
        say(rec)

    # ringlse first, then the peer's single-GPU SDPA, context parallel last (CONVENTIONS.md §8)
    for s in args.seqlens:
        for be in backends:
            singles[(be, s)] = bench_single(be, b, h, h, s, d, True, MODE, device, args.budget_s)
            for heads_ranks, ring_ranks in shapes:
                n = s // world
                kwargs = groups[(heads_ranks, ring_ranks)]
                attempt(f"ringlse-{be} {heads_ranks}x{ring_ranks}", s,
                        lambda: (bench_ring_call(be, b, h, h, n, d, True, MODE, device, args.budget_s, kwargs),
                                 singles[(be, s)]), grid=[heads_ranks, ring_ranks])
    s = max(args.seqlens)
    for name, m in masks.items():
        for be in backends:
            kwargs = dict(m["kwargs"], **groups[shapes[0]])
            attempt(f"ringlse-{be} {shapes[0][0]}x{shapes[0][1]}", s,
                    lambda: (bench_ring_call(be, b, h, h, s // world, d, True, MODE, device, args.budget_s, kwargs),
                             bench_single(be, b, h, h, s, d, True, MODE, device, args.budget_s, m["kwargs"])),
                    grid=list(shapes[0]), mask=name, **{k: v for k, v in m.items() if k != "kwargs"})
    if not args.no_peer:
        sdpa = {s: bench_sdpa_single(b, h, h, s, d, True, MODE, device, args.budget_s) for s in args.seqlens}
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", (world,))
        for s in args.seqlens:
            per_rotate = {}
            for rotate in ("allgather", "alltoall"):
                try:
                    per_rotate[rotate] = bench_context_parallel(mesh, rotate, b, h, h, s, d, True, MODE, device,
                                                                args.budget_s)
                except Exception as e:  # the peer's failure is a result too
                    per_rotate[rotate] = f"error: {type(e).__name__}: {e}"[:300]
            ok = {r: t for r, t in per_rotate.items() if isinstance(t, float)}
            best = min(ok, key=ok.get) if ok else None
            say(record(records, world, "torch-cp", s, b, h, d, ok.get(best), sdpa[s], rotate=best,
                       per_rotate=per_rotate))
    if rank == 0:
        gpu_tag = env["gpu"].replace("NVIDIA ", "").replace(" ", "-")
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"ring_hybrid-{world}x{gpu_tag}.json"
        path.write_text(json.dumps({
            "benchmark": "head parallelism x ring vs the plain ring and PyTorch context parallel",
            "environment": env,
            "definitions": {
                "grid": "[U, R]: U GPUs of a head group (all-to-all of heads) x a ring of R; [1, W] is the plain ring",
                "efficiency": "T(full sequence on 1 GPU, same block op) / (W * T)",
                "tflops_per_gpu": "4*B*H*S^2*D (halved for causal, x3.5 for fwd+bwd) / (W * time)",
                "time_ratio_to_torch_cp": "ringlse time / PyTorch context parallel time, same S (< 1: faster)",
                "timing": "median of CUDA-event timings after warm-up, max over ranks, barrier before each run",
            },
            "records": with_ratios(records),
        }, indent=1))
        try:
            plot(records, out_dir / f"ring_hybrid-{world}x{gpu_tag}.png", world, env["gpu"])
        except Exception as e:  # the numbers matter more than the picture
            print(f"plot failed: {e}")
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit("run it as: torchrun --nproc_per_node=4 benchmarks/ring.py --hybrid")
