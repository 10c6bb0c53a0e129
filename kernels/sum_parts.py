"""Sum of row-offset parts in one pass: `out[:, start_i : start_i + len_i] += scale_i * part_i`.

The ring's backward collects each block's gradients as the tensors the attention kernels return
(bf16 for a cuDNN block) and adds them up once at the end, in float32, instead of adding every block
into a float32 accumulator as it comes: that costs a read of every part and one write of the result
(2 bytes per element per part plus 2 for a bf16 result) where accumulating costs a 4-byte read and a
4-byte write of the accumulator per part.

Layout: every part and the output are contiguous `[B, rows, E]` (`E = heads * headdim`); part `i`
covers output rows `[start_i, start_i + len_i)`. Programs walk flat elements of one batch entry;
an element's row decides which parts cover it, and a masked-off load moves no memory, so parts that
miss a program's rows cost nothing but a few predicated instructions. Rows no part covers come out 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ringlse.kernels.host import cdiv
from ringlse.kernels.launch import launch
from ringlse.kernels.parts import MAX_PARTS, part_slots

_BLOCK = 2048


@triton.jit
def _add_part(acc, P, start, length, scale, b, offs, row, ok, E: tl.constexpr):
    covered = ok & (row >= start) & (row < start + length)
    base = b * length * E - start.to(tl.int64) * E
    x = tl.load(P + base + offs, mask=covered, other=0.0).to(tl.float32)
    return acc + scale * x


@triton.jit(do_not_specialize=[f"s{i}" for i in range(MAX_PARTS)])
def _sum_parts_kernel(
    OUT,
    P0, P1, P2, P3, P4, P5, P6, P7,
    s0, s1, s2, s3, s4, s5, s6, s7,
    n0, n1, n2, n3, n4, n5, n6, n7,
    c0, c1, c2, c3, c4, c5, c6, c7,
    n_rows,
    N: tl.constexpr,
    E: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_rows.to(tl.int64) * E
    row = offs // E  # E is a compile-time constant: a multiply and a shift
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    acc = _add_part(acc, P0, s0, n0, c0, b, offs, row, ok, E)
    if N > 1:
        acc = _add_part(acc, P1, s1, n1, c1, b, offs, row, ok, E)
    if N > 2:
        acc = _add_part(acc, P2, s2, n2, c2, b, offs, row, ok, E)
    if N > 3:
        acc = _add_part(acc, P3, s3, n3, c3, b, offs, row, ok, E)
    if N > 4:
        acc = _add_part(acc, P4, s4, n4, c4, b, offs, row, ok, E)
    if N > 5:
        acc = _add_part(acc, P5, s5, n5, c5, b, offs, row, ok, E)
    if N > 6:
        acc = _add_part(acc, P6, s6, n6, c6, b, offs, row, ok, E)
    if N > 7:
        acc = _add_part(acc, P7, s7, n7, c7, b, offs, row, ok, E)
    tl.store(OUT + b * n_rows * E + offs, acc.to(OUT.dtype.element_ty), mask=ok)


def sum_parts_into(out: torch.Tensor, parts: Sequence[tuple[int, torch.Tensor, float]]) -> torch.Tensor:
    """Write `sum_i scale_i * part_i` (placed at rows `start_i`) into `out`, summed in float32.

    Args:
        out: contiguous `[B, S, ...]` result (float16/bfloat16/float32); every element is written.
        parts: 1 to `MAX_PARTS` triples `(start, part, scale)`, `part` contiguous `[B, L, ...]` with
            the same trailing shape as `out` and `0 <= start`, `start + L <= S`.

    Returns:
        `out`.
    """
    starts, ptrs, scales, lens = part_slots("sum_parts_into", parts, (0, out, 0.0))
    bsz, n_rows = out.shape[0], out.shape[1]
    e = out[0, 0].numel() if n_rows else 0
    if out.numel() == 0:
        return out
    grid = (cdiv(n_rows * e, _BLOCK), bsz)
    launch(_sum_parts_kernel, grid, out, *ptrs, *starts, *lens, *map(float, scales), n_rows, N=len(parts), E=e,
           BLOCK=_BLOCK, num_warps=8)
    return out
