"""Does the ring's error grow with the world size (CONVENTIONS.md §7)? Under torchrun:

    torchrun --nproc_per_node=4 benchmarks/error_growth.py [--seeds 10] [--backends triton sdpa]

For each backend, MHA and GQA (8 query heads, 8 or 2 K/V heads), head dim 128, bf16, causal, zigzag,
S = 2048, and each seed: the ring's `(out, lse, dq, dk, dv)` on all W ranks and on rank 0 alone (W = 1),
from the same inputs, judged against the float64 reference by CONVENTIONS.md §7. Records per result the max and
RMS errors, their W / 1 ratios and the spread of those ratios over the seeds (the tests judge growth
by the RMS ratio: `ringlse.testing` says why). Rank 0 writes
`benchmarks/results/error_growth-<W>x<gpu>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from timing import environment  # noqa: E402  (benchmarks/timing.py: GPU, versions, command)

import ringlse  # noqa: E402
from ringlse.blocks import available_backends  # noqa: E402
from ringlse.testing import RESULT_NAMES, judge_all, random_inputs, ring_with_grads  # noqa: E402


def errors(ours, inputs) -> dict:
    """Max and RMS error per result, and whether every result is within its CONVENTIONS.md §7 bound."""
    q, k, v, dout, _ = inputs
    verdicts = judge_all(ours, q, k, v, dout, causal=True)
    return {"max": {vd.name: vd.max_err for vd in verdicts}, "rms": {vd.name: vd.rms_err for vd in verdicts},
            "within_bound": all(vd.ok for vd in verdicts)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--backends", nargs="+", default=None, help="default: every GPU backend available")
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args()
    cuda = torch.cuda.is_available()  # without GPUs: gloo ranks and the `torch` block op (a dry run)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10),
                            pg_options=ringlse.nccl_options(datetime.timedelta(minutes=10)))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if cuda else "cpu"
    backends = args.backends or [b for b in ("triton", "sdpa", "flash") if b in available_backends(device)]
    cases = [(backend, hkv, seed) for backend in backends for hkv in (8, 2) for seed in range(args.seeds)]
    kw = dict(causal=True, layout="zigzag", return_lse=False)

    def inputs(hkv: int, seed: int) -> list[torch.Tensor]:
        return random_inputs(1, args.seqlen, 8, hkv, 128, torch.bfloat16, seed, device)

    many = []
    for backend, hkv, seed in cases:  # W ranks
        q, k, v, dout, _ = inputs(hkv, seed)
        many.append(ring_with_grads(q, k, v, dout, backend=backend, **kw))
        if rank == 0:
            print(f"W={world}: {backend} hkv={hkv} seed={seed} done", flush=True)
    # W = 1 after the group is gone: the ring then runs as one rank, the same block calls as a group of one
    # (a subgroup of rank 0 alone would make the ring's agreement create a group the other ranks never join)
    dist.destroy_process_group()
    if rank != 0:
        return
    records = []
    for (backend, hkv, seed), results in zip(cases, many):
        x = inputs(hkv, seed)
        one = ring_with_grads(*x[:4], backend=backend, **kw)
        e_many, e_one = errors(results, x), errors(one, x)
        r = {"backend": backend, "heads": 8, "kv_heads": hkv, "seed": seed, "world": world,
             "errors": {f"W{world}": e_many, "W1": e_one},
             "rms_ratio": {n: e_many["rms"][n] / e_one["rms"][n] for n in RESULT_NAMES},
             "max_ratio": {n: e_many["max"][n] / e_one["max"][n] for n in RESULT_NAMES}}
        records.append(r)
        print(f"{backend} hkv={hkv} seed={seed}: rms ratio " + " ".join(f"{n} {r['rms_ratio'][n]:.3f}" for n in RESULT_NAMES)
              + "; max ratio " + " ".join(f"{n} {r['max_ratio'][n]:.3f}" for n in RESULT_NAMES), flush=True)
    summary = []
    for backend in backends:
        for hkv in (8, 2):
            rs = [r for r in records if r["backend"] == backend and r["kv_heads"] == hkv]
            for n in RESULT_NAMES:
                rms, mx = [r["rms_ratio"][n] for r in rs], [r["max_ratio"][n] for r in rs]
                summary.append({"backend": backend, "kv_heads": hkv, "result": n, "seeds": len(rs),
                                "rms_ratio_min": min(rms), "rms_ratio_max": max(rms),
                                "max_ratio_min": min(mx), "max_ratio_max": max(mx),
                                "all_within_bound": all(r["errors"][k]["within_bound"] for r in rs for k in r["errors"])})
    env = environment(world) if cuda else {"gpu": "cpu", "gpus": 0, "torch": torch.__version__,
                                            "command": " ".join(sys.argv)}
    out = Path(args.out) / f"error_growth-{world}x{env['gpu'].replace('NVIDIA ', '').replace(' ', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    shape = {"world": world, "batch": 1, "seqlen": args.seqlen, "heads": 8, "head_dim": 128, "dtype": "bfloat16",
             "causal": True, "layout": "zigzag"}
    out.write_text(json.dumps({"environment": env, "shape": shape, "summary": summary, "records": records},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
