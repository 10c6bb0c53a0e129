"""Rows held whole in registers: one read, one write, the exact max before a single `exp` per element.

Short and medium rows (up to `max_row_block*` columns): a program holds `BLOCK_R` whole rows. Rows of
contiguous columns that start or end off 16-byte boundaries (odd lengths), whose loads Triton narrows
to what it can prove of the rows' alignment (one element for odd lengths), take one row per program
read in whole 16-byte vectors, the few elements at its ends one by one (`fwd_rows_aligned_kernel`).
The logsumexp backward is elementwise (`lse_bwd_kernel`), in 2-D tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ringlse.kernels.host import cdiv, next_power_of_2
from ringlse.kernels.launch import FREE, BoundLaunch

from .config import SoftmaxConfig
from .jit_common import LN2, LOG2E, col_offsets, row_start
from .vectors import load_row_piece, store_row_piece

# ----------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def fwd_rows_kernel(
    x_ptr, y_ptr, lse_ptr, R, N, I,
    sx_o, sx_i, sx_n, sy_o, sy_i, sy_n,
    MODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, COL64: tl.constexpr,
):
    """BLOCK_R whole rows per program, held in registers: exact max, one exp per element, one write.
    MODE 0 softmax, 1 log_softmax, 2 logsumexp (the float32 lse, one per row, in lse_ptr)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < R
    mask = rmask[:, None] & (cols < N)[None, :]
    xs = row_start(rows, I, sx_o, sx_i)
    x = tl.load(x_ptr + xs[:, None] + col_offsets(cols, sx_n, COL64)[None, :], mask=mask, other=float("-inf"))
    x = x.to(tl.float32)
    m = tl.max(x, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)  # all -inf row: exp(x - 0) = 0, sum 0, lse -inf
    e = tl.exp2((x - m[:, None]) * LOG2E)
    s = tl.sum(e, axis=1)
    if MODE == 0:
        y = e * tl.where(s > 0.0, 1.0 / s, 0.0)[:, None]
    else:
        lse = m + tl.log2(s) * LN2
        if MODE == 1:
            y = x - tl.where(s > 0.0, lse, 0.0)[:, None]  # all -inf row stays -inf, not NaN
        else:
            tl.store(lse_ptr + rows, lse, mask=rmask)
    if MODE != 2:
        ys = row_start(rows, I, sy_o, sy_i)
        tl.store(y_ptr + ys[:, None] + col_offsets(cols, sy_n, COL64)[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fwd_rows_aligned_kernel(
    x_ptr, y_ptr, I, sx_o, sx_i, sy_o, sy_i, N,
    MODE: tl.constexpr, BLOCK: tl.constexpr, VE: tl.constexpr,
):
    """`fwd_rows_kernel` for rows of contiguous columns off 16-byte boundaries, one row per program:
    the row's whole 16-byte vectors (BLOCK elements from its first boundary, `piece_body`) loaded and
    stored at full width, its head and tail elements one by one (`row_ends`), as
    `fwd_coop_aligned_kernel` reads them, but with the whole row in this program's registers: no word
    to publish or wait for, the exact max before one exp per element. Needs what the aligned
    cooperative kernels need (`plan.aligned_rows`). MODE 2 (logsumexp): y is the float32 lse, one per
    row."""
    row = tl.program_id(0)
    x, xe = load_row_piece(x_ptr, x_ptr, row_start(row, I, sx_o, sx_i), N, 0, True, float("-inf"),
                           float("-inf"), BLOCK, VE, VE)
    x = x.to(tl.float32)
    M = tl.maximum(tl.max(x, axis=0), tl.max(xe, axis=0))
    M_safe = tl.where(M == float("-inf"), 0.0, M)  # all -inf row: exps 0, sum 0, lse -inf
    e = tl.exp2((x - M_safe) * LOG2E)
    ee = tl.exp2((xe - M_safe) * LOG2E)
    S = tl.sum(e, axis=0) + tl.sum(ee, axis=0)
    if MODE == 2:
        tl.store(y_ptr + row, M_safe + tl.log2(S) * LN2)
    else:
        if MODE == 0:
            inv = tl.where(S > 0.0, 1.0 / S, 0.0)
            y, ye = e * inv, ee * inv
        else:
            lse = tl.where(S > 0.0, M_safe + tl.log2(S) * LN2, 0.0)  # all -inf row stays -inf, not NaN
            y, ye = x - lse, xe - lse
        ty = y_ptr.dtype.element_ty
        store_row_piece(y_ptr, y_ptr, row_start(row, I, sy_o, sy_i), N, 0, y.to(ty), ye.to(ty), BLOCK, VE, VE)


@triton.jit
def bwd_rows_kernel(
    y_ptr, g_ptr, dx_ptr, R, N, I,
    sy_o, sy_i, sy_n, sg_o, sg_i, sg_n, sd_o, sd_i, sd_n,
    LOG: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, COL64: tl.constexpr,
):
    """Whole rows in registers. softmax: dx = y (g - sum(g y)); log_softmax: dx = g - exp(y) sum(g)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < R)[:, None] & (cols < N)[None, :]
    ystart = row_start(rows, I, sy_o, sy_i)
    gstart = row_start(rows, I, sg_o, sg_i)
    y_other = float("-inf") if LOG else 0.0  # padding that contributes exp(y) = 0 or y = 0
    y = tl.load(y_ptr + ystart[:, None] + col_offsets(cols, sy_n, COL64)[None, :], mask=mask, other=y_other)
    g = tl.load(g_ptr + gstart[:, None] + col_offsets(cols, sg_n, COL64)[None, :], mask=mask, other=0.0)
    y = y.to(tl.float32)
    g = g.to(tl.float32)
    if LOG:
        dx = g - tl.exp2(y * LOG2E) * tl.sum(g, axis=1)[:, None]
    else:
        dx = y * (g - tl.sum(g * y, axis=1)[:, None])
    dstart = row_start(rows, I, sd_o, sd_i)
    tl.store(dx_ptr + dstart[:, None] + col_offsets(cols, sd_n, COL64)[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def lse_bwd_kernel(
    x_ptr, lse_ptr, g_ptr, dx_ptr, R, N, I, sx_o, sx_i, sx_n, sd_o, sd_i, sd_n, N_COL_TILES,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, COL64: tl.constexpr,
):
    """dx = g * exp(x - lse) per row, 0 for an all -inf row (lse = -inf). Elementwise, 2-D tiles."""
    pid = tl.program_id(0)
    rows = (pid // N_COL_TILES) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid % N_COL_TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < R
    mask = rmask[:, None] & (cols < N)[None, :]
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
    g = tl.load(g_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    # x - (+inf) = -inf even where x is -inf, so exp gives 0 instead of exp(-inf - -inf) = NaN
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    xs = row_start(rows, I, sx_o, sx_i)
    x = tl.load(x_ptr + xs[:, None] + col_offsets(cols, sx_n, COL64)[None, :], mask=mask, other=float("-inf"))
    dx = g[:, None] * tl.exp2((x.to(tl.float32) - lse[:, None]) * LOG2E)
    ds = row_start(rows, I, sd_o, sd_i)
    tl.store(dx_ptr + ds[:, None] + col_offsets(cols, sd_n, COL64)[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------
# Launchers (plan time: each returns the launch a call plan repeats, `BoundLaunch`)
# ----------------------------------------------------------------------------------------------------


def row_warps(tile: int) -> int:
    """Warps of a program holding `tile` elements (~512 a warp, 2 to 32)."""
    return max(2, min(32, tile // 512))


def short_tile(cfg: SoftmaxConfig, R: int, N: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_N) for rows held whole in registers."""
    block_n = next_power_of_2(N)
    tile = cfg.short_tile if block_n <= cfg.short_cols else cfg.tile
    block_r = max(1, min(tile // block_n, next_power_of_2(R)))
    return block_r, block_n


def rows_forward(cfg: SoftmaxConfig, R: int, N: int, I: int, strides: tuple, mode: int, col64: bool) -> BoundLaunch:
    """`fwd_rows_kernel` over rows of these layouts (`strides`: x's (outer, inner, column), then y's, all
    0 for logsumexp), called with `(x, y, lse)` (a pointer the mode does not use: any tensor)."""
    block_r, block_n = short_tile(cfg, R, N)
    return BoundLaunch(
        fwd_rows_kernel, (cdiv(R, block_r),), FREE, FREE, FREE, R, N, I, *strides,
        MODE=mode, BLOCK_R=block_r, BLOCK_N=block_n, COL64=col64, num_warps=row_warps(block_r * block_n),
    )


def aligned_rows_forward(cfg: SoftmaxConfig, xm: torch.Tensor, R: int, N: int, I: int, strides: tuple,
                         mode: int) -> BoundLaunch:
    """`fwd_rows_aligned_kernel` over rows of these layouts (`strides`: (sx_o, sx_i, sy_o, sy_i)), called
    with `(x, y)`; y is the float32 lse for logsumexp (MODE 2)."""
    ve = 16 // xm.element_size()  # elements per 16-byte vector
    block = max(ve, next_power_of_2(N // ve * ve))  # (a row's whole vectors span at most this)
    # ~32 elements a thread: fewer warps than the row kernels take
    warps, cap = max(2, min(32, block // 1024)), {}
    if xm.is_cuda and ve == 8 and block >= cfg.aligned_rows_wide_16:
        warps, cap = block // 2048, dict(maxnreg=cfg.aligned_rows_wide_maxnreg)
    return BoundLaunch(fwd_rows_aligned_kernel, (R,), FREE, FREE, I, *strides, N, MODE=mode, BLOCK=block,
                       VE=ve, num_warps=int(warps), **cap)


def rows_backward(cfg: SoftmaxConfig, R: int, N: int, I: int, strides: tuple, log: bool, col64: bool) -> BoundLaunch:
    """`bwd_rows_kernel` over rows of these layouts (`strides`: (outer, inner, column) of y, g and dx),
    called with `(y, g, dx)`."""
    block_r, block_n = short_tile(cfg, R, N)
    return BoundLaunch(
        bwd_rows_kernel, (cdiv(R, block_r),), FREE, FREE, FREE, R, N, I, *strides, LOG=log, BLOCK_R=block_r,
        BLOCK_N=block_n, COL64=col64, num_warps=row_warps(block_r * block_n),
    )


def logsumexp_backward(cfg: SoftmaxConfig, R: int, N: int, I: int, strides: tuple, col64: bool) -> BoundLaunch:
    """`lse_bwd_kernel` over rows of these layouts (`strides`: (outer, inner, column) of x, then dx's),
    called with `(x, lse, g, dx)`, lse and g contiguous vectors of R."""
    block_n = min(next_power_of_2(N), 2048)
    block_r = max(1, min(cfg.tile // block_n, next_power_of_2(R)))
    n_col_tiles = cdiv(N, block_n)
    return BoundLaunch(
        lse_bwd_kernel, (cdiv(R, block_r) * n_col_tiles,), FREE, FREE, FREE, FREE, R, N, I, *strides, n_col_tiles,
        BLOCK_R=block_r, BLOCK_N=block_n, COL64=col64, num_warps=row_warps(block_r * block_n),
    )
