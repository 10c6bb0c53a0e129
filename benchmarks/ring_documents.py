"""`benchmarks/ring.py --documents`: the ring over packed documents in every layout, next to the same
backend on the whole packed sequence on one GPU (CONVENTIONS.md §8), under torchrun:

    torchrun --nproc_per_node=4 benchmarks/ring.py --documents

Shape: 8K tokens per GPU, GQA 64 query heads : 8 KV heads, head dim 128, bf16, causal, batch 1. Document
sets (`mask_balance.document_set`): `loguniform` (lengths log-uniform in [256, 16K], `random.Random(0)`)
and `equal2k`. Layouts: contiguous, zigzag, stripe, balanced. Backends: `triton`, and `fa4`, `sdpa`
where installed (without intervals they take documents as one call per document; in `stripe` the ring
refuses them, and the refusal is recorded as the row's `error`; their one-GPU figures are still measured).

FLOPs count the visible pairs exactly (`ringlse.masks.visible_per_position`): forward
`4 · pairs · head dim · heads`, backward 2.5x that; `bwd` times are fwd+bwd minus fwd. Rank 0 writes
`benchmarks/results/ring_documents-<W>x<gpu>.json` after every row (a run cut short keeps its rows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import ringlse
from mask_balance import DOCUMENT_SETS, document_set
from ringlse.masks import Rule, visible_per_position
from ringlse.ring.layout import LAYOUT_NAMES, imbalance, layout_of, segments

TOKENS_PER_GPU, HEADS, KV_HEADS, HEAD_DIM = 8192, 64, 8, 128
BACKENDS = ("triton", "fa4", "sdpa")
BWD_FLOPS = 2.5  # CONVENTIONS.md §8: backward = 2.5x forward


def visible_pairs(docs: tuple[int, ...]) -> int:
    """Visible (query, key) pairs of the whole packed sequence under causal masking and `docs`."""
    return int(visible_per_position(Rule(True, docs=docs), docs[-1]).sum())


def forward_flops(pairs: int, head_dim: int = HEAD_DIM, heads: int = HEADS, batch: int = 1) -> float:
    """Forward FLOPs of attention over `pairs` visible pairs: `4 · pairs · d · heads · batch`."""
    return 4.0 * pairs * head_dim * heads * batch


def tflops_per_gpu(flops: float, ms: float | None, gpus: int = 1) -> float | None:
    return None if ms is None or ms <= 0 else flops / (gpus * ms * 1e-3) / 1e12


def result_name(world: int, gpu: str) -> str:
    """`ring_documents-<W>x<gpu>.json`, the GPU named as `benchmarks/ring.py` names it."""
    from ring import gpu_name_tag

    return f"ring_documents-{world}x{gpu_name_tag(gpu)}.json"


def row_of(backend: str, layout: str, docs_name: str, docs: tuple[int, ...], world: int, times: dict,
           single: dict, error: str | None = None) -> dict:
    """One result row from the ring's `times` (`fwd`, `fwd+bwd` ms) and the one-GPU `single` ones."""
    pairs, seqlen = visible_pairs(docs), docs[-1]
    flops = forward_flops(pairs)
    placed = layout_of(layout, docs, seqlen, "benchmark")
    bwd = lambda t: None if t.get("fwd") is None or t.get("fwd+bwd") is None else t["fwd+bwd"] - t["fwd"]  # noqa: E731
    return dict(
        backend=backend, layout=layout, docs=docs_name, world=world, seqlen=seqlen, documents=len(docs) - 1,
        visible_pairs=pairs, imbalance=imbalance(Rule(True, docs=docs), placed, world, seqlen),
        max_runs=max(len(segments(placed, r, world, seqlen // world)) for r in range(world)),
        fwd_ms=times.get("fwd"), fwd_bwd_ms=times.get("fwd+bwd"),
        fwd_tflops_per_gpu=tflops_per_gpu(flops, times.get("fwd"), world),
        bwd_tflops_per_gpu=tflops_per_gpu(BWD_FLOPS * flops, bwd(times), world),
        single_fwd_tflops=tflops_per_gpu(flops, single.get("fwd")),
        single_bwd_tflops=tflops_per_gpu(BWD_FLOPS * flops, bwd(single)),
        single_error=single.get("error"), error=error)


def _single_ms(fn, budget_s: float) -> float:
    """Median ms of `fn()` on this GPU alone (CUDA events after a warm-up; no collective)."""
    from ring import event_ms

    fn()
    torch.cuda.synchronize()
    times = []
    while sum(times) < budget_s * 1e3 and len(times) < 50 or len(times) < 3:
        times.append(event_ms(fn))
    return statistics.median(times)


def _single(backend: str, docs: tuple[int, ...], device, budget_s: float) -> dict:
    """Rank 0: fwd and fwd+bwd ms of `ringlse.attention` on the whole packed sequence (or the error)."""
    from ring import make_step, rand

    s = docs[-1]
    q, dout = rand(1, s, HEADS, HEAD_DIM, device=device), rand(1, s, HEADS, HEAD_DIM, device=device)
    k, v = rand(1, s, KV_HEADS, HEAD_DIM, device=device), rand(1, s, KV_HEADS, HEAD_DIM, device=device)
    attn = lambda q_, k_, v_: ringlse.attention(q_, k_, v_, causal=True, cu_seqlens=docs, backend=backend)  # noqa: E731
    try:
        return {mode: _single_ms(make_step(attn, q, k, v, dout, mode), budget_s) for mode in ("fwd", "fwd+bwd")}
    except Exception as e:  # noqa: BLE001 - a backend that cannot run is a row, not a crash
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def _ring(backend: str, layout: str, docs: tuple[int, ...], world: int, device, budget_s: float) -> dict:
    """fwd and fwd+bwd ms of the ring (max over ranks), or `ValueError` when the ring refuses (every rank)."""
    from ring import make_step, rand, timed_ms

    n = docs[-1] // world
    full = [rand(1, docs[-1], h, HEAD_DIM, device=device) for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)]
    q, k, v, dout = (ringlse.shard(t, layout, cu_seqlens=docs) for t in full)
    del full
    assert q.shape[1] == n

    def attn(q_, k_, v_):
        return ringlse.ring_attention(q_, k_, v_, causal=True, layout=layout, cu_seqlens=docs, backend=backend)

    with torch.no_grad():
        attn(q, k, v)  # refuses (ValueError on every rank) before any timing
    return {mode: timed_ms(make_step(attn, q, k, v, dout, mode), budget_s) for mode in ("fwd", "fwd+bwd")}


def run(args: argparse.Namespace, env: dict, rank: int, world: int, device) -> Path | None:
    """Every (backend, docs, layout) row on the initialised NCCL group; rank 0 writes the file."""
    seqlen = TOKENS_PER_GPU * world
    backends = args.backends or [b for b in BACKENDS if b in ringlse.available_backends(device)]
    layouts = list(LAYOUT_NAMES)
    path = Path(args.out) / result_name(world, env.get("gpu", "cpu"))
    rows: list[dict] = []

    def save() -> None:
        if rank != 0:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "benchmark": "ring attention over packed documents, every layout",
            "environment": env,
            "shape": dict(batch=1, tokens_per_gpu=TOKENS_PER_GPU, seqlen=seqlen, heads=HEADS, kv_heads=KV_HEADS,
                          head_dim=HEAD_DIM, dtype="bfloat16", causal=True),
            "definitions": {
                "flops": "forward 4 * visible pairs * head_dim * heads; backward 2.5x forward",
                "fwd_tflops_per_gpu": "forward FLOPs / (W * ring fwd time)",
                "bwd_tflops_per_gpu": "backward FLOPs / (W * (ring fwd+bwd time - ring fwd time))",
                "single_*_tflops": "the same backend's ringlse.attention on the whole packed sequence, one GPU",
                "imbalance": "max / mean over ranks of visible pairs of the rank's queries",
                "max_runs": "the most position runs one rank holds in the layout",
                "timing": "ring: median of CUDA-event timings after warm-up, max over ranks; one GPU: median",
            },
            "complete": len(rows) == len(backends) * len(DOCUMENT_SETS) * len(layouts),
            "rows": rows,
        }, indent=1))

    for backend in backends:
        for docs_name in DOCUMENT_SETS:
            docs = document_set(docs_name, seqlen)
            single = _single(backend, docs, device, args.budget_s) if rank == 0 else {}
            torch.cuda.empty_cache()
            dist.barrier()
            for layout in layouts:
                error, times = None, {}
                try:
                    times = _ring(backend, layout, docs, world, device, args.budget_s)
                except ValueError as e:  # the ring refused on every rank: recorded, the group goes on
                    error = f"ValueError: {e}"[:300]
                rows.append(row_of(backend, layout, docs_name, docs, world, times, single, error))
                if rank == 0:
                    r = rows[-1]
                    fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
                    print(f"{backend:<7} {docs_name:<10} {layout:<10} fwd {fmt(r['fwd_tflops_per_gpu'])} bwd "
                          f"{fmt(r['bwd_tflops_per_gpu'])} TFLOP/s/GPU (one GPU {fmt(r['single_fwd_tflops'])} / "
                          f"{fmt(r['single_bwd_tflops'])}), imbalance {r['imbalance']:.3f}, runs {r['max_runs']}"
                          + (f"  {error}" if error else ""), flush=True)
                save()
                torch.cuda.empty_cache()
    return path if rank == 0 else None


if __name__ == "__main__":
    sys.exit("run it as: torchrun --nproc_per_node=4 benchmarks/ring.py --documents")
