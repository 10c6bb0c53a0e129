"""Peak GPU memory of the ring per rank against single-GPU attention, under torchrun:

    torchrun --nproc_per_node=1 benchmarks/memory.py [--seqlens 8192 32768] [--backends triton sdpa]
                                                     [--fake-worlds 2 4 8] [--out DIR]

For every backend and S (tokens per rank; batch 1, 32 heads, head dim 128, bf16, causal) it measures
`torch.cuda.max_memory_allocated` over one forward + backward (`out.backward(dout)`), above what was
allocated before (the inputs, `dout`), after a warm-up call and `gc.collect()`:
  - `ringlse.attention` on the S tokens (the single-GPU reference);
  - `ring_attention` over the torchrun group (a group of one: no K/V moves, so this shows the ring's
    float32 accumulators alone; with more ranks, every rank's peak, S tokens each);
  - with more ranks, PyTorch context parallel (`context_parallel` + `F.scaled_dot_product_attention`,
    load balancing on, each rotate method) on the same S tokens per rank: the peer's peak per rank;
  - with one rank, `ring_attention` as rank r of a W-rank ring for every r and each W of
    `--fake-worlds`: a fake process group (`torch.testing._internal.distributed.fake_pg`) whose
    transfers complete at once and move nothing (received buffers hold garbage: the results mean
    nothing, the allocations are a real rank's). On CPU, the same ranks counted with
    tests/live_bytes.py match real gloo ranks to within 1 KiB (the agreement's few tensors, which
    this skips: `ring_plan(agree=False)`). It shows the point-to-point K/V transport only, never the
    copy-engine pulls that real ranks on one host use.
Each row carries the bound: two K/V blocks (bf16) and the float32 accumulators (`out`,
`lse`; `dq`, `dk`, `dv`), and what the ring added over the single-GPU peak. Writes
`DIR/memory-<gpu>.json` (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import ringlse

HEADS, HEAD_DIM, DTYPE = 32, 128, torch.bfloat16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[8192, 32768], help="tokens per rank")
    p.add_argument("--backends", nargs="+", default=["triton", "sdpa"], help="unavailable ones are skipped")
    p.add_argument("--heads", type=int, default=HEADS)
    p.add_argument("--kv-heads", type=int, default=HEADS)
    p.add_argument("--head-dim", type=int, default=HEAD_DIM)
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous", "stripe"])
    p.add_argument("--fake-worlds", type=int, nargs="*", default=[2, 4, 8],
                   help="ring sizes simulated with a fake process group (one rank only; none: skip)")
    p.add_argument("--no-peer", dest="peer", action="store_false",
                   help="with several ranks, skip PyTorch context parallel")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    return p.parse_args(argv)


def bound_terms(b: int, n: int, h: int, hkv: int, d: int, itemsize: int) -> dict[str, int]:
    """The allowance in bytes: two K/V blocks as they travel (input dtype) and the ring's
    float32 accumulators, forward (`out`, `lse`) and backward (`dq`, `dk`, `dv`)."""
    kv_block = 2 * b * n * hkv * d * itemsize
    forward_acc = 4 * (b * n * h * d + b * h * n)
    backward_acc = 4 * (b * n * h * d + 2 * b * n * hkv * d)
    return dict(kv_block_bytes=kv_block, forward_accumulator_bytes=forward_acc,
                backward_accumulator_bytes=backward_acc, bound_bytes=2 * kv_block + forward_acc + backward_acc)


def inputs(b: int, n: int, h: int, hkv: int, d: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((b, n, h, d), (b, n, hkv, d), (b, n, hkv, d), (b, n, h, d))
    return [torch.randn(s, generator=gen, device="cuda", dtype=DTYPE) for s in shapes]


def peaks(fn, q, k, v, dout) -> dict[str, int]:
    """Peak bytes allocated above the start over the forward and over forward + backward of
    `fn(q, k, v) -> out`, after one warm-up call (kernel compilation, the ring's plans and comm)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    fn(*leaves).backward(dout)
    for t in leaves:
        t.grad = None
    gc.collect()  # a first call's lazy imports can leave frames (and their tensors) in reference cycles
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(*leaves)
    torch.cuda.synchronize()
    forward = torch.cuda.max_memory_allocated() - base
    out.backward(dout)
    torch.cuda.synchronize()
    total = torch.cuda.max_memory_allocated() - base
    del out, leaves
    return dict(forward_peak_bytes=forward, peak_bytes=total)


def single_fn(backend: str):
    return lambda q, k, v: ringlse.attention(q, k, v, causal=True, backend=backend)


def ring_fn(backend: str, layout: str, fake: bool):
    if not fake:
        return lambda q, k, v: ringlse.ring_attention(q, k, v, causal=True, layout=layout, backend=backend)
    from ringlse import ops
    from ringlse.specs import RingSpec

    # no agreement: it needs a gloo twin of the group, which a fake group cannot make
    spec = RingSpec.make(causal=True, softmax_scale=None, group=None, layout=layout, return_lse=False,
                         window_size=(-1, -1), cu_seqlens=None, backend=backend, timeout=None, agree=False)
    return lambda q, k, v: ops.ring(q, k, v, spec)[0]


def cp_peaks(mesh, rotate: str, shape: tuple[int, ...], seed: int) -> dict[str, int]:
    """`peaks` of PyTorch context parallel over `mesh` (every rank) with `rotate` on `shape`'s tokens per
    rank: the global `[b, h, S, d]` inputs are sharded in place on entry, before anything is counted."""
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    b, n, h, hkv, d = shape
    _cp_options.enable_load_balance = True
    set_rotate_method(rotate)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = (torch.randn(b, heads, n * mesh.size(), d, generator=gen, device="cuda", dtype=DTYPE)
                     for heads in (h, hkv, hkv, h))
    bufs = [q, k, v, dout]
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
        return peaks(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv != h),
                     q, k, v, dout)


