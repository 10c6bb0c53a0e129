"""Log-semiring batched matmul in Triton: `out[b,i,j] = logsumexp_k(a[b,i,k] + b[b,k,j])`, with backward.

This is not a tensor-core product: each output is a (max, +, exp, +) reduction over k, so the cost is one
`exp` per `(i, k, j)` triple and the special-function unit (MUFU, 16 exp2 per clock per SM on Hopper) is
the bottleneck. Each program holds an output tile in registers (one row i and 32 columns j per thread)
and walks k one index at a time (a column of `a`, a row of `b`: small vector loads shared by the warp):
- pass 1: the exact max `m[i,j] = max_k a[i,k] + b[k,j]` (add + max, no exp);
- pass 2: `s[i,j] += exp2((a[i,k] + b[k,j]) * log2(e) - m[i,j] * log2(e))` (add, fma, ex2, add).
Knowing the exact max first means no rescaling exps (an online max would add one per element or per
chunk), every exponent is <= 0 (no overflow) and the largest term is 1 (no underflow of the total).
`[B, N, M, P]` is never formed: memory is the inputs, the output and small padded copies.

Backward (`g` = d loss / d out):
    grad_a[i,k] = sum_j exp(a[i,k] + b[k,j] - out[i,j]) * g[i,j]
    grad_b[k,j] = sum_i exp(a[i,k] + b[k,j] - out[i,j]) * g[i,j]
each computed on the same form (grad_b^T has grad_a's form on the transposed problem) by two kernels:
- factored (`_log_bmm_grad_dot_kernel`, problems of >= `dot_min_tiles` tiles): each term is split
  through tile-local maxima into exp(a - max) * exp(b - max) * exp(maxes - out) g, so a tile of the
  gradient is a float32 matmul plus exps along its edges, not one exp per term (H200, 8x1024^3: 2.5 ms
  for both gradients against 5.6 ms exact). Tiles whose shift could exceed `dot_max_shift` nats (values
  spread over more than that) are flagged and left to the exact kernel;
- exact (`_log_bmm_grad_kernel`): a tile of the gradient in registers walking the summed index, one exp
  per term; exponents are <= 0 because out >= a + b. It runs alone for small problems and, after the
  factored kernel, over the flagged tiles only.
An `out` of -inf (all terms -inf) gives zero terms (never `-inf - -inf` = NaN): such entries get zero
gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ringlse.kernels.host import cdiv, next_power_of_2
from ringlse.lse.kernels.active_config import ActiveConfig

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

@dataclass(frozen=True)
class LogBmmConfig:
    """Tile constants of the launchers: the winners of the tuning sweep in
    benchmarks/results/lse_toolkit-nvidia-h200.json (`CONFIG`)."""

    fwd_warps: int = 4  # a tile is 32 * num_warps rows (one per thread) by 4 * VECS columns
    fwd_vecs: int = 4  # 16-byte vectors of columns per thread
    fwd_unroll: int = 4
    bwd_warps: int = 8
    bwd_vecs: int = 4
    bwd_unroll: int = 4
    # backward through tile-local maxima and a float32 matmul (`_log_bmm_grad_dot_kernel`)
    dot_bx: int = 64
    dot_by: int = 64
    dot_bs: int = 32
    dot_warps: int = 4
    dot_max_shift: float = 64.0
    dot_min_tiles: int = 256  # fewer factored tiles than this (all batches): the exact kernel alone


CONFIG = LogBmmConfig()
_CONFIG = ActiveConfig(CONFIG)
# the config launches use now, and the one test-only way to change it (a context manager)
active_config = _CONFIG.get
config_override = _CONFIG.override


_VEC = 4  # float32 values per 16-byte vector


# ----------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _tile(pid_x, pid_y, XT: tl.constexpr, YR: tl.constexpr, NUM_WARPS: tl.constexpr):
    """Indices of a tile of `32 * NUM_WARPS` x-rows by `4 * YR` y-columns, as 4-D tensors.

    The tile is indexed (xa, yv, xb, yr) with x = xb * 8 + xa and y = yr * 4 + yv: x is contiguous along
    xa and y along yv. Triton's layout pass then gives each thread ONE x and all the y's as YR 16-byte
    vectors (seen in the sm_90 SASS: per step one scalar load for x, YR LDG.128 for y, which the whole
    warp shares). A plain 2-D tile got 32 x's and one y per thread: one load per term.
    """
    xa = tl.arange(0, 8)[:, None, None, None]
    yv = tl.arange(0, 4)[None, :, None, None]
    xb = tl.arange(0, 4 * NUM_WARPS)[None, None, :, None]
    yr = tl.arange(0, YR)[None, None, None, :]
    x = pid_x * (32 * NUM_WARPS) + xb * 8 + xa  # [8, 1, 4 * NUM_WARPS, 1]
    y = pid_y * (4 * YR) + yr * 4 + yv  # [1, 4, 1, YR]
    return x, y


@triton.jit
def _log_bmm_fwd_kernel(
    at_ptr, b_ptr, out_ptr, N, M, P,
    sat_b, sat_k, sb_b, sb_k, so_b, so_n,
    YR: tl.constexpr, NUM_WARPS: tl.constexpr, UNROLL: tl.constexpr,
):
    """out tile: x = i (rows of a), y = j (columns of b). `at` is a k-major copy of a ([B, M, N]);
    b's columns are padded to the tile (so its loads need no mask); out is [B, N, P] contiguous."""
    bid = tl.program_id(2).to(tl.int64)
    i, j = _tile(tl.program_id(0), tl.program_id(1), 8, YR, NUM_WARPS)
    mask_i = i < N
    a_ptrs = at_ptr + bid * sat_b + i
    b_ptrs = b_ptr + bid * sb_b + j
    # Pass 1: exact max over k. Padded rows are -inf; padded columns hold finite filler, never stored.
    m = tl.full([8, 4, 4 * NUM_WARPS, YR], float("-inf"), tl.float32)
    for k in tl.range(0, M, loop_unroll_factor=UNROLL):
        av = tl.load(a_ptrs + k * sat_k, mask=mask_i, other=float("-inf"))
        bv = tl.load(b_ptrs + k * sb_k)
        m = tl.maximum(m, av + bv)
    # An all -inf (i, j) keeps a shift of 0: its terms are exp2(-inf) = 0, its sum 0, its log -inf.
    neg_m2 = tl.where(m == float("-inf"), 0.0, -m * LOG2E)
    # Pass 2: sum of exp2(t * log2e - m * log2e): one add, one fma, one ex2, one add per term, all
    # exponents <= 0, the largest term exactly 1.
    s = tl.zeros([8, 4, 4 * NUM_WARPS, YR], tl.float32)
    for k in tl.range(0, M, loop_unroll_factor=UNROLL):
        av = tl.load(a_ptrs + k * sat_k, mask=mask_i, other=float("-inf"))
        bv = tl.load(b_ptrs + k * sb_k)
        s += tl.exp2((av + bv) * LOG2E + neg_m2)
    out = (tl.log2(s) - neg_m2) * LN2  # log2(0) = -inf for all -inf (i, j)
    tl.store(out_ptr + bid * so_b + i * so_n + j, out, mask=mask_i & (j < P))


