"""`@triton.jit` helpers of the cooperative kernels (`coop_kernels.py`): a piece's `(max, sum)` as one
64-bit word published to and awaited from the row's other pieces, 2-byte elements packed as int32
words of two, a piece's statistics and output, and the order in which programs take the rows' pieces
(tasks).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_common import LN2, LOG2E, col_offsets, merge_lanes, row_start

# ----------------------------------------------------------------------------------------------------
# words: a piece's statistics, published and awaited
# ----------------------------------------------------------------------------------------------------


@triton.jit
def pack_word(a, b):
    """Two float32 values as one int64 word (a high, b low). A NaN in b becomes the positive quiet NaN,
    so that no result ever equals the unpublished word -1 (all bits set)."""
    b = tl.where(b == b, b, float("nan"))
    hi = a.to(tl.int32, bitcast=True).to(tl.int64)
    lo = b.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    return (hi << 32) | lo


@triton.jit
def publish_word(w_ptr, word):
    """Store a piece's word for the other pieces of its row: a relaxed gpu-scope exchange whose result
    is never read, so the program does not wait for it. The word is all they read, so nothing needs
    ordering before it: a release (a fence) would first wait for this program's earlier output stores
    to drain to memory, and that wait was on every row's critical path."""
    tl.atomic_xchg(w_ptr, word, sem="relaxed", scope="gpu")


@triton.jit
def await_words(w_ptr, base, K, KB: tl.constexpr):
    """Poll the K words of a row from `base` on (volatile loads: from L2, never a stale L1 line) until
    every piece has published its own; returns them unpacked as (a, b), padded with (-inf, 0)."""
    offs = tl.arange(0, KB)
    w = tl.load(w_ptr + base + offs, mask=offs < K, other=0, volatile=True)
    pending = w == -1
    while tl.sum(pending.to(tl.int32), axis=0) > 0:
        # only the words still missing are read again (a row of many pieces would otherwise re-read
        # all K words on every poll, from all K programs)
        w = tl.where(pending, tl.load(w_ptr + base + offs, mask=pending, other=-1, volatile=True), w)
        pending = w == -1
    a = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    b = w.to(tl.int32).to(tl.float32, bitcast=True)
    return tl.where(offs < K, a, float("-inf")), tl.where(offs < K, b, 0.0)


@triton.jit
def reset_words(c_ptr, n_clear):
    """Set words [0, n_clear) of `c_ptr` to -1 (unpublished), shared out over the grid's programs: the
    words the previous cooperative launch on this stream left published (`device.coop_words`)."""
    offs = tl.arange(0, 64)
    for start in range(tl.program_id(0) * 64, n_clear, tl.num_programs(0) * 64):
        tl.store(c_ptr + start + offs, tl.full([64], -1, tl.int64), mask=start + offs < n_clear)


# ----------------------------------------------------------------------------------------------------
# 2-byte elements as int32 words of two
# ----------------------------------------------------------------------------------------------------


@triton.jit
def unpack_pair(w, PACK: tl.constexpr):
    """An int32 word holding two 16-bit floats (bf16 when PACK == 1, fp16 when 2) as float32 (low, high)."""
    if PACK == 1:  # a bf16 is the top half of the float32 with the same value
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & -65536).to(tl.float32, bitcast=True)
    else:
        lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def pack_pair(lo, hi, PACK: tl.constexpr, ASM: tl.constexpr):
    """Two float32 tensors rounded to bf16 (PACK == 1) or fp16 (2) as int32 words (lo in the low half).

    ASM (compiled only): one `cvt` per pair, a packed conversion on the ALU. Converted one by one, each
    element took an F2F on the unit that also computes the exps."""
    if ASM:
        if PACK == 1:
            w = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:
            w = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi],
                                          dtype=tl.int32, is_pure=True, pack=1)
    else:
        if PACK == 1:
            lo16 = lo.to(tl.bfloat16).to(tl.int16, bitcast=True)
            hi16 = hi.to(tl.bfloat16).to(tl.int16, bitcast=True)
        else:
            lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True)
            hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True)
        w = (hi16.to(tl.int32) << 16) | (lo16.to(tl.int32) & 0xFFFF)
    return w


