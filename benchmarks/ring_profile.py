"""Where the time of one ring attention call goes, per rank (torch.profiler), under torchrun:

    torchrun --nproc_per_node=4 benchmarks/ring_profile.py --backend sdpa --seqlen 32768 [--trace-dir DIR]
        [--without forward_parts backward_parts] [--window L | --docs] [--layout LAYOUT]

Runs a few warm-up calls, then profiles `--iters` calls of causal forward+backward (batch 1 x 32 heads x
head dim 128, bf16, zigzag unless `--layout`; a window of L keys or packed documents, log-uniform
lengths in [256, 32K] with seed 0, with `--window` / `--docs`) and prints, for every rank: wall milliseconds per call, and GPU kernel time
per call grouped into attention / NCCL / merge+elementwise / other, plus the time the compute stream
sat idle. Every rank writes a Chrome trace to `--trace-dir` when given.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import ringlse
from ringlse.blocks.accumulate import IN_PLACE


def category(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if n.startswith("memcpy"):  # copy engines (the K/V pulls), not the SMs
        return "copy-engine"
    if any(s in n for s in ("attn", "attention", "fmha", "flash", "cudnn", "sdpa", "_fwd_kernel", "_bwd_", "dkdv", "_dq")):
        return "attention"
    if "merge" in n or "sum_parts" in n:
        return "merge"
    if any(s in n for s in ("elementwise", "copy", "fill", "reduce", "add", "cat", "stack")):
        return "elementwise"
    return "other"


def call_timing(call, reps: int) -> str:
    """This rank's view of one call, unprofiled: GPU milliseconds of a call started after a barrier on
    an idle GPU (how `benchmarks/ring.py` times it), the host milliseconds that call took to return
    (launches, plus any wait for the GPU or the other ranks), and GPU milliseconds per call back to back."""
    cold, host = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        call()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        cold.append(start.elapsed_time(end))
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        call()
    end.record()
    end.synchronize()
    med = lambda xs: sorted(xs)[len(xs) // 2]
    return (f"cold {med(cold):.2f} ms (host {med(host):.2f} ms to return), "
            f"back to back {start.elapsed_time(end) / reps:.2f} ms/call")


def idle_gaps(prof, min_us: float) -> list[str]:
    """The compute stream's idle stretches of at least `min_us` in the first profiled call: the stream
    that ran the most attention time; calls are told apart by gaps over 2 ms (the barrier between them)."""
    by_stream: dict[int, list] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and category(e.name) not in ("nccl", "copy-engine"):
            by_stream[e.device_resource_id].append(e)
    if not by_stream:
        return []
    is_attention = lambda e: category(e.name) == "attention"
    events = sorted(max(by_stream.values(), key=lambda evs: sum(e.time_range.elapsed_us() for e in evs
                                                                   if is_attention(e))),
                    key=lambda e: e.time_range.start)
    calls, current = [], [events[0]]
    for e in events[1:]:
        if e.time_range.start - current[-1].time_range.end > 2000:  # the barrier before the next call
            calls.append(current)
            current = []
        current.append(e)
    calls.append(current)
    call = next((c for c in calls if any(is_attention(e) for e in c)), calls[0])
    t0, out = call[0].time_range.start, []
    for prev, e in zip(call, call[1:]):
        gap = e.time_range.start - prev.time_range.end
        if gap >= min_us:
            out.append(f"    idle {gap:7.1f} us at +{(prev.time_range.end - t0) / 1e3:6.3f} ms: "
                       f"{prev.name[:40]} -> {e.name[:40]}")
    out.append(f"    first call: {(call[-1].time_range.end - t0) / 1e3:.3f} ms from its first kernel to its last")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="triton")
    p.add_argument("--seqlen", type=int, default=32768)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--causal", default="yes", choices=["yes", "no"])
    p.add_argument("--mode", default="fwd+bwd", choices=["fwd", "fwd+bwd"])
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--layout", default=None, help="default: the ring's (zigzag when causal)")
    p.add_argument("--window", type=int, default=None, help="a window of this many keys to the left")
    p.add_argument("--docs", action="store_true", help="packed documents, log-uniform lengths in [256, 32K]")
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--without", nargs="*", default=[], choices=["forward_parts", "backward_parts"],
                   help="collect results in place instead of as parts (to measure what parts gain); the "
                        "accumulation is one choice of the backend, so name both")
    p.add_argument("--cold", action="store_true",
                   help="profile calls that start on an idle GPU after a barrier, as benchmarks/ring.py times them "
                        "(default: back to back), and record GPU activity only (less host overhead)")
    p.add_argument("--ops", action="store_true", help="rank 0 also prints the top operators by GPU time, with shapes")
    p.add_argument("--gaps", type=float, default=0.0, metavar="US",
                   help="also print, per rank, where the compute stream sat idle for at least US microseconds in the "
                        "first profiled call (offset from that call's first kernel, the kernels around the gap)")
    args = p.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    ringlse.tune_nccl_env()  # the same NCCL settings for ringlse and the peer
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5), pg_options=ringlse.nccl_options())
    rank, world = dist.get_rank(), dist.get_world_size()
    n, causal = args.seqlen // world, args.causal == "yes"
    mk = lambda h: torch.randn(1, n, h, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v, dout = mk(args.heads), mk(args.kv_heads), mk(args.kv_heads), mk(args.heads)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    op = ringlse.get_block_op(args.backend, q.device)
    if args.without:
        if set(args.without) != {"forward_parts", "backward_parts"}:
            p.error("--without: the accumulation is one choice (ringlse.blocks.accumulate): name both")
        op = dataclasses.replace(op, accumulation=IN_PLACE)

    mask = {}
    if args.window is not None:
        mask["window_size"] = (args.window, 0)
    if args.docs:
        from mask_balance import log_uniform_documents

        mask["cu_seqlens"] = log_uniform_documents(args.seqlen, 256, 32768, 0)

    def call():
        out = ringlse.ring_attention(*leaves, causal=causal, backend=op, layout=args.layout, **mask)
        if args.mode == "fwd+bwd":
            out.backward(dout)

    for _ in range(3):
        call()
    timing = call_timing(call, reps=10)
    torch.cuda.synchronize()
    dist.barrier()
    activities = [ProfilerActivity.CUDA] if args.cold else [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities, record_shapes=args.ops) as prof:
        t0 = time.perf_counter()
        for _ in range(args.iters):
            if args.cold:
                torch.cuda.synchronize()
                dist.barrier()
            call()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / args.iters
    per_cat: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = defaultdict(float)
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_resource_id is not None:
            us = e.time_range.elapsed_us()
            per_cat[category(e.name)] += us / 1e3 / args.iters
            per_kernel[e.name[:90]] += us / 1e3 / args.iters
            if category(e.name) not in ("nccl", "copy-engine"):
                spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:  # union of non-NCCL kernel intervals = compute busy time
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    compute_busy_ms = busy / 1e3 / args.iters
    lines = [f"rank {rank}: unprofiled: {timing}", f"rank {rank}: profiled wall {wall_ms:.2f} ms/call, compute busy {compute_busy_ms:.2f} ms "
             f"(idle {wall_ms - compute_busy_ms:.2f}); " + ", ".join(f"{c} {t:.2f}" for c, t in sorted(per_cat.items()))]
    lines += [f"    {t:8.3f} ms  {name}" for name, t in sorted(per_kernel.items(), key=lambda x: -x[1])[:8]]
    if args.gaps > 0:
        lines += idle_gaps(prof, args.gaps)
    gathered = [None] * world
    dist.all_gather_object(gathered, "\n".join(lines))
    if rank == 0:
        print(f"backend={args.backend} S={args.seqlen} W={world} causal={causal} {args.mode} kv_heads={args.kv_heads}"
              f" without={args.without} layout={args.layout} window={args.window} docs={args.docs}")
        print("\n".join(gathered))
        if args.ops:
            print(prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=45, max_shapes_column_width=70))
    if args.trace_dir:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
        tag = "".join(f"-no-{c}" for c in args.without)
        prof.export_chrome_trace(str(Path(args.trace_dir) / f"ring-{args.backend}-{args.seqlen}{tag}-rank{rank}.json"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
