"""`@triton.jit` helpers for rows of contiguous columns that start or end off 16-byte boundaries (odd
lengths, odd row strides): their whole 16-byte vectors are loaded and stored at full width, the few
elements before the first boundary and after the last (the row's ends) one by one.

Why: Triton narrows a load to what it can prove of the rows' alignment, one element for odd lengths,
and such rows then read at a fraction of the bandwidth (`fwd_rows_aligned_kernel`,
`fwd_coop_aligned_kernel`, `bwd_coop_aligned_kernel`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_cuts(s, N, VE: tl.constexpr):
    """The row's elements [s, s + N) cut at 16-byte boundaries (every VE elements): the first boundary
    at or after s, a, and the last at or before s + N, b; whole vectors [a, b) where a <= b, else (a
    row that starts and ends inside one vector) none. The head [s, min(a, s + N)) and the tail
    [max(b, a), s + N) are shorter than a vector."""
    a = (s + VE - 1) // VE * VE
    return a, (s + N) // VE * VE


@triton.jit
def piece_body(s, N, k, ok, PIECE: tl.constexpr, VE: tl.constexpr, UV: tl.constexpr):
    """(first unit, mask) of piece k of the row at element s (`ok` False: nothing): pieces start on the
    row's first 16-byte boundary, plus k pieces, and hold units (elements, or words of two), UV to a
    vector of VE elements; the mask takes the row's whole vectors (it is the same over each vector, so
    the loads and stores keep their 16-byte width), which fill K pieces of `(N // VE) * UV` units."""
    per: tl.constexpr = VE // UV
    a, b = row_cuts(s, N, VE)
    p0 = tl.multiple_of(a // per + k * PIECE, UV)
    vec = (tl.arange(0, PIECE) // UV) * UV
    return p0, (vec < (b // per - p0).to(tl.int32)) & ok


@triton.jit
def row_ends(s, N, k, ok, VE: tl.constexpr):
    """(element offsets, mask) of the row's head and tail (`row_cuts`), at most VE - 1 elements each,
    read and written one by one; piece 0 holds them (`ok` False: nothing)."""
    a, b = row_cuts(s, N, VE)
    head_end = tl.minimum(a, s + N)
    j = tl.arange(0, 2 * VE)
    head = j < VE
    e = tl.where(head, s + j, tl.maximum(b, head_end) + j - VE)
    return e, tl.where(head, e < head_end, e < s + N) & (k == 0) & ok


@triton.jit
def load_row_piece(p_ptr, up, s, N, k, ok, pad, other, PIECE: tl.constexpr, VE: tl.constexpr, UV: tl.constexpr):
    """Piece k of the row at element s of `p_ptr` (`ok` False: nothing): its whole vectors as loaded
    through `up` (units, UV to a vector; `pad` elsewhere) and, for piece 0, the row's head and tail
    elements in float32 (`other` elsewhere)."""
    p0, body = piece_body(s, N, k, ok, PIECE, VE, UV)
    e, ends = row_ends(s, N, k, ok, VE)
    v = tl.load(up + p0 + tl.arange(0, PIECE), mask=body, other=pad)
    return v, tl.load(p_ptr + e, mask=ends, other=other).to(tl.float32)


@triton.jit
def store_row_piece(p_ptr, up, s, N, k, v, ve, PIECE: tl.constexpr, VE: tl.constexpr, UV: tl.constexpr):
    """Store what `load_row_piece` loads: piece k's whole vectors `v` through `up`, and for piece 0 the
    row's head and tail elements `ve` (both already in the stored dtype)."""
    p0, body = piece_body(s, N, k, True, PIECE, VE, UV)
    tl.store(up + p0 + tl.arange(0, PIECE), v, mask=body)
    e, ends = row_ends(s, N, k, True, VE)
    tl.store(p_ptr + e, ve, mask=ends)
