"""Causal work balance of the ring's layouts under packed documents and windows (no GPU needed).

For each layout and world size, the visible (query, key) pairs each rank's queries have (CONVENTIONS.md
§10, counted from `ringlse.masks.Rule.key_bounds`), and the imbalance max/mean over ranks: the ring's
step time is set by its busiest rank. Document lengths are drawn log-uniform in [256, 32K] (several
seeds) or all equal (4K); windows of 4K.

Usage: python3 benchmarks/mask_balance.py [--out DIR] [--seqlen S]
    writes DIR/mask_balance.json (default benchmarks/results)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from ringlse.masks import Rule
from ringlse.ring import LAYOUTS
from ringlse.ring.layout import local_positions


def log_uniform_documents(seqlen: int, lo: int, hi: int, seed: int) -> tuple[int, ...]:
    """Document boundaries `(0, ..., seqlen)`, lengths drawn log-uniform in `[lo, hi]` (the last cut short)."""
    gen = torch.Generator().manual_seed(seed)
    bounds = [0]
    while bounds[-1] < seqlen:
        u = torch.rand(1, generator=gen).item()
        bounds.append(min(seqlen, bounds[-1] + int(math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo))))))
    return tuple(bounds)


def visible_per_position(rule: Rule, seqlen: int) -> torch.Tensor:
    """The number of keys each query position of `[0, seqlen)` sees under `rule` (int64 `[seqlen]`)."""
    lo, hi = rule.key_bounds(torch.arange(seqlen))
    return (hi.clamp(max=seqlen) - lo.clamp(min=0)).clamp(min=0)


def imbalance(rule: Rule, layout: str, world: int, seqlen: int) -> float:
    per_position = visible_per_position(rule, seqlen)
    n = seqlen // world
    work = [int(per_position[local_positions(layout, r, world, n)].sum()) for r in range(world)]
    return max(work) / (sum(work) / world)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--seqlen", type=int, default=131072)
    args = ap.parse_args()
    s = args.seqlen
    inputs = {f"log-uniform 256-32K, seed {seed}": Rule(True, docs=log_uniform_documents(s, 256, 32768, seed))
              for seed in range(4)}
    inputs["documents of 4K"] = Rule(True, docs=tuple(range(0, s + 1, 4096)))
    inputs["window 4K"] = Rule(True, window=(4096, -1))
    inputs["one document (plain causal)"] = Rule(True)
    rows = []
    for world in (2, 4, 8):
        for name, rule in inputs.items():
            row = dict(world=world, input=name, seqlen=s)
            row.update({layout: imbalance(rule, layout, world, s) for layout in LAYOUTS})
            rows.append(row)
            print(f"W={world} {name:<32} " + "  ".join(f"{lay} {row[lay]:.3f}" for lay in LAYOUTS))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "mask_balance.json")
    with open(path, "w") as f:
        json.dump(dict(benchmark="mask_balance", date=time.strftime("%Y-%m-%dT%H:%M:%S"),
                       command="python3 benchmarks/mask_balance.py", torch=torch.__version__,
                       definition="max over ranks / mean over ranks of visible (query, key) pairs",
                       rows=rows), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
