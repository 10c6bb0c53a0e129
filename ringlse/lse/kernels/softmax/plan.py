"""Call plans: what a call decides, decided once per layout of its tensors.

Why: on inputs of a few MB a launcher's host time is the whole cost of a call (H200, 8 x 131072 float32
softmax: 55-90 us of Python per call for 7 us of GPU time, before plans). All that a call decides
(its rows' folding, the path, kernels, grids, warps and constexprs) depends only on the layouts of its
tensors (shape, strides, dtype, device, 16-byte alignment), its flags and the active config. So it is
decided once per such key, and the plan kept is a closure that does only the per-call work: views,
allocations, workspace and launches. A plan holds no tensor: each call passes its own.

Paths, the first that applies, fastest first: rows off 16-byte boundaries in whole vectors
(`fwd_rows_aligned_kernel` when short enough for registers, else the aligned cooperative kernels); short
rows in registers (`row_kernels.py`); long rows as cooperative pieces (`coop_kernels.py`: 2-byte rows
as words of two where they can be, else element by element); long rows in two passes
(`split_kernels.py`).
"""

from __future__ import annotations

import torch

from ringlse.kernels.host import interpreting

from . import row_kernels, split_kernels
from .config import SoftmaxConfig
from .coop_kernels import bwd_coop_aligned_kernel, bwd_coop_kernel, fwd_coop_aligned_kernel, fwd_coop_kernel
from .coop_launch import LOGSUMEXP, Replan, coop_step
from .device import bulk_prefetch
from .layout import (aligned_rows, col64, finish, input_rows, input_view, output_rows, output_view,
                     pair_pack)

SOFTMAX, LOG_SOFTMAX = 0, 1  # the forward kernels' MODE (LOGSUMEXP: 2)


class PlanCache:
    """Call plans by key (`layout.layout` of the tensors, the flags, the config), built on first use as
    `build(*args)` and called as `plan(*args)`; built again after one of its cooperative launches was
    refused outright (`Replan`: the next plan avoids that grid). Starts over past `limit` plans."""

    def __init__(self, limit: int = 1024):
        self.plans: dict[tuple, object] = {}
        self.limit = limit

    def __len__(self) -> int:
        return len(self.plans)

    def clear(self) -> None:
        self.plans.clear()

    def run(self, key: tuple, build, *args):
        while True:
            plan = self.plans.get(key)
            if plan is None:
                if len(self.plans) >= self.limit:
                    self.plans.clear()
                plan = self.plans[key] = build(*args)
            try:
                return plan(*args)
            except Replan:
                self.plans.pop(key, None)


CALL_PLANS = PlanCache()