def measure(fn, shape: tuple[int, ...], seed: int) -> dict:
    """`peaks` of `fn` on fresh inputs of `shape`, or the error (out of memory: the row says so)."""
    return guarded(lambda: peaks(fn, *inputs(*shape, seed=seed)))


def guarded(thunk) -> dict:
    """`thunk()`'s peaks, or the error it raised; the memory it left is freed either way."""
    try:
        return thunk()
    except (torch.cuda.OutOfMemoryError, RuntimeError, ValueError) as e:
        return dict(error=f"{type(e).__name__}: {e}"[:300])
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def gathered_rows(kind: str, backend: str, mine: dict, shape, single: dict, device) -> list[dict]:
    """Every rank's `mine` (peaks or an error) as rows, on rank 0 (collective: every rank calls it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([mine.get("peak_bytes", -1), mine.get("forward_peak_bytes", -1)], device=device)
    every = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(every, t)
    if rank != 0:
        return []
    rows = []
    for r, got in enumerate(every):
        peaks_r = dict(peak_bytes=int(got[0]), forward_peak_bytes=int(got[1])) if got[0] >= 0 else \
            (mine if r == 0 else dict(error="failed on that rank"))
        rows.append(row(kind, backend, world, r if world > 1 else None, shape, single, peaks_r))
        report(rows[-1])
    return rows


def row(kind: str, backend: str, world: int, rank: int | None, shape, single: dict, ring: dict) -> dict:
    b, n, h, hkv, d = shape
    rec = dict(kind=kind, backend=backend, world=world, rank=rank, batch=b, tokens_per_rank=n, heads=h,
               kv_heads=hkv, head_dim=d, dtype=str(DTYPE).removeprefix("torch."), causal=True,
               single=single, ring=ring, **bound_terms(b, n, h, hkv, d, torch.finfo(DTYPE).bits // 8))
    if "peak_bytes" in single and "peak_bytes" in ring:
        added = ring["peak_bytes"] - single["peak_bytes"]
        rec.update(added_bytes=added, added_kv_blocks=round(added / rec["kv_block_bytes"], 3),
                   forward_added_bytes=ring["forward_peak_bytes"] - single["forward_peak_bytes"],
                   within_bound=added <= rec["bound_bytes"])
    return rec


def fake_rows(args, backend: str, shape, single: dict, seed: int) -> list[dict]:
    """Every rank of every `--fake-worlds` ring, one after another, each in its own fake group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rows = []
    for world in args.fake_worlds:
        for rank in range(world):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
            try:
                ring = measure(ring_fn(backend, args.layout, fake=True), shape, seed)
            finally:
                dist.destroy_process_group()
            rows.append(row("fake-ring", backend, world, rank, shape, single, ring))
            report(rows[-1])
    return rows


