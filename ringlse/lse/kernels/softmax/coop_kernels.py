"""Cooperative kernels: long rows in one read and one write, each row's pieces held in the registers of
programs that run at the same time and merge their statistics through one 64-bit word per piece.

Why: the two-pass forms (`split_kernels.py`) read each element twice from memory once the rows in
flight outgrow L2 (3 bytes moved per 2 needed, at most 2/3 of copy bandwidth). Here each piece
publishes its `(max, sum)` (or backward row sum) with a relaxed exchange (`publish_word`), polls the
row's words until all are there, merges, and writes from registers. The grid is sized from the compiled
kernel's occupancy and launched as a cooperative grid, so every program is resident at once: a program
waits only on programs that are running (`coop_launch.py`). The Triton interpreter runs programs one
after another, so there (CPU) only rows of one piece may take these kernels.

bf16/fp16 rows are read and written as int32 words of two elements, so that the three row pieces a
forward program carries take a register per two elements. Rows of contiguous columns that start or end
off 16-byte boundaries (odd lengths) take the `_aligned` kernels, whose pieces hold the row's whole
16-byte vectors and whose piece 0 reads and writes the few elements at the row's ends one by one.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .coop_pieces import (await_words, load_piece, next_task, output_of, pack_word, piece_cols, piece_max_sum,
                          piece_output, piece_pointers, prefetch_to_l2, publish_piece, publish_word, reset_words,
                          task_loop)
from .jit_common import LN2, LOG2E, col_offsets, merge_lanes, row_start
from .vectors import load_row_piece, piece_body, row_cuts, row_ends, store_row_piece


@triton.jit
def fwd_coop_kernel(
    x_ptr, y_ptr, w_ptr, c_ptr, n_clear, R, N, I,
    sx_o, sx_i, sx_n, sy_o, sy_i, sy_n, K,
    MODE: tl.constexpr, PIECE: tl.constexpr, KB: tl.constexpr, COL64: tl.constexpr, PACK: tl.constexpr,
    ASM: tl.constexpr, EVEN: tl.constexpr, TASKS: tl.constexpr,
):
    """The grid's P programs take the R * K tasks (piece k of row r: task t = r * K + k) in turn, program
    p tasks p, p + P, ... (`next_task`): one read, one write. TASKS: P need not be a multiple of K, so
    every resident program works. Else P is a whole number of rows in flight, program `slot * K + k`
    holding piece k of rows slot, slot + P / K, ... (`coop_launch.use_tasks` chooses).

    Each piece publishes its `(max, sum)` as one word (`publish_word`), pipelined by one task: a
    program publishes task t + P before it waits for task t's row, so the row's other pieces have a
    whole step to publish theirs, and the task after that is already requested. No deadlock: a row's
    K <= P tasks lie in at most two consecutive steps, so before the programs wait in step j they have
    published every task of steps j and j + 1 (the first two without waiting: every program of the
    grid is resident).

    PACK (1: bf16, 2: fp16): x and y are read and written as int32 words of two elements, so N, PIECE
    and the strides count words. The three row pieces a program carries (this task, the next, the one
    in flight) then take one register per two elements; loaded as 16-bit elements, each took a whole
    register, and the register file, not memory, bounded the bytes in flight. ASM: packed conversions
    (`pack_pair`), compiled only. EVEN: N is a multiple of PIECE (no column mask).

    `w_ptr`: the launch's `[R, K]` words, all -1 at the start; `c_ptr`: the previous launch's, of which
    it resets the first `n_clear` (`device.coop_words`)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    step_rows = P // K
    step_k = P - step_rows * K
    row = pid // K
    k = pid - row * K
    xp, yp, pad = piece_pointers(x_ptr, y_ptr, PACK)
    x = load_piece(xp, row, k, R, N, I, sx_o, sx_i, sx_n, pad, PIECE, COL64, EVEN)
    row1, k1 = next_task(row, k, K, step_rows, step_k, TASKS)
    x_next = load_piece(xp, row1, k1, R, N, I, sx_o, sx_i, sx_n, pad, PIECE, COL64, EVEN)
    reset_words(c_ptr, n_clear)  # (while the first loads are in flight)
    m, s = piece_max_sum(x, PACK, ASM)
    publish_word(w_ptr + row * K + k, pack_word(m, s))
    first, last, stride = task_loop(pid, row, R, K, P, step_rows, TASKS)
    for it in range(first, last, stride):
        if not TASKS:  # (the row from the loop's counter: nothing else carried from step to step)
            row, row1 = it, it + step_rows
        x1 = x_next
        row2, k2 = next_task(row1, k1, K, step_rows, step_k, TASKS)
        x_next = load_piece(xp, row2, k2, R, N, I, sx_o, sx_i, sx_n, pad, PIECE, COL64, EVEN)
        if row1 < R:
            m1, s1 = piece_max_sum(x1, PACK, ASM)
            publish_word(w_ptr + row1 * K + k1, pack_word(m1, s1))
        pm, ps = await_words(w_ptr, row * K, K, KB)
        y = piece_output(x, pm, ps, MODE, PACK, ASM, y_ptr.dtype.element_ty)
        cols, cmask = piece_cols(k, N, PIECE, EVEN)
        tl.store(yp + row_start(row, I, sy_o, sy_i) + col_offsets(cols, sy_n, COL64), y, mask=cmask)
        x = x1
        row, k, row1, k1 = row1, k1, row2, k2


