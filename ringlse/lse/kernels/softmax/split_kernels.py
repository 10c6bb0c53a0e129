"""Long rows in two passes over memory, for rows the cooperative kernels do not take (few rows, strided
layouts they refuse, the interpreter).

Many rows: one program per row; pass 1 keeps a running max and rescaled sum per lane (one read, no
block-wide reduction inside the loop), pass 2 normalises and writes, walking the row backwards so that
the chunks pass 1 read last are re-read while still in L2. Few rows: each row is split into pieces over
several programs; a stats kernel writes one `(max, sum)` per piece and the normalising kernel merges
them (logsumexp: the piece that finishes last merges them, in the same launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ringlse.kernels.host import cdiv, next_power_of_2
from ringlse.kernels.launch import FREE, BoundLaunch

from .config import SoftmaxConfig
from .device import num_sms, partials, row_counters, workspace
from .jit_common import LN2, LOG2E, col_offsets, merge_lanes, row_start

# ----------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def online_update(m, s, x):
    """Fold values `x` into per-lane running `(max m, sum s of exp(. - m))`, with one exp per element.

    exp(-|x - m|) is exp(x - m) when x <= m and exp(m - x) (the rescale of s) when x > m. An x of
    -inf contributes nothing; testing it avoids `-inf - -inf` = NaN while m is still -inf.
    """
    d = tl.exp2(-tl.abs(x - m) * LOG2E)
    d = tl.where(x == float("-inf"), 0.0, d)
    s = tl.where(x > m, s * d + 1.0, s + d)
    m = tl.maximum(m, x)
    return m, s


@triton.jit
def merge_partials(pm_ptr, ps_ptr, base, K, KB: tl.constexpr):
    """Merge the K per-piece `(max, sum)` stored from `base` on. `.cg`: read them from L2, never from a
    stale L1 line (other programs of the same launch may have written them)."""
    offs = tl.arange(0, KB)
    pm = tl.load(pm_ptr + base + offs, mask=offs < K, other=float("-inf"), cache_modifier=".cg")
    ps = tl.load(ps_ptr + base + offs, mask=offs < K, other=0.0, cache_modifier=".cg")
    return merge_lanes(pm, ps)


@triton.jit
def piece_stats(x_ptr, start, c0, c1, s_n, BLOCK_N: tl.constexpr, COL64: tl.constexpr):
    """(M, S) of columns [c0, c1) of the row at element offset `start`: one read, chunk by chunk."""
    cols = tl.arange(0, BLOCK_N)
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_N], tl.float32)
    for c in range(c0, c1, BLOCK_N):
        cc = c + cols
        x = tl.load(x_ptr + start + col_offsets(cc, s_n, COL64), mask=cc < c1, other=float("-inf"))
        m, s = online_update(m, s, x.to(tl.float32))
    return merge_lanes(m, s)


@triton.jit
def fwd_stats_kernel(
    x_ptr, pm_ptr, ps_ptr, lse_ptr, cnt_ptr, N, I, sx_o, sx_i, sx_n, PIECE, NP,
    OUT: tl.constexpr, NP_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, COL64: tl.constexpr,
):
    """(max, sum) of piece `program_id(1)` of row `program_id(0)`.

    OUT = 0: store the piece's partials (the normalising kernel merges them); 1: the row is one piece,
    store its lse; 2 (a split logsumexp in one launch): store the partials, and the piece that arrives
    last at the row's counter merges them into the lse and resets the counter to 0 for the next call.
    No program waits for another, so any grid size is safe.
    """
    row = tl.program_id(0)
    p = tl.program_id(1)
    start = row_start(row, I, sx_o, sx_i)
    c0 = p * PIECE
    M, S = piece_stats(x_ptr, start, c0, tl.minimum(c0 + PIECE, N), sx_n, BLOCK_N, COL64)
    if OUT == 1:
        tl.store(lse_ptr + row, tl.where(M == float("-inf"), 0.0, M) + tl.log2(S) * LN2)
    else:
        tl.store(pm_ptr + row * NP + p, M)
        tl.store(ps_ptr + row * NP + p, S)
    if OUT == 2:
        # release: this piece's partials are visible before its count; acquire: the last arriver sees
        # every piece's partials (each was released before its count)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
        if arrived == NP - 1:
            M, S = merge_partials(pm_ptr, ps_ptr, row * NP, NP, NP_BLOCK)
            tl.store(lse_ptr + row, tl.where(M == float("-inf"), 0.0, M) + tl.log2(S) * LN2)
            tl.atomic_xchg(cnt_ptr + row, 0)


@triton.jit
def normalise_piece(x_ptr, y_ptr, xs, ys, c0, c1, sx_n, sy_n, M, S,
                    MODE: tl.constexpr, BLOCK_N: tl.constexpr, COL64: tl.constexpr):
    """Write softmax (MODE 0) or log_softmax of columns [c0, c1) of a row whose stats are (M, S).

    Walks the piece backwards: a stats pass read the last chunks most recently, so they are the
    likeliest to still be in L2."""
    M = tl.where(M == float("-inf"), 0.0, M)
    inv = tl.where(S > 0.0, 1.0 / S, 0.0)
    lse = tl.where(S > 0.0, M + tl.log2(S) * LN2, 0.0)  # 0 for an all -inf row keeps x - lse = -inf
    n_chunks = tl.cdiv(c1 - c0, BLOCK_N)
    cols = tl.arange(0, BLOCK_N)
    for i in range(0, n_chunks):
        cc = c0 + (n_chunks - 1 - i) * BLOCK_N + cols
        mask = cc < c1
        x = tl.load(x_ptr + xs + col_offsets(cc, sx_n, COL64), mask=mask, other=float("-inf")).to(tl.float32)
        if MODE == 0:
            y = tl.exp2((x - M) * LOG2E) * inv
        else:
            y = x - lse
        tl.store(y_ptr + ys + col_offsets(cc, sy_n, COL64), y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fwd_long_kernel(
    x_ptr, y_ptr, pm_ptr, ps_ptr, N, I,
    sx_o, sx_i, sx_n, sy_o, sy_i, sy_n, PIECE, NP,
    MODE: tl.constexpr, FUSED: tl.constexpr, NP_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    COL64: tl.constexpr,
):
    """Normalise piece `program_id(1)` of row `program_id(0)`.

    FUSED (one piece per row): pass 1 over the whole row computes the stats here; otherwise they come
    from the stats kernel's per-piece partials. The write pass walks the piece backwards: pass 1 read the
    last chunks most recently, so they are the likeliest to still be in L2.
    """
    row = tl.program_id(0)
    p = tl.program_id(1)
    xs = row_start(row, I, sx_o, sx_i)
    ys = row_start(row, I, sy_o, sy_i)
    if FUSED:
        M, S = piece_stats(x_ptr, xs, 0, N, sx_n, BLOCK_N, COL64)
    else:
        M, S = merge_partials(pm_ptr, ps_ptr, row * NP, NP, NP_BLOCK)
    c0 = p * PIECE
    normalise_piece(x_ptr, y_ptr, xs, ys, c0, tl.minimum(c0 + PIECE, N), sx_n, sy_n, M, S, MODE, BLOCK_N, COL64)


@triton.jit
def bwd_piece_sum(y_ptr, g_ptr, ystart, gstart, c0, c1, sy_n, sg_n, LOG: tl.constexpr,
                  BLOCK_N: tl.constexpr, COL64: tl.constexpr):
    """sum(g) (log_softmax) or sum(g * y) (softmax) over columns [c0, c1)."""
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for c in range(c0, c1, BLOCK_N):
        cc = c + cols
        mask = cc < c1
        g = tl.load(g_ptr + gstart + col_offsets(cc, sg_n, COL64), mask=mask, other=0.0).to(tl.float32)
        if LOG:
            acc += g
        else:
            y = tl.load(y_ptr + ystart + col_offsets(cc, sy_n, COL64), mask=mask, other=0.0).to(tl.float32)
            acc += g * y
    return tl.sum(acc, axis=0)


@triton.jit
def bwd_partial_kernel(
    y_ptr, g_ptr, part_ptr, N, I, sy_o, sy_i, sy_n, sg_o, sg_i, sg_n, PIECE, NP,
    LOG: tl.constexpr, BLOCK_N: tl.constexpr, COL64: tl.constexpr,
):
    """Per-piece partial of the backward row sum (split rows)."""
    row = tl.program_id(0)
    p = tl.program_id(1)
    c0 = p * PIECE
    part = bwd_piece_sum(
        y_ptr, g_ptr, row_start(row, I, sy_o, sy_i), row_start(row, I, sg_o, sg_i),
        c0, tl.minimum(c0 + PIECE, N), sy_n, sg_n, LOG, BLOCK_N, COL64,
    )
    tl.store(part_ptr + row * NP + p, part)


@triton.jit
def bwd_write_piece(y_ptr, g_ptr, dx_ptr, ystart, gstart, dstart, c0, c1, sy_n, sg_n, sd_n, total,
                    LOG: tl.constexpr, BLOCK_N: tl.constexpr, COL64: tl.constexpr):
    """dx of columns [c0, c1) from the row sum `total`, walking backwards as the forward does."""
    n_chunks = tl.cdiv(c1 - c0, BLOCK_N)
    cols = tl.arange(0, BLOCK_N)
    y_other = float("-inf") if LOG else 0.0
    for i in range(0, n_chunks):
        cc = c0 + (n_chunks - 1 - i) * BLOCK_N + cols
        mask = cc < c1
        y = tl.load(y_ptr + ystart + col_offsets(cc, sy_n, COL64), mask=mask, other=y_other).to(tl.float32)
        g = tl.load(g_ptr + gstart + col_offsets(cc, sg_n, COL64), mask=mask, other=0.0).to(tl.float32)
        if LOG:
            dx = g - tl.exp2(y * LOG2E) * total
        else:
            dx = y * (g - total)
        tl.store(dx_ptr + dstart + col_offsets(cc, sd_n, COL64), dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def bwd_long_kernel(
    y_ptr, g_ptr, dx_ptr, part_ptr, N, I,
    sy_o, sy_i, sy_n, sg_o, sg_i, sg_n, sd_o, sd_i, sd_n, PIECE, NP,
    LOG: tl.constexpr, FUSED: tl.constexpr, NP_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    COL64: tl.constexpr,
):
    """Backward of piece `program_id(1)` of row `program_id(0)`; the row sum is computed here (FUSED)
    or merged from the partial kernel's pieces. The write pass walks backwards, as in the forward."""
    row = tl.program_id(0)
    p = tl.program_id(1)
    ystart = row_start(row, I, sy_o, sy_i)
    gstart = row_start(row, I, sg_o, sg_i)
    dstart = row_start(row, I, sd_o, sd_i)
    if FUSED:
        total = bwd_piece_sum(y_ptr, g_ptr, ystart, gstart, 0, N, sy_n, sg_n, LOG, BLOCK_N, COL64)
    else:
        offs = tl.arange(0, NP_BLOCK)
        total = tl.sum(tl.load(part_ptr + row * NP + offs, mask=offs < NP, other=0.0), axis=0)
    c0 = p * PIECE
    bwd_write_piece(y_ptr, g_ptr, dx_ptr, ystart, gstart, dstart, c0, tl.minimum(c0 + PIECE, N), sy_n, sg_n, sd_n,
                    total, LOG, BLOCK_N, COL64)