def report(r: dict) -> None:
    who = f"W={r['world']} rank {r['rank']}" if r["rank"] is not None else f"W={r['world']}"
    ring = r["ring"].get("peak_bytes", r["ring"].get("error"))
    extra = (f"+{r['added_bytes'] / 2**20:.1f} MiB = {r['added_kv_blocks']} K/V blocks, bound "
             f"{r['bound_bytes'] / 2**20:.1f} MiB {'ok' if r['within_bound'] else 'EXCEEDED'}") if "added_bytes" in r else ""
    print(f"{r['backend']:<7} n={r['tokens_per_rank']:<6} {r['kind']:<9} {who:<14} ring {ring} single "
          f"{r['single'].get('peak_bytes', r['single'].get('error'))} {extra}", flush=True)


def environment(world: int) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "gpu": torch.cuda.get_device_name(),
        "gpus": world,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "command": "torchrun --nproc_per_node={} {}".format(world, " ".join(sys.argv)),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
    }


NOTE = ("peak_bytes: torch.cuda.max_memory_allocated over forward + backward minus memory_allocated before "
        "(inputs and dout excluded), after a warm-up call and gc.collect(); the caching allocator rounds "
        "each block up (512 B). kind 'ring' runs over the torchrun group: with one GPU W = 1, so no K/V "
        "moves and no dk/dv message exists; it shows the float32 accumulators only. kind 'fake-ring' is "
        "rank `rank` of a W-rank ring on a fake process group: transfers complete at once and move no "
        "data, the allocations are a real rank's with the point-to-point K/V transport (real ranks on "
        "one host pull K/V with copy engines instead, whose buffers may differ). added_bytes = ring "
        "peak - single peak. kind 'torch-cp-<rotate>' is PyTorch context parallel (SDPA, load balancing) "
        "on the same tokens per rank, every rank, measured the same way (added_bytes: over single-GPU "
        "SDPA). bound_bytes = 2 K/V blocks + float32 accumulators.")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/memory.py needs a CUDA GPU", file=sys.stderr)
        return 1
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)  # plain `python benchmarks/memory.py`: a group of one
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    ringlse.tune_nccl_env()
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10),
                            pg_options=ringlse.nccl_options(datetime.timedelta(minutes=10)))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    env = environment(world) if rank == 0 else {}
    available = ringlse.available_backends(device, DTYPE)
    backends = [be for be in args.backends if be in available]
    skipped = {be: "not available here" for be in args.backends if be not in available}
    records: list[dict] = []
    for be in backends:
        for s in args.seqlens:
            shape = (1, s, args.heads, args.kv_heads, args.head_dim)
            single = measure(single_fn(be), shape, seed=rank)
            ring = measure(ring_fn(be, args.layout, fake=False), shape, seed=rank)
            records += gathered_rows("ring", be, ring, shape, single, device)
    if world > 1 and args.peer:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", (world,))
        for s in args.seqlens:
            shape = (1, s, args.heads, args.kv_heads, args.head_dim)
            single = measure(single_fn("sdpa"), shape, seed=rank)
            for rotate in ("allgather", "alltoall"):
                cp = guarded(lambda: cp_peaks(mesh, rotate, shape, seed=rank))
                records += gathered_rows(f"torch-cp-{rotate}", "sdpa", cp, shape, single, device)
    if world == 1 and args.fake_worlds:
        dist.destroy_process_group()  # a fake group of W ranks replaces it (one default group at a time)
        for be in backends:
            for s in args.seqlens:
                shape = (1, s, args.heads, args.kv_heads, args.head_dim)
                single = measure(single_fn(be), shape, seed=0)
                records += fake_rows(args, be, shape, single, seed=0)
    elif dist.is_initialized():
        dist.destroy_process_group()
    if rank != 0:
        return 0
    tag = env["gpu"].replace(" ", "_").replace("/", "_")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"memory-{tag}.json"
    result = dict(benchmark="peak memory per rank: ring_attention vs attention", **env,
                  layout=args.layout, skipped_backends=skipped, note=NOTE, records=records)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