@triton.jit
def max_bf16x2(a, b):
    return tl.inline_asm_elementwise("max.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def max_f16x2(a, b):
    return tl.inline_asm_elementwise("max.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def piece_pointers(x_ptr, y_ptr, PACK: tl.constexpr):
    """(x, y, pad): the pointers a cooperative forward loads and stores through (int32 words of two
    elements when PACK) and the value that pads a piece past the row's end (-inf, or two of them)."""
    if PACK:
        pad = -8323200 if PACK == 1 else -67044352  # two -inf: 0xFF80FF80 (bf16), 0xFC00FC00 (fp16)
        return x_ptr.to(tl.pointer_type(tl.int32)), y_ptr.to(tl.pointer_type(tl.int32)), pad
    else:
        return x_ptr, y_ptr, float("-inf")


# ----------------------------------------------------------------------------------------------------
# a piece's statistics and output
# ----------------------------------------------------------------------------------------------------


@triton.jit
def piece_max_sum(v, PACK: tl.constexpr, ASM: tl.constexpr = False):
    """(max, sum of exp(x - max)) over a piece held as loaded: elements, or words of two (PACK).

    ASM (compiled only, PACK): the max over the words as they are, two 16-bit values per instruction
    (a 16-bit float widens to float32 exactly and in order, so the max is the same), one instruction
    per word where the float32 max took two."""
    if PACK:
        # exp2(x * log2 e - m * log2 e): one FMA per element. Its error, ~|m| * 1e-7 relative, is far
        # below a 16-bit output's rounding (4e-3 for bf16)
        lo, hi = unpack_pair(v, PACK)
        if ASM:
            if PACK == 1:
                mw = tl.reduce(v, 0, max_bf16x2)
            else:
                mw = tl.reduce(v, 0, max_f16x2)
            mlo, mhi = unpack_pair(mw, PACK)
            m = tl.maximum(mlo, mhi)
        else:
            m = tl.maximum(tl.max(lo, axis=0), tl.max(hi, axis=0))
        mc = tl.where(m == float("-inf"), 0.0, m) * LOG2E
        s = tl.sum(tl.exp2(lo * LOG2E - mc) + tl.exp2(hi * LOG2E - mc), axis=0)
    else:
        x = v.to(tl.float32)
        m = tl.max(x, axis=0)
        s = tl.sum(tl.exp2((x - tl.where(m == float("-inf"), 0.0, m)) * LOG2E), axis=0)
    return m, s


@triton.jit
def merge_two(m1, s1, m2, s2):
    """Two `(max, sum of exp(x - max))` pairs as one (an all -inf side has max -inf and sum 0)."""
    M = tl.maximum(m1, m2)
    M_safe = tl.where(M == float("-inf"), 0.0, M)
    return M, s1 * tl.exp2((m1 - M_safe) * LOG2E) + s2 * tl.exp2((m2 - M_safe) * LOG2E)


@triton.jit
def publish_stats(w_ptr, i, k, m, s, xe):
    """Publish word i: a piece's `(max, sum)` merged, for piece 0 only, with its row's end elements xe."""
    if k == 0:
        me, se = piece_max_sum(xe, 0)
        m, s = merge_two(m, s, me, se)
    publish_word(w_ptr + i, pack_word(m, s))


@triton.jit
def publish_piece(w_ptr, i, k, x, xe, PACK: tl.constexpr, ASM: tl.constexpr):
    """Publish word i: the `(max, sum)` of piece k's vectors x and, piece 0 only, the row's end elements
    xe (the other pieces skip their reductions)."""
    m, s = piece_max_sum(x, PACK, ASM)
    publish_stats(w_ptr, i, k, m, s, xe)


@triton.jit
def normalised(x, M_safe, S, MODE: tl.constexpr):
    """softmax (MODE 0) or log_softmax of float32 x given its row's max (0 for an all -inf row) and sum."""
    if MODE == 0:
        return tl.where(S > 0.0, tl.exp2((x - M_safe) * LOG2E - tl.log2(tl.where(S > 0.0, S, 1.0))), 0.0)
    else:
        return x - tl.where(S > 0.0, M_safe + tl.log2(S) * LN2, 0.0)


@triton.jit
def output_of(x, M, S, MODE: tl.constexpr, PACK: tl.constexpr, ASM: tl.constexpr, out_ty: tl.constexpr):
    """softmax (MODE 0) or log_softmax of a piece held as loaded (elements, or words of two: PACK),
    given its row's max M and sum S (`merge_lanes`); the values to store (words when PACK, else
    `out_ty`). Each output is rounded once, from float32."""
    M_safe = tl.where(M == float("-inf"), 0.0, M)
    # from x, not from the piece's exps: only x is carried to the next step (one register array
    # fewer than keeping e; a second exp per element is cheap next to the memory traffic)
    if PACK:
        lo, hi = unpack_pair(x, PACK)
        if MODE == 0:
            # one FMA and one exp per element, as in `piece_max_sum`; an all -inf row (S = 0)
            # gives exp2(-inf) = 0 without a select
            off = M_safe * LOG2E + tl.log2(tl.where(S > 0.0, S, 1.0))
            y = pack_pair(tl.exp2(lo * LOG2E - off), tl.exp2(hi * LOG2E - off), PACK, ASM)
        else:
            y = pack_pair(normalised(lo, M_safe, S, MODE), normalised(hi, M_safe, S, MODE), PACK, ASM)
    else:
        y = normalised(x.to(tl.float32), M_safe, S, MODE).to(out_ty)
    return y


@triton.jit
def piece_output(x, pm, ps, MODE: tl.constexpr, PACK: tl.constexpr, ASM: tl.constexpr, out_ty: tl.constexpr):
    """`output_of` given the row's per-piece words (pm, ps) rather than its merged statistics."""
    M, S = merge_lanes(pm, ps)
    return output_of(x, M, S, MODE, PACK, ASM, out_ty)


# ----------------------------------------------------------------------------------------------------
# which piece a program holds: tasks, columns, loads
# ----------------------------------------------------------------------------------------------------


@triton.jit
def next_task(row, k, K, step_rows, step_k, TASKS: tl.constexpr):
    """The task (row, piece) a program takes after task (row, k): tasks are numbered t = row * K + k and
    program p of P takes t = p, p + P, p + 2P, ...; step_rows, step_k = divmod(P, K), so no division is
    made per step. Not TASKS: P is a multiple of K (step_k = 0), and a program keeps its piece (the
    compiler then keeps the piece's columns out of the loop)."""
    if TASKS:
        k = k + step_k
        wrap = k >= K
        return row + step_rows + wrap.to(tl.int32), tl.where(wrap, k - K, k)
    else:
        return row + step_rows, k


@triton.jit
def task_loop(pid, row, R, K, P, step_rows, TASKS: tl.constexpr):
    """(first, last, stride) of a program's loop over its tasks (`next_task`): task numbers, or, not
    TASKS, its rows (the first is `row`)."""
    if TASKS:
        return pid, R * K, P
    else:
        return row, R, step_rows


@triton.jit
def piece_cols(k, N, PIECE: tl.constexpr, EVEN: tl.constexpr):
    """(columns, mask) of piece k of a row of N columns (EVEN: N % PIECE == 0, no column mask: a mask per
    element held registers the pieces need)."""
    cols = k * PIECE + tl.arange(0, PIECE)
    if EVEN:
        return cols, tl.full([PIECE], 1, tl.int1)
    else:
        return cols, cols < N


@triton.jit
def load_piece(xp, row, k, R, N, I, s_o, s_i, s_n, pad, PIECE: tl.constexpr, COL64: tl.constexpr,
               EVEN: tl.constexpr):
    """Piece k of row `row`, which may be past the last, R - 1: its values are then never used. EVEN (no
    column mask): such a row reads row R - 1 instead, with no mask, so that no `other` is written into
    the registers before the load (a move per word and row otherwise)."""
    cols, cmask = piece_cols(k, N, PIECE, EVEN)
    offs = col_offsets(cols, s_n, COL64)
    if EVEN:
        return tl.load(xp + row_start(tl.minimum(row, R - 1), I, s_o, s_i) + offs)
    else:
        return tl.load(xp + row_start(row, I, s_o, s_i) + offs, mask=cmask & (row < R), other=pad)


@triton.jit
def prefetch_to_l2(base, nbytes):
    """Ask the SM's bulk copy unit to bring `nbytes` (a multiple of 16) from the 16-byte aligned `base`
    into L2 (sm_90 on; thread 0 alone asks): no register is written and the program does not wait."""
    one = tl.zeros([1], tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [base + one, nbytes + one], dtype=tl.int32, is_pure=False, pack=1)