@triton.jit
def _neg_out2(o):
    """-out * log2(e), and -inf where out is -inf, so that such terms vanish instead of giving NaN."""
    return tl.where(o == float("-inf"), float("-inf"), -o * LOG2E)


@triton.jit
def _log_bmm_grad_kernel(
    x_ptr, v_ptr, o_ptr, g_ptr, d_ptr, flag_ptr, X, Y, S,
    sx_b, sx_x, sv_b, sv_s, so_b, so_s, sd_b, sd_x, FX, FY,
    YR: tl.constexpr, NUM_WARPS: tl.constexpr, UNROLL: tl.constexpr,
    FLAGS: tl.constexpr = False, DBX: tl.constexpr = 1, DBY: tl.constexpr = 1, FXB: tl.constexpr = 1,
):
    """d[x, y] = sum_s exp(x[x, y] + v[s, y] - o[s, x]) * g[s, x], a tile of d per program.

    grad_a is this with (x, v, o, g) = (a, b^T, out^T, g^T) and (x, y, s) = (i, k, j); grad_b^T is it
    with (b^T, a, out, g) and (x, y, s) = (j, k, i). Either way the per-step loads are a contiguous
    y-vector of v (padded to the tile, so unmasked) and one value of o and g per thread.
    Shapes: x, d [B, X, Y] (unit y stride); v [B, S, Y_pad]; o, g [B, S, X] (unit x stride).
    """
    bid = tl.program_id(2).to(tl.int64)
    todo = tl.full([], 1, tl.int32)
    if FLAGS:
        # only the tiles the factored kernel left (`_log_bmm_grad_dot_kernel`, tiles of DBX x DBY, FX x FY
        # of them per batch) that overlap this program's tile
        x0 = tl.program_id(0) * (32 * NUM_WARPS)
        fx = x0 // DBX + tl.arange(0, FXB)
        fy = tl.program_id(1) * (4 * YR) // DBY
        f = tl.load(flag_ptr + (bid * FY + fy) * FX + fx, mask=(fx < FX) & (fx * DBX < x0 + 32 * NUM_WARPS), other=0)
        todo = tl.max(f, axis=0)
    if todo > 0:
        xi, yi = _tile(tl.program_id(0), tl.program_id(1), 8, YR, NUM_WARPS)
        mask_x = xi < X
        mask = mask_x & (yi < Y)
        xt = tl.load(x_ptr + bid * sx_b + xi * sx_x + yi, mask=mask, other=float("-inf"))
        v_ptrs = v_ptr + bid * sv_b + yi
        o_ptrs = o_ptr + bid * so_b + xi
        g_ptrs = g_ptr + bid * so_b + xi
        acc = tl.zeros([8, 4, 4 * NUM_WARPS, YR], tl.float32)
        for s in tl.range(0, S, loop_unroll_factor=UNROLL):
            vv = tl.load(v_ptrs + s * sv_s)
            ov = tl.load(o_ptrs + s * so_s, mask=mask_x, other=float("inf"))
            gv = tl.load(g_ptrs + s * so_s, mask=mask_x, other=0.0)
            acc += tl.exp2((xt + vv) * LOG2E + _neg_out2(ov)) * gv
        tl.store(d_ptr + bid * sd_b + xi * sd_x + yi, acc, mask=mask)