# ----------------------------------------------------------------------------------------------------
# Launchers (plan time: each returns a step that a call plan repeats)
# ----------------------------------------------------------------------------------------------------


def split(cfg: SoftmaxConfig, R: int, N: int, device: torch.device) -> tuple[int, int, int]:
    """(pieces per row, piece length, chunk) for rows too long for registers: few rows are cut into
    pieces over programs (enough for ~4 a SM), many rows take one program each."""
    chunk = cfg.chunk
    sms = num_sms(device)
    split_rows = cfg.split_rows if cfg.split_rows is not None else 2 * sms
    n_chunks = cdiv(N, chunk)
    pieces = 1
    if R < split_rows:
        pieces = max(1, min(n_chunks, cdiv(4 * sms, R), 4096))
    piece = cdiv(n_chunks, pieces) * chunk
    return cdiv(N, piece), piece, chunk


def split_forward(cfg: SoftmaxConfig, device: torch.device, R: int, N: int, I: int, strides: tuple, mode: int,
                  col64: bool):
    """A step `step(x, y)`: softmax (MODE 0) or log_softmax over rows of these layouts (`strides`: x's
    (outer, inner, column), then y's) in two passes; split rows through per-piece partials."""
    sx_o, sx_i, sx_n, sy_o, sy_i, sy_n = strides
    n_pieces, piece, chunk = split(cfg, R, N, device)
    stats = BoundLaunch(
        fwd_stats_kernel, (R, n_pieces), FREE, FREE, FREE, FREE, FREE, N, I, sx_o, sx_i, sx_n, piece, n_pieces,
        OUT=0, NP_BLOCK=1, BLOCK_N=chunk, COL64=col64, num_warps=cfg.chunk_warps,
    )
    normalise = BoundLaunch(
        fwd_long_kernel, (R, n_pieces), FREE, FREE, FREE, FREE, N, I, sx_o, sx_i, sx_n, sy_o, sy_i, sy_n, piece,
        n_pieces, MODE=mode, FUSED=n_pieces == 1, NP_BLOCK=next_power_of_2(n_pieces), BLOCK_N=chunk,
        COL64=col64, num_warps=cfg.chunk_warps,
    )

    def step(xm: torch.Tensor, ym: torch.Tensor) -> None:
        pm = ps = xm  # unused placeholders when fused
        if n_pieces > 1:
            pm, ps = partials(workspace(xm.device), xm.device, 2, R, n_pieces)
            stats(xm, pm, ps, pm, pm)
        normalise(xm, ym, pm, ps)

    return step


