"""How long the float32 atomics of a fused backward's dQ take on their own (no GEMMs): a [64, D] tile added
per (128-key tile, 64-query tile, head, consumer warpgroup) into dq, as a fused dk/dv + dq kernel with
per-element atomics would (Gluon 3.6 has no TMA reduce on Hopper), next to plain stores of the same tiles.

Usage (on a GPU): python benchmarks/dq_atomics_probe.py S HEADS D   (benchmarks/NOTES.md has the numbers)
"""
import sys

import torch
import triton
import triton.language as tl

@triton.jit
def _adds(DQ, S, H, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PARTS: tl.constexpr, ATOMIC: tl.constexpr):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    rows = tl.arange(0, BM)
    cols = tl.arange(0, D)
    val = (pid_n + 1).to(tl.float32) * 1e-6 + tl.zeros([BM, D], tl.float32)
    base = DQ + bh.to(tl.int64) * D  # [S, H, D] layout: row stride H * D
    for m in range(0, S, BM):
        ptrs = base + (m + rows)[:, None].to(tl.int64) * (H * D) + cols[None, :]
        for p in tl.static_range(PARTS):
            if ATOMIC:
                tl.atomic_add(ptrs, val, sem="relaxed")
            else:
                tl.store(ptrs, val)

def main():
    S, H, D = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    BM, BN, PARTS = 64, 128, 2
    dq = torch.zeros(S, H, D, device="cuda")
    grid = (S // BN, H)
    for atomic in (True, False):
        f = lambda: _adds[grid](dq, S, H, D=D, BM=BM, BN=BN, PARTS=PARTS, ATOMIC=atomic, num_warps=4)
        ms = triton.testing.do_bench(f, warmup=50, rep=300, return_mode="median")
        nbytes = grid[0] * grid[1] * (S // BM) * PARTS * BM * D * 4
        print(f"S {S} H {H} D {D} atomic={atomic}: {ms:.3f} ms, {nbytes / ms / 1e6:.0f} GB/s of tiles")


if __name__ == "__main__":
    main()
