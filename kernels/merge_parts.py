"""Merge of row-offset attention states in one pass: the forward's counterpart of `sum_parts`.

A ring forward attends its queries to W blocks, and the blocks cover different query rows (a zigzag
rank's block of an earlier rank covers all its rows, one of a later rank only the second half). A
block op whose kernels return `(out, lse)` as new tensors (cuDNN: bf16 `out`) used to be merged into
float32 accumulators block by block: a 4-byte read and write of the accumulator per element per
block, plus zero-filling it and casting the result. Kept as parts and merged once here, each part is
read once and the result written once, in its final dtype.

Layout: part `i` is a contiguous `out_i` `[B, L_i, H, D]` (any float dtype) with a contiguous
`lse_i` `[B, H, L_i]` float32, placed at output rows `[start_i, start_i + L_i)`; the outputs are a
contiguous `out` `[B, S, H, D]` and `lse` `[B, H, S]` float32. Programs walk rows `r = s * H + h` of one
batch entry (contiguous memory in this layout); a row's position `s` decides which parts cover it,
and a masked-off load moves no memory. Rows no part covers come out `(0, -inf)`.

Math per row: `ringlse.kernels.merge_math` (CONVENTIONS.md §3), online over the parts (`merge_fold`
as each part is loaded, so that only one part's tile is live at a time), then `merge_finish`. A part
of weight exactly 0 contributes exactly 0 (even if its rows hold garbage).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ringlse.kernels.host import cdiv, next_power_of_2
from ringlse.kernels.launch import launch
from ringlse.kernels.merge_math import merge_finish, merge_fold
from ringlse.kernels.parts import MAX_PARTS, part_slots


@triton.jit
def _fold_part(m, t, acc, O, L, start, length, b, s, hh, cols, row_ok, col_ok, H: tl.constexpr,
               D: tl.constexpr):
    covered = row_ok & (s >= start) & (s < start + length)
    local = s - start
    lse = tl.load(L + (b * H + hh) * length + local, mask=covered, other=float("-inf"))
    row_off = ((b * length + local) * H + hh) * D
    o = tl.load(O + row_off[:, None] + cols[None, :], mask=covered[:, None] & col_ok[None, :], other=0.0)
    return merge_fold(m, t, acc, lse, o.to(tl.float32), False)


# no specialisation on the values of starts, lengths and row counts (1 would become a constant):
# one compiled kernel serves every plan
@triton.jit(do_not_specialize=[f"{c}{i}" for c in "sn" for i in range(MAX_PARTS)] + ["n_rows"])
def _merge_parts_kernel(
    OUT, LSE_OUT,
    O0, O1, O2, O3, O4, O5, O6, O7,
    L0, L1, L2, L3, L4, L5, L6, L7,
    s0, s1, s2, s3, s4, s5, s6, s7,
    n0, n1, n2, n3, n4, n5, n6, n7,
    n_rows,
    N: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows.to(tl.int64) * H
    s = rows // H  # H is a compile-time constant: a multiply and a shift
    hh = rows % H
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    m = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    t = tl.zeros((BLOCK_R,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    m, t, acc = _fold_part(m, t, acc, O0, L0, s0, n0, b, s, hh, cols, row_ok, col_ok, H, D)
    if N > 1:
        m, t, acc = _fold_part(m, t, acc, O1, L1, s1, n1, b, s, hh, cols, row_ok, col_ok, H, D)
    if N > 2:
        m, t, acc = _fold_part(m, t, acc, O2, L2, s2, n2, b, s, hh, cols, row_ok, col_ok, H, D)
    if N > 3:
        m, t, acc = _fold_part(m, t, acc, O3, L3, s3, n3, b, s, hh, cols, row_ok, col_ok, H, D)
    if N > 4:
        m, t, acc = _fold_part(m, t, acc, O4, L4, s4, n4, b, s, hh, cols, row_ok, col_ok, H, D)
    if N > 5:
        m, t, acc = _fold_part(m, t, acc, O5, L5, s5, n5, b, s, hh, cols, row_ok, col_ok, H, D)
    if N > 6:
        m, t, acc = _fold_part(m, t, acc, O6, L6, s6, n6, b, s, hh, cols, row_ok, col_ok, H, D)
    if N > 7:
        m, t, acc = _fold_part(m, t, acc, O7, L7, s7, n7, b, s, hh, cols, row_ok, col_ok, H, D)
    lse, out = merge_finish(m, t, acc, False)
    out_off = ((b * n_rows + s) * H + hh) * D
    tl.store(OUT + out_off[:, None] + cols[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
    tl.store(LSE_OUT + (b * H + hh) * n_rows + s, lse, mask=row_ok)


def merge_parts_into(
    out: torch.Tensor, lse: torch.Tensor, parts: Sequence[tuple[int, torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the merge of the parts (each placed at rows `start`) into `(out, lse)`, in float32.

    Args:
        out: contiguous `[B, S, H, D]` result (float16/bfloat16/float32); every element is written.
        lse: contiguous `[B, H, S]` float32 result.
        parts: 1 to `MAX_PARTS` triples `(start, out_i, lse_i)`: `out_i` contiguous `[B, L, H, D]`
            (float16/bfloat16/float32), `lse_i` contiguous `[B, H, L]` float32, `0 <= start`,
            `start + L <= S`.

    Returns:
        `(out, lse)`.
    """
    starts, outs, lses, lens = part_slots("merge_parts_into", parts, (0, out, lse))
    bsz, n_rows, h, d = out.shape
    if out.numel() == 0:
        return out, lse
    block_d = next_power_of_2(d)
    # ~4K elements per program (as the pairwise merge): enough bytes in flight, no spilling
    block_r = max(1, 4096 // block_d)
    grid = (cdiv(n_rows * h, block_r), bsz)
    launch(_merge_parts_kernel, grid, out, lse, *outs, *lses, *starts, *lens, n_rows, N=len(parts), H=h, D=d,
           BLOCK_R=block_r, BLOCK_D=block_d, num_warps=8)
    return out, lse
