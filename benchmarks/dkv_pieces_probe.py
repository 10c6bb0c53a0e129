"""What sending the backward's dk/dv home in pieces of keys costs the ring (issue 31's memory bound),
under torchrun on a host of 3 or more GPUs (the ring cuts its messages from W = 3 on; at W = 2 every
variant runs whole messages; the W = 2 figures in NOTES.md were taken before that rule):

    torchrun --nproc_per_node=4 benchmarks/dkv_pieces_probe.py [--seqlens 16384 32768] [--pieces 1 4]

For each total S (batch 1, 32 heads, head dim 128, bf16, causal, zigzag, `triton`) it times
`ring_attention` forward + backward with `ringlse.ring.backward.DKV_PIECES` set to each value of
`--pieces` in turn (1: whole blocks' messages, the design before), the variants interleaved round by
round so that clocks and neighbours weigh on each alike, and reports per variant the median over
rounds of each round's median (CUDA events, max over ranks), with its peak memory per rank. Writes
`OUT/dkv_pieces-<W>x<gpu>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import ringlse
import ringlse.ring.backward as ring_backward
from ring import timed_ms  # benchmarks/ring.py: median of CUDA-event timings, every rank starting together


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--pieces", type=int, nargs="+", default=[1, 4])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=0.25, help="seconds of timed calls per variant per round")
    p.add_argument("--backend", default="triton")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    records = []
    for s in args.seqlens:
        n, h, d = s // world, 32, 128
        gen = torch.Generator(device="cuda").manual_seed(rank)
        q, k, v, dout = (torch.randn(1, n, h, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        leaves = [t.requires_grad_() for t in (q, k, v)]

        def step():
            for t in leaves:
                t.grad = None
            ringlse.ring_attention(*leaves, causal=True, backend=args.backend).backward(dout)

        per: dict[int, list[float]] = {p: [] for p in args.pieces}
        peak: dict[int, int] = {}
        for p in args.pieces:  # warm-up, and the peak memory of one call
            ring_backward.DKV_PIECES = p
            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak[p] = torch.cuda.max_memory_allocated() - base
        for _ in range(args.rounds):
            for p in args.pieces:
                ring_backward.DKV_PIECES = p
                per[p].append(timed_ms(step, args.budget_s))
        for p in args.pieces:
            rec = dict(seqlen=s, tokens_per_rank=n, heads=h, head_dim=d, pieces=p,
                       ms=statistics.median(per[p]), rounds_ms=per[p], peak_bytes_rank0=peak[p])
            records.append(rec)
            if rank == 0:
                print(f"S={s} pieces={p}: {rec['ms']:.3f} ms (rounds {[round(x, 3) for x in per[p]]}), "
                      f"peak {peak[p] / 2**20:.0f} MiB", flush=True)
        del q, k, v, dout, leaves
        torch.cuda.empty_cache()
    if rank == 0:
        gpu = torch.cuda.get_device_name().replace(" ", "_")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"dkv_pieces-{world}x{gpu}.json"
        import triton
        path.write_text(json.dumps(dict(
            benchmark="ring fwd+bwd with the dk/dv messages in pieces of keys (issue 31)", gpu=torch.cuda.get_device_name(),
            gpus=world, torch=torch.__version__, triton=triton.__version__, backend=args.backend, dtype="bfloat16",
            causal=True, layout="zigzag", command="torchrun --nproc_per_node={} {}".format(world, " ".join(sys.argv)),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), records=records), indent=1))
        print(f"wrote {path}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