def _aligned_forward(cfg: SoftmaxConfig, xm: torch.Tensor, y: torch.Tensor, R: int, N: int, I: int, strides: tuple,
                     mode: int, short: bool):
    """Plan time: a step `step(xm, y)` of the aligned forward, or None (take another path): rows `short`
    enough for registers one per program, else the aligned cooperative kernel, 2-byte rows as words of
    two. y is the output rows (strides (sx_o, sx_i, sy_o, sy_i)), or for logsumexp the float32 lse."""
    if short:
        return row_kernels.aligned_rows_forward(cfg, xm, R, N, I, strides, mode)
    ve = 16 // xm.element_size()  # elements per 16-byte vector
    words = {torch.bfloat16: 1, torch.float16: 2}.get(xm.dtype, 0)
    return coop_step(
        # SPAN: the units of a row's whole vectors, at most (4 per vector; a row inside one: a piece)
        cfg, fwd_coop_aligned_kernel, "fwd", (xm, y), R, max(1, N * xm.element_size() // 16 * 4), I, (*strides, N),
        dict(MODE=mode, PACK=words, ASM=not interpreting(), VE=ve,
             L2_AHEAD=mode != LOGSUMEXP and bulk_prefetch(xm.device)),
        per=2 if words else 1,
    )


def forward_step(cfg: SoftmaxConfig, xm: torch.Tensor, ym: torch.Tensor, R: int, N: int, I: int, strides: tuple,
                 mode: int):
    """Plan time: the forward's step `step(xm, ym)` over rows of these layouts (`strides`: x's (outer,
    inner, column), then y's)."""
    sx_o, sx_i, sx_n, sy_o, sy_i, sy_n = strides
    wide = col64(N, sx_n, sy_n)
    short = N <= (cfg.max_row_block_16 if xm.element_size() <= 2 else cfg.max_row_block)
    if (not short or N >= cfg.aligned_rows_min_cols) and aligned_rows(
        (xm, ym), N, ((sx_o, sx_i, sx_n), (sy_o, sy_i, sy_n))
    ) and (step := _aligned_forward(cfg, xm, ym, R, N, I, (sx_o, sx_i, sy_o, sy_i), mode, short)):
        return step
    if short:
        go = row_kernels.rows_forward(cfg, R, N, I, strides, mode, wide)
        return lambda xm, ym: go(xm, ym, xm)  # (no lse: any pointer)
    if (pack := pair_pack(xm, ym, N, (sx_o, sx_i, sy_o, sy_i), (sx_n, sy_n))) and (step := coop_step(
        cfg, fwd_coop_kernel, "fwd", (xm, ym), R, N // 2, I, (sx_o // 2, sx_i // 2, 1, sy_o // 2, sy_i // 2, 1),
        dict(MODE=mode, COL64=wide, PACK=pack, ASM=not interpreting()), per=2,
    )):
        return step
    if step := coop_step(cfg, fwd_coop_kernel, "fwd", (xm, ym), R, N, I, strides,
                         dict(MODE=mode, COL64=wide, PACK=0, ASM=False)):
        return step
    return split_kernels.split_forward(cfg, xm.device, R, N, I, strides, mode, wide)


def logsumexp_step(cfg: SoftmaxConfig, xm: torch.Tensor, R: int, N: int, I: int, strides: tuple):
    """Plan time: logsumexp's step `step(xm, lse)` over rows of this layout (`strides`: (outer, inner,
    column)). Rows off 16-byte boundaries in whole vectors, as the forward reads them (its MODE 2): rows
    as short as the forward's row kernels take one per program, 2-byte rows of any length the
    cooperative pieces (float32 rows that long keep the two-pass kernels: faster there)."""
    sx_o, sx_i, sx_n = strides
    wide = col64(N, sx_n)
    fits = N <= (cfg.max_row_block_16 if xm.element_size() <= 2 else cfg.max_row_block)
    if ((fits and N >= cfg.aligned_rows_min_cols) or (not fits and xm.element_size() == 2)) \
            and aligned_rows((xm,), N, (strides,)) \
            and (step := _aligned_forward(cfg, xm, xm.new_empty(1, dtype=torch.float32), R, N, I,
                                          # (a stand-in for the lse: MODE 2 writes float32, one per row)
                                          (sx_o, sx_i, 0, 0), LOGSUMEXP, fits)):
        return step
    if N <= cfg.max_row_block:
        go = row_kernels.rows_forward(cfg, R, N, I, (sx_o, sx_i, sx_n, 0, 0, 0), LOGSUMEXP, wide)
        return lambda xm, lse: go(xm, xm, lse)  # (no y: any pointer)
    return split_kernels.split_logsumexp(cfg, xm.device, R, N, I, strides, wide)


def backward_step(cfg: SoftmaxConfig, ym: torch.Tensor, gm: torch.Tensor, dm: torch.Tensor, R: int, N: int, I: int,
                  strides: tuple, log: bool):
    """Plan time: the softmax backward's step `step(ym, gm, dm)` over rows of these layouts (`strides`:
    (outer, inner, column) of y, g and dx)."""
    sy_o, sy_i, sy_n, sg_o, sg_i, sg_n, sd_o, sd_i, sd_n = strides
    wide = col64(N, sy_n, sg_n, sd_n)
    short = N <= cfg.max_row_block_bwd
    min_cols = cfg.aligned_min_cols_16 if ym.element_size() <= 2 else cfg.aligned_min_cols
    ve = 16 // ym.element_size()  # elements per 16-byte vector
    if (not short or N >= min_cols) and aligned_rows((ym, gm, dm), N, (strides[:3], strides[3:6], strides[6:])) \
            and (step := coop_step(
                # SPAN: the elements of a row's whole vectors, at most
                cfg, bwd_coop_aligned_kernel, "bwd", (ym, gm, dm), R, max(1, N // ve * ve), I,
                (sy_o, sy_i, sg_o, sg_i, sd_o, sd_i, N), dict(LOG=log, VE=ve))):
        return step
    if short:
        return row_kernels.rows_backward(cfg, R, N, I, strides, log, wide)
    if step := coop_step(cfg, bwd_coop_kernel, "bwd", (ym, gm, dm), R, N, I, strides, dict(LOG=log, COL64=wide)):
        return step
    return split_kernels.split_backward(cfg, ym.device, R, N, I, strides, log, wide)


# ----------------------------------------------------------------------------------------------------
# plans: `build(cfg, *args) -> plan`, `plan(cfg, *args) -> result`
# ----------------------------------------------------------------------------------------------------


def forward_plan(cfg: SoftmaxConfig, x: torch.Tensor, out: torch.Tensor | None, dim: int, log: bool):
    """`plan(cfg, x, out, dim, log) -> y` for softmax / log_softmax on tensors of these layouts."""
    xm, (O, I, sx_o, sx_i, sx_n), copy = input_rows(x, dim)
    ym, (_, _, sy_o, sy_i, sy_n), direct, dense = output_rows(out, xm, dim, x.shape, x.dtype, "softmax")
    N, R = xm.shape[-1], O * I
    strides = (sx_o, sx_i, sx_n, sy_o, sy_i, sy_n)
    step = forward_step(cfg, xm, ym, R, N, I, strides, LOG_SOFTMAX if log else SOFTMAX) if R and N else None

    def plan(cfg: SoftmaxConfig, x: torch.Tensor, out: torch.Tensor | None, dim: int, log: bool) -> torch.Tensor:
        xm = input_view(x, dim, copy)
        ym, target = output_view(out, xm, dim, x.dtype, direct, dense)
        if step is not None:
            step(xm, ym)
        return finish(ym, dim, target)

    return plan


def logsumexp_plan(cfg: SoftmaxConfig, x: torch.Tensor, out: torch.Tensor | None, dim: int):
    """`plan(cfg, x, out, dim) -> lse` for logsumexp on tensors of these layouts."""
    xm, (O, I, sx_o, sx_i, sx_n), copy = input_rows(x, dim)
    N, R = xm.shape[-1], O * I
    shape = xm.shape[:-1]
    if out is not None and (tuple(out.shape) != tuple(shape) or out.dtype != torch.float32
                            or not out.is_contiguous() or out.device != x.device):
        raise ValueError(f"logsumexp: out must be contiguous float32 {tuple(shape)} on {x.device}")
    step = logsumexp_step(cfg, xm, R, N, I, (sx_o, sx_i, sx_n)) if R and N else None

    def plan(cfg: SoftmaxConfig, x: torch.Tensor, out: torch.Tensor | None, dim: int) -> torch.Tensor:
        xm = input_view(x, dim, copy)
        lse = torch.empty(shape, dtype=torch.float32, device=xm.device) if out is None else out
        if step is not None:
            step(xm, lse)
        elif R:  # rows of no element
            lse.fill_(float("-inf"))
        return lse

    return plan


def backward_plan(cfg: SoftmaxConfig, y: torch.Tensor, g: torch.Tensor, out: torch.Tensor | None, dim: int,
                  log: bool):
    """`plan(cfg, y, g, out, dim, log) -> dx` for the softmax backward on tensors of these layouts."""
    ym, (O, I, sy_o, sy_i, sy_n), copy_y = input_rows(y, dim)
    gm, (_, _, sg_o, sg_i, sg_n), copy_g = input_rows(g.to(y.dtype), dim)
    dm, (_, _, sd_o, sd_i, sd_n), direct, dense = output_rows(out, ym, dim, y.shape, y.dtype, "softmax_backward")
    N, R = ym.shape[-1], O * I
    strides = (sy_o, sy_i, sy_n, sg_o, sg_i, sg_n, sd_o, sd_i, sd_n)
    step = backward_step(cfg, ym, gm, dm, R, N, I, strides, log) if R and N else None

    def plan(cfg: SoftmaxConfig, y: torch.Tensor, g: torch.Tensor, out: torch.Tensor | None, dim: int,
             log: bool) -> torch.Tensor:
        ym = input_view(y, dim, copy_y)
        dm, target = output_view(out, ym, dim, y.dtype, direct, dense)
        if step is not None:
            step(ym, input_view(g.to(y.dtype), dim, copy_g), dm)
        return finish(dm, dim, target)

    return plan


def logsumexp_backward_plan(cfg: SoftmaxConfig, x: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
                            out: torch.Tensor | None, dim: int):
    """`plan(cfg, x, lse, g, out, dim) -> dx` for the logsumexp backward on tensors of the layouts of x
    and out (lse and g, whatever their layouts, become contiguous vectors per call)."""
    xm, (O, I, sx_o, sx_i, sx_n), copy = input_rows(x, dim)
    dm, (_, _, sd_o, sd_i, sd_n), direct, dense = output_rows(out, xm, dim, x.shape, x.dtype, "logsumexp_backward")
    N, R = xm.shape[-1], O * I
    go = row_kernels.logsumexp_backward(cfg, R, N, I, (sx_o, sx_i, sx_n, sd_o, sd_i, sd_n), col64(N, sx_n, sd_n))

    def plan(cfg: SoftmaxConfig, x: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, out: torch.Tensor | None,
             dim: int) -> torch.Tensor:
        xm = input_view(x, dim, copy)
        dm, target = output_view(out, xm, dim, x.dtype, direct, dense)
        if R and N:
            go(xm, lse.reshape(R).to(torch.float32).contiguous(), g.reshape(R).contiguous(), dm)
        return finish(dm, dim, target)

    return plan