@triton.jit
def fwd_coop_aligned_kernel(
    x_ptr, y_ptr, w_ptr, c_ptr, n_clear, R, SPAN, I, sx_o, sx_i, sy_o, sy_i, N, K,
    MODE: tl.constexpr, PIECE: tl.constexpr, KB: tl.constexpr, PACK: tl.constexpr, ASM: tl.constexpr,
    VE: tl.constexpr, L2_AHEAD: tl.constexpr, TASKS: tl.constexpr,
):
    """`fwd_coop_kernel` (its tasks, words and pipelining) for rows of contiguous columns, read and written
    in 16-byte vectors whatever their length and start: piece k of a row starts at the row's first 16-byte
    boundary, plus k pieces (`piece_body`), so its loads and stores keep their full width on every row,
    and the pieces hold only whole vectors of the row; the elements before the row's first boundary and
    after its last (fewer than a vector at each end) are read and written one by one by piece 0
    (`row_ends`). Needs both base pointers 16-byte aligned and the rows of y as far from 16-byte
    boundaries as those of x (the launcher checks). Rows start anywhere: odd lengths and odd row strides
    too, 2-byte rows as words of two elements (PACK) included.

    The ends apart, rather than whole vectors padded element by element where they hold the rows
    beside: the padding took registers over the whole piece.

    SPAN: the units (elements, or words when PACK) of a row's whole vectors at most, from which the
    launcher cut K pieces of PIECE units; N: the row's elements; VE: elements per 16 bytes. MODE 2
    (logsumexp): y is the float32 lse, one per row, which piece 0 writes; the other pieces only
    publish their words and never wait.

    L2_AHEAD (sm_90 on, softmax and log_softmax): each program also asks L2 for its piece of the task
    after the one it loads (`prefetch_to_l2`), so that the loads of the next step find it there."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    step_rows = P // K
    step_k = P - step_rows * K
    row = pid // K
    k = pid - row * K
    xp, yp, pad = piece_pointers(x_ptr, y_ptr, PACK)
    x, xe = load_row_piece(x_ptr, xp, row_start(row, I, sx_o, sx_i), N, k, True, pad, float("-inf"), PIECE, VE, 4)
    row1, k1 = next_task(row, k, K, step_rows, step_k, TASKS)
    x_next, xe_next = load_row_piece(x_ptr, xp, row_start(row1, I, sx_o, sx_i), N, k1, row1 < R, pad,
                                     float("-inf"), PIECE, VE, 4)
    reset_words(c_ptr, n_clear)  # (while the first loads are in flight)
    publish_piece(w_ptr, row * K + k, k, x, xe, PACK, ASM)
    first, last, stride = task_loop(pid, row, R, K, P, step_rows, TASKS)
    for it in range(first, last, stride):
        if not TASKS:
            row, row1 = it, it + step_rows
        x1, xe1 = x_next, xe_next
        row2, k2 = next_task(row1, k1, K, step_rows, step_k, TASKS)
        x_next, xe_next = load_row_piece(x_ptr, xp, row_start(row2, I, sx_o, sx_i), N, k2, row2 < R, pad,
                                         float("-inf"), PIECE, VE, 4)
        if L2_AHEAD:
            row3, k3 = next_task(row2, k2, K, step_rows, step_k, TASKS)
            if row3 < R:
                s_a = row_start(row3, I, sx_o, sx_i)
                p0, _ = piece_body(s_a, N, k3, True, PIECE, VE, 4)
                span = tl.minimum(row_cuts(s_a, N, VE)[1] // (VE // 4) - p0, PIECE)  # units of 4 bytes
                if span > 0:
                    prefetch_to_l2(xp + p0, (span * 4).to(tl.int32))
        if row1 < R:
            publish_piece(w_ptr, row1 * K + k1, k1, x1, xe1, PACK, ASM)
        if MODE != 2 or k == 0:
            pm, ps = await_words(w_ptr, row * K, K, KB)
            M, S = merge_lanes(pm, ps)
            if MODE == 2:  # logsumexp: y is the float32 lse, one per row, written by piece 0
                tl.store(y_ptr + row, tl.where(M == float("-inf"), 0.0, M) + tl.log2(S) * LN2)
            else:
                out_ty = y_ptr.dtype.element_ty
                ys = row_start(row, I, sy_o, sy_i)
                p0, body = piece_body(ys, N, k, True, PIECE, VE, 4)
                y = output_of(x, M, S, MODE, PACK, ASM, out_ty)
                tl.store(yp + p0 + tl.arange(0, PIECE), y, mask=body)
                if k == 0:  # the row's end elements (`store_row_piece`, the other pieces skip them)
                    e, ends = row_ends(ys, N, k, True, VE)
                    tl.store(y_ptr + e, output_of(xe, M, S, MODE, 0, ASM, out_ty), mask=ends)
        x, xe = x1, xe1
        row, k, row1, k1 = row1, k1, row2, k2


@triton.jit
def bwd_coop_kernel(
    y_ptr, g_ptr, dx_ptr, w_ptr, c_ptr, n_clear, R, N, I,
    sy_o, sy_i, sy_n, sg_o, sg_i, sg_n, sd_o, sd_i, sd_n, K,
    LOG: tl.constexpr, PIECE: tl.constexpr, KB: tl.constexpr, COL64: tl.constexpr, EVEN: tl.constexpr,
):
    """The backward in the same cooperative form: pieces of y and g stay in registers while the row
    sum (sum(g * y), or sum(g) for log_softmax) is merged from the pieces' words (`publish_word`).
    Not pipelined: its two inputs per piece already keep enough bytes in flight. Words and EVEN as in
    `fwd_coop_kernel`; the grid is a whole number of rows in flight, program `slot * K + k` holding
    piece k of rows slot, slot + SLOTS, ... (unpipelined, a row straddling two steps would wait a
    whole step for its rest)."""
    pid = tl.program_id(0)
    SLOTS = tl.num_programs(0) // K
    slot = pid // K
    k = pid - slot * K
    cols = k * PIECE + tl.arange(0, PIECE)
    if EVEN:
        cmask = tl.full([PIECE], 1, tl.int1)
    else:
        cmask = cols < N
    reset_words(c_ptr, n_clear)
    y_other = float("-inf") if LOG else 0.0
    for row in range(slot, R, SLOTS):
        ystart = row_start(row, I, sy_o, sy_i)
        gstart = row_start(row, I, sg_o, sg_i)
        y = tl.load(y_ptr + ystart + col_offsets(cols, sy_n, COL64), mask=cmask, other=y_other).to(tl.float32)
        g = tl.load(g_ptr + gstart + col_offsets(cols, sg_n, COL64), mask=cmask, other=0.0).to(tl.float32)
        if LOG:
            part = tl.sum(g, axis=0)
        else:
            part = tl.sum(g * y, axis=0)
        publish_word(w_ptr + row * K + k, pack_word(tl.full([], 0.0, tl.float32), part))
        _, parts = await_words(w_ptr, row * K, K, KB)
        total = tl.sum(parts, axis=0)
        if LOG:
            dx = g - tl.exp2(y * LOG2E) * total
        else:
            dx = y * (g - total)
        dstart = row_start(row, I, sd_o, sd_i)
        tl.store(dx_ptr + dstart + col_offsets(cols, sd_n, COL64), dx.to(dx_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def bwd_coop_aligned_kernel(
    y_ptr, g_ptr, dx_ptr, w_ptr, c_ptr, n_clear, R, SPAN, I, sy_o, sy_i, sg_o, sg_i, sd_o, sd_i, N, K,
    LOG: tl.constexpr, PIECE: tl.constexpr, KB: tl.constexpr, VE: tl.constexpr,
):
    """`bwd_coop_kernel` for rows of contiguous columns off 16-byte boundaries, in 16-byte vectors and
    the row's ends apart, as `fwd_coop_aligned_kernel`. Needs the rows of y, g and dx at the same
    offsets from 16-byte boundaries (the launcher checks)."""
    pid = tl.program_id(0)
    SLOTS = tl.num_programs(0) // K
    slot = pid // K
    k = pid - slot * K
    reset_words(c_ptr, n_clear)
    y_other = float("-inf") if LOG else 0.0
    for row in range(slot, R, SLOTS):
        # (the backward's pieces are elements: units of one element, VE to a vector)
        y, ye = load_row_piece(y_ptr, y_ptr, row_start(row, I, sy_o, sy_i), N, k, True, y_other, y_other,
                               PIECE, VE, VE)
        g, ge = load_row_piece(g_ptr, g_ptr, row_start(row, I, sg_o, sg_i), N, k, True, 0.0, 0.0, PIECE, VE, VE)
        y, g = y.to(tl.float32), g.to(tl.float32)
        if LOG:
            part = tl.sum(g, axis=0) + tl.sum(ge, axis=0)
        else:
            part = tl.sum(g * y, axis=0) + tl.sum(ge * ye, axis=0)
        publish_word(w_ptr + row * K + k, pack_word(tl.full([], 0.0, tl.float32), part))
        _, parts = await_words(w_ptr, row * K, K, KB)
        total = tl.sum(parts, axis=0)
        if LOG:
            dx = g - tl.exp2(y * LOG2E) * total
            dxe = ge - tl.exp2(ye * LOG2E) * total
        else:
            dx = y * (g - total)
            dxe = ye * (ge - total)
        out_ty = dx_ptr.dtype.element_ty
        store_row_piece(dx_ptr, dx_ptr, row_start(row, I, sd_o, sd_i), N, k, dx.to(out_ty), dxe.to(out_ty),
                        PIECE, VE, VE)