def split_logsumexp(cfg: SoftmaxConfig, device: torch.device, R: int, N: int, I: int, strides: tuple, col64: bool):
    """A step `step(x, lse)` over rows of this layout (`strides`: (outer, inner, column)), in one
    launch either way: a row of one piece writes its lse; a split row's last piece merges."""
    sx_o, sx_i, sx_n = strides
    n_pieces, piece, chunk = split(cfg, R, N, device)
    stats = BoundLaunch(
        fwd_stats_kernel, (R, n_pieces), FREE, FREE, FREE, FREE, FREE, N, I, sx_o, sx_i, sx_n, piece, n_pieces,
        OUT=2 if n_pieces > 1 else 1, NP_BLOCK=next_power_of_2(n_pieces), BLOCK_N=chunk, COL64=col64,
        num_warps=cfg.chunk_warps,
    )

    def step(xm: torch.Tensor, lse: torch.Tensor) -> None:
        if n_pieces > 1:
            ws = workspace(xm.device)
            pm, ps = partials(ws, xm.device, 2, R, n_pieces)
            stats(xm, pm, ps, lse, row_counters(ws, xm.device, R))
        else:
            stats(xm, lse, lse, lse, lse)  # (partials and counters unused: any pointer)

    return step


def split_backward(cfg: SoftmaxConfig, device: torch.device, R: int, N: int, I: int, strides: tuple, log: bool,
                   col64: bool):
    """A step `step(y, g, dx)` over rows of these layouts (`strides`: (outer, inner, column) of y, g and
    dx) in two passes; split rows through per-piece partial sums."""
    n_pieces, piece, chunk = split(cfg, R, N, device)
    sums = BoundLaunch(
        bwd_partial_kernel, (R, n_pieces), FREE, FREE, FREE, N, I, *strides[:6], piece, n_pieces,
        LOG=log, BLOCK_N=chunk, COL64=col64, num_warps=cfg.chunk_warps,
    )
    write = BoundLaunch(
        bwd_long_kernel, (R, n_pieces), FREE, FREE, FREE, FREE, N, I, *strides, piece, n_pieces, LOG=log,
        FUSED=n_pieces == 1, NP_BLOCK=next_power_of_2(n_pieces), BLOCK_N=chunk, COL64=col64,
        num_warps=cfg.chunk_warps,
    )

    def step(ym: torch.Tensor, gm: torch.Tensor, dm: torch.Tensor) -> None:
        part = ym  # (unused when fused)
        if n_pieces > 1:
            (part,) = partials(workspace(ym.device), ym.device, 1, R, n_pieces)
            sums(ym, gm, part)
        write(ym, gm, dm, part)

    return step