@triton.jit
def _log_bmm_grad_dot_kernel(
    x_ptr, v_ptr, o_ptr, g_ptr, d_ptr, flag_ptr, X, Y, S,
    sx_b, sx_x, sv_b, sv_s, so_b, so_s, sd_b, sd_x,
    BX: tl.constexpr, BY: tl.constexpr, BS: tl.constexpr, MAX_SHIFT: tl.constexpr,
):
    """`_log_bmm_grad_kernel`'s d, with the exps of each term factored through tile-local maxima.

    For a tile of d (rows x, columns y) and a step of s: with mx[x] = max over the tile's y of x[x, y]
    and mv[s] = max over the tile's y of v[s, y],
        exp(x[x,y] + v[s,y] - o[s,x]) g[s,x] = X'[x,y] V'[s,y] W[s,x],
        X' = exp(x - mx), V' = exp(v - mv) (both <= 1), W = exp(mx + mv - o) g,
    so d = X' * (W^T V'): a float32 matmul plus exps per tile edge instead of one exp per term. Since
    o[s,x] >= x[x,y] + v[s,y] for every y, the exponent of W is at most the spread of x or of v over the
    tile; where it exceeds MAX_SHIFT (natural log units) anywhere in a step, or W is not finite, the tile
    is left to the exact kernel (values spread over hundreds, e.g. log-probabilities x100): its flag in
    `flag_ptr` `[B, tiles y, tiles x]` is set and nothing is stored.
    A product X'V' that underflows stands for a term below exp(MAX_SHIFT - 103) |g|: negligible next to the
    float32 rounding of the sum. -inf entries (log zero) give zero factors; an -inf o gives W = 0.
    """
    bid = tl.program_id(2).to(tl.int64)
    xs = tl.program_id(0) * BX + tl.arange(0, BX)
    ys = tl.program_id(1) * BY + tl.arange(0, BY)
    mask_x = xs < X
    mask_y = ys < Y
    xt = tl.load(x_ptr + bid * sx_b + xs[:, None] * sx_x + ys[None, :], mask=mask_x[:, None] & mask_y[None, :],
                 other=float("-inf"))
    mx = tl.max(xt, axis=1)  # [BX]
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    acc = tl.zeros([BX, BY], tl.float32)  # sum of W V' (times X' at the end)
    ok = tl.full([], 1, tl.int32)
    for s0 in range(0, S, BS):
        if ok == 1:
            ss = s0 + tl.arange(0, BS)
            mask_s = ss < S
            vt = tl.load(v_ptr + bid * sv_b + ss[:, None] * sv_s + ys[None, :],
                         mask=mask_s[:, None] & mask_y[None, :], other=float("-inf"))  # [BS, BY]
            ot = tl.load(o_ptr + bid * so_b + ss[:, None] * so_s + xs[None, :],
                         mask=mask_s[:, None] & mask_x[None, :], other=float("-inf"))  # [BS, BX]
            gt = tl.load(g_ptr + bid * so_b + ss[:, None] * so_s + xs[None, :],
                         mask=mask_s[:, None] & mask_x[None, :], other=0.0)
            mv = tl.max(vt, axis=1)  # [BS]
            mv_safe = tl.where(mv == float("-inf"), 0.0, mv)
            zero = (ot == float("-inf")) | (mv[:, None] == float("-inf")) | (mx[None, :] == float("-inf"))
            e = tl.where(zero, float("-inf"), mx_safe[None, :] + mv_safe[:, None] - ot)  # [BS, BX]
            w = tl.where(zero, 0.0, tl.exp2(e * LOG2E) * gt)
            risky = (e > MAX_SHIFT) | (tl.abs(w) == float("inf")) | (w != w)
            if tl.sum(risky.to(tl.int32)) == 0:
                vp = tl.exp2((vt - mv_safe[:, None]) * LOG2E)  # [BS, BY], 0 for -inf entries
                acc += tl.dot(tl.trans(w), vp, input_precision="ieee")
            else:
                ok = tl.full([], 0, tl.int32)
    if ok == 1:
        d = tl.exp2((xt - mx_safe[:, None]) * LOG2E) * acc
        tl.store(d_ptr + bid * sd_b + xs[:, None] * sd_x + ys[None, :], d, mask=mask_x[:, None] & mask_y[None, :])
    else:
        # the exact kernel redoes this tile (`_log_bmm_grad_kernel` with FLAGS)
        tl.store(flag_ptr + (bid * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0), 1)


