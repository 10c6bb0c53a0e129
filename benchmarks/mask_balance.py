"""Causal work balance of the ring's layouts under packed documents and windows (no GPU needed).

For each layout and world size, the visible (query, key) pairs each rank's queries have (CONVENTIONS.md
§10, `ringlse.ring.layout.rank_work`), and the imbalance max/mean over ranks: the ring's step time is
set by its busiest rank. Inputs: document lengths drawn log-uniform in [256, 32K] (several seeds) or all
equal (4K), windows of 4K, over S; and the document sets of `document_set` (log-uniform in [256, 16K],
documents of 2K) at 8K and 32K tokens per rank, W = 2..8. `balanced` is placed by each input's
documents (one document where it has none); `balanced_runs` is the most position runs a rank holds.

Usage: python3 benchmarks/mask_balance.py [--out DIR] [--seqlen S]
    writes DIR/mask_balance.json (default benchmarks/results)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

import torch

from ringlse.masks import Rule
from ringlse.ring import LAYOUTS
from ringlse.ring.layout import Balanced, imbalance, segments

DOCUMENT_SETS = ("loguniform", "equal2k")


def log_uniform_documents(seqlen: int, lo: int, hi: int, seed: int) -> tuple[int, ...]:
    """Document boundaries `(0, ..., seqlen)`, lengths drawn log-uniform in `[lo, hi]` (the last cut short)."""
    gen = torch.Generator().manual_seed(seed)
    bounds = [0]
    while bounds[-1] < seqlen:
        u = torch.rand(1, generator=gen).item()
        bounds.append(min(seqlen, bounds[-1] + int(math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo))))))
    return tuple(bounds)


def document_set(name: str, seqlen: int) -> tuple[int, ...]:
    """The packed document sets the balanced layout is judged on, boundaries `(0, ..., seqlen)`:
    `loguniform`: lengths `int(exp(uniform(ln 256, ln 16384)))` drawn from `random.Random(0)` until
    `seqlen`, the last one cut; `equal2k`: documents of 2048 tokens (the last one cut)."""
    if name == "equal2k":
        return (*range(0, seqlen, 2048), seqlen)
    if name != "loguniform":
        raise ValueError(f"unknown document set {name!r}; choose one of {DOCUMENT_SETS}")
    rng, bounds = random.Random(0), [0]
    while bounds[-1] < seqlen:
        bounds.append(min(seqlen, bounds[-1] + int(math.exp(rng.uniform(math.log(256), math.log(16384))))))
    return tuple(bounds)


def row(name: str, rule: Rule, world: int, seqlen: int) -> dict:
    """Every layout's imbalance on one input (`balanced` by its documents, one where it has none)."""
    balanced = Balanced(rule.docs or (0, seqlen))
    out = dict(world=world, input=name, seqlen=seqlen)
    out.update({layout: imbalance(rule, layout, world, seqlen) for layout in LAYOUTS})
    out["balanced"] = imbalance(rule, balanced, world, seqlen)
    out["balanced_runs"] = max(len(segments(balanced, r, world, seqlen // world)) for r in range(world))
    return out


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
    rows = [row(name, rule, world, s) for world in (2, 4, 8) for name, rule in inputs.items()]
    for per_rank in (8192, 32768):
        for world in range(2, 9):
            seqlen = per_rank * world
            rows += [row(f"{name}, {per_rank // 1024}K per rank", Rule(True, docs=document_set(name, seqlen)), world,
                         seqlen) for name in DOCUMENT_SETS]
    for r in rows:
        print(f"W={r['world']} S={r['seqlen']:<7} {r['input']:<32} "
              + "  ".join(f"{lay} {r[lay]:.3f}" for lay in (*LAYOUTS, "balanced")) + f"  runs {r['balanced_runs']}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "mask_balance.json")
    with open(path, "w") as f:
        json.dump(dict(benchmark="mask_balance", date=time.strftime("%Y-%m-%dT%H:%M:%S"),
                       command="python3 benchmarks/mask_balance.py", torch=torch.__version__,
                       definition="max over ranks / mean over ranks of visible (query, key) pairs; balanced_runs: "
                                  "the most position runs one rank holds in the balanced layout",
                       rows=rows), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