# ----------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int, int]:
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"log_bmm: need a [B, N, M] and b [B, M, P], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype not in _DTYPES or b.dtype not in _DTYPES:
        raise TypeError(f"log_bmm: the Triton kernels take float32/float16/bfloat16, got {a.dtype}, {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"log_bmm: a on {a.device}, b on {b.device}")
    B, N, M = a.shape
    P = b.shape[2]
    if (N + 256) * (M + 256) >= 2**31 or (M + 256) * (P + 256) >= 2**31 or (N + 256) * (P + 256) >= 2**31:
        raise ValueError(f"log_bmm: one batch of {tuple(a.shape)} x {tuple(b.shape)} exceeds int32 offsets")
    return B, N, M, P


def _padded_f32(x: torch.Tensor, cols: int) -> torch.Tensor:
    """`x` `[B, R, C]` as contiguous float32 with the last dim padded to `cols` (filler 0: finite, and
    only ever feeds outputs that are not stored). No copy when nothing changes."""
    B, R, C = x.shape
    if cols == C and x.dtype == torch.float32 and x.is_contiguous():
        return x
    out = torch.empty((B, R, cols), dtype=torch.float32, device=x.device)
    out[:, :, :C] = x
    if cols > C:
        out[:, :, C:] = 0.0
    return out


def log_bmm_forward(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`out[b,i,j] = logsumexp_k(a[b,i,k] + b[b,k,j])`, no autograd.

    Args:
        a: `[B, N, M]`, b: `[B, M, P]`; float32/float16/bfloat16 (-inf allowed), computed in float32.
        out: optional float32 contiguous `[B, N, P]` output.

    Returns:
        float32 `[B, N, P]`; -inf where every term is -inf (and everywhere when M = 0).
    """
    B, N, M, P = _check(a, b)
    if out is None:
        out = torch.empty((B, N, P), dtype=torch.float32, device=a.device)
    elif tuple(out.shape) != (B, N, P) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"log_bmm: out must be contiguous float32 {(B, N, P)}, got {out.dtype} {tuple(out.shape)}")
    if out.numel() == 0:
        return out
    if M == 0:
        return out.fill_(float("-inf"))
    cfg = active_config()
    warps, vecs = cfg.fwd_warps, cfg.fwd_vecs
    bx, by = 32 * warps, _VEC * vecs
    # the k loop reads a column of a (a k-major copy makes it contiguous) and a row of b (padded to
    # the tile's columns so that its 16-byte loads need no mask)
    at = a.transpose(1, 2).to(torch.float32).contiguous()
    bp = _padded_f32(b, cdiv(P, by) * by)
    grid = (cdiv(N, bx), cdiv(P, by), B)
    _log_bmm_fwd_kernel[grid](
        at, bp, out, N, M, P, at.stride(0), at.stride(1), bp.stride(0), bp.stride(1), out.stride(0), out.stride(1),
        YR=vecs, NUM_WARPS=warps, UNROLL=cfg.fwd_unroll, num_warps=warps,
    )
    return out


def _grad(x: torch.Tensor, v: torch.Tensor, o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`d[b, x, y] = sum_s exp(x[b, x, y] + v[b, s, y] - o[b, s, x]) * g[b, s, x]`, float32 `[B, X, Y]`."""
    B, X, Y = x.shape
    S = v.shape[1]
    d = torch.empty((B, X, Y), dtype=torch.float32, device=x.device)
    if d.numel() == 0:
        return d
    if S == 0:
        return d.zero_()
    x = x.to(torch.float32).contiguous()
    o = o.to(torch.float32).contiguous()
    g = g.to(torch.float32).contiguous()
    cfg = active_config()
    warps, vecs = cfg.bwd_warps, cfg.bwd_vecs
    bx, by = 32 * warps, _VEC * vecs
    vp = _padded_f32(v, cdiv(Y, by) * by)
    exact = dict(YR=vecs, NUM_WARPS=warps, UNROLL=cfg.bwd_unroll, num_warps=warps)
    grid = (cdiv(X, bx), cdiv(Y, by), B)
    dbx, dby, dbs = cfg.dot_bx, cfg.dot_by, cfg.dot_bs
    fx, fy = cdiv(X, dbx), cdiv(Y, dby)
    # few factored tiles leave most SMs idle, each walking all of S: the exact kernel's narrower tiles
    # spread such problems wider (H200: 2x97x1000x130 0.16 ms exact, 0.41 ms factored over 64 tiles)
    if B * fx * fy < cfg.dot_min_tiles:
        _log_bmm_grad_kernel[grid](
            x, vp, o, g, d, d, X, Y, S, x.stride(0), x.stride(1), vp.stride(0), vp.stride(1), o.stride(0),
            o.stride(1), d.stride(0), d.stride(1), 1, 1, **exact,
        )
        return d
    if dby % by:  # an exact tile must lie in one column of factored tiles (its flag check reads one)
        raise ValueError(f"log_bmm: config dot_by={dby} must be a multiple of the exact tile's {by} columns")
    flags = torch.zeros((B, fy, fx), dtype=torch.int32, device=x.device)
    # the padded copy serves both kernels (the factored one masks columns >= Y itself)
    _log_bmm_grad_dot_kernel[(fx, fy, B)](
        x, vp, o, g, d, flags, X, Y, S, x.stride(0), x.stride(1), vp.stride(0), vp.stride(1), o.stride(0), o.stride(1),
        d.stride(0), d.stride(1), BX=dbx, BY=dby, BS=dbs, MAX_SHIFT=float(cfg.dot_max_shift),
        num_warps=cfg.dot_warps,
    )
    # the tiles it left, exactly (programs over other tiles return at once)
    _log_bmm_grad_kernel[grid](
        x, vp, o, g, d, flags, X, Y, S, x.stride(0), x.stride(1), vp.stride(0), vp.stride(1), o.stride(0),
        o.stride(1), d.stride(0), d.stride(1), fx, fy, **exact, FLAGS=True, DBX=dbx, DBY=dby,
        FXB=next_power_of_2(cdiv(bx, dbx) + 1),
    )
    return d


def log_bmm_backward(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, g: torch.Tensor,
    *, need_a: bool = True, need_b: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of `log_bmm` from its output `out` and the output gradient `g`.

    grad_a[i,k] = sum_j exp(a[i,k] + b[k,j] - out[i,j]) g[i,j], grad_b[k,j] = sum_i (same terms).

    Args:
        a: `[B, N, M]`, b: `[B, M, P]` (the forward inputs); out: float32 `[B, N, P]` (the forward
            output); g: `[B, N, P]` gradient of `out`.
        need_a, need_b: skip a gradient nobody needs.

    Returns:
        `(grad_a, grad_b)`, float32 `[B, N, M]` and `[B, M, P]` (grad_b is a transposed view of a
        `[B, P, M]` buffer), None where not needed; terms whose `out` is -inf contribute 0.
    """
    _check(a, b)
    grad_a = grad_b = None
    if need_a:
        grad_a = _grad(a, b.transpose(1, 2), out.transpose(1, 2), g.transpose(1, 2))
    if need_b:
        grad_b = _grad(b.transpose(1, 2), a, out, g).transpose(1, 2)
    return grad_a, grad_b


# ----------------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------------


class _LogBmmFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = log_bmm_forward(a, b)
        ctx.save_for_backward(a, b, out)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        a, b, out = ctx.saved_tensors
        ga, gb = log_bmm_backward(a, b, out, g, need_a=ctx.needs_input_grad[0], need_b=ctx.needs_input_grad[1])
        return (None if ga is None else ga.to(a.dtype)), (None if gb is None else gb.to(b.dtype))


# ----------------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------------


def log_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Log-semiring batched matmul with autograd: `out[b,i,j] = logsumexp_k(a[b,i,k] + b[b,k,j])`.

    Args:
        a: `[B, N, M]`, b: `[B, M, P]`; float32 (bf16/fp16 accepted, computed in float32); -inf allowed.

    Returns:
        float32 `[B, N, P]`. Entries whose terms are all -inf are -inf and pass zero gradients.
    """
    return _LogBmmFn.apply(a, b)
