"""Triton forward block attention with lse, and an in-kernel merge into running accumulators.

One program owns `BLOCK_M` query rows of one head and walks the key tiles that its rows can see
(FlashAttention-2 order, online softmax in base 2). Causal blocks (CONVENTIONS.md §4: key `j` visible to
query `i` iff `k_start + j <= q_start + i`) split the walk in two: tiles every row of the program sees
entirely run without any mask; only the tiles the causal boundary (or the key tail) crosses pay for
masking; tiles no row sees are never visited. With accumulators the epilogue folds the running state
into the block's own online-softmax state (CONVENTIONS.md §3, `ringlse.kernels.merge_math`), so one
ring step is one kernel.

Interval masks (`key_lo`/`key_hi`, CONVENTIONS.md §10: windows and packed documents at global positions,
causal included): query row `i` sees the keys `[key_lo[i], key_hi[i])`. A program visits the key tiles
from its rows' smallest `key_lo` to their largest `key_hi`; the tiles inside every row's interval run
unmasked, the others (at both ends, in one loop that jumps over the unmasked ones) mask per row. Rows
that see no key of the block ride along through the unmasked tiles and are reset to the empty state at
the end. Behind the `INTERVALS` constexpr: without intervals the kernel compiles as before.

On sm_90 GPUs, bf16/fp16 blocks of head dim 64 or 128, or Q/K 192 with V 128 (interval masks and softcap
included; `attention_fwd_hopper.FWD_HEAD_DIMS`) go to the Gluon kernel of
`attention_fwd_hopper` instead (same contract and numerics, TMA and warp-specialized WGMMA); this kernel
serves everything else and the CPU interpreter.

Precision: bf16/fp16 operands with float32 accumulation. float32 inputs use 3-pass TF32 tensor-core
dots (`input_precision="tf32x3"`): plain TF32 missed CONVENTIONS.md §7's float32 bound (1e-3 * max|ref|).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ringlse.kernels.attention_common import (
    FWD_CHOSEN,
    LOG2E,
    FwdConfig,
    block_d,
    check_accumulator,
    check_dtype,
    check_intervals,
    check_qkv_shapes,
    dot_precision,
    fwd_configs,
    interval_tile_range,
    last_dim_contiguous,
    launch_with_fallback,
    mask_offset,
    query_tile_key_range,
    set_tuned_fwd_config,
    softcap_mode,
    softcap_scores,
    softmax_step,
    tile_visible,
)
from ringlse.kernels.host import cdiv
from ringlse.kernels.merge_math import merge_finish, merge_fold

try:  # the Hopper kernel is Gluon, which Triton before 3.5 does not have
    from ringlse.kernels.attention_fwd_hopper import hopper_forward, hopper_forward_applies
except ImportError:  # pragma: no cover - old Triton
    hopper_forward = hopper_forward_applies = None

# the launcher's tuning knobs live with the backward's in attention_common; benchmarks reach them here
__all__ = ["FwdConfig", "attention_forward", "fwd_configs", "set_tuned_fwd_config"]


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, q,
    k_ptrs, v_ptrs, stride_kn, stride_vn,
    offs_m, offs_d, offs_dv, lo, hi, SK, OFFSET, qk_scale, softcap,
    BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr,
    SOFTCAP: tl.constexpr, row_lo=None, row_hi=None, gap_lo=0, gap=0, INTERVALS: tl.constexpr = False,
):
    """Online softmax over key tiles `[lo, hi)`; `k_ptrs` is a `[BLOCK_D, BLOCK_N]` (transposed) tile
    at key 0, `v_ptrs` a `[BLOCK_N, BLOCK_DV]` tile at key 0. With SOFTCAP the scores are capped
    (`softcap_scores`) before the softmax, which scales them by the cap's scale. With INTERVALS,
    masked tiles keep the keys `[row_lo, row_hi)` of each row (`row_hi <= SK`) instead of the causal
    rule, and the masked walk jumps over `gap` keys at `gap_lo` (the unmasked tiles in the middle): one masked loop serves both
    ends (two masked loops took ~30 more registers per thread at d=64: ptxas, sm_90)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_D
    dv_ok = offs_dv < HEAD_DV
    JUMP: tl.constexpr = INTERVALS and MASKED
    if not JUMP:
        k_ptrs += lo * stride_kn
        v_ptrs += lo * stride_vn
    for step_n in tl.range(lo, hi, BLOCK_N):
        if JUMP:
            start_n = step_n + tl.where(step_n >= gap_lo, gap, 0)
            kt_ptrs = k_ptrs + start_n * stride_kn
            vt_ptrs = v_ptrs + start_n * stride_vn
        else:
            start_n = step_n
            kt_ptrs = k_ptrs
            vt_ptrs = v_ptrs
        offs_n = start_n + offs_n0
        if MASKED:
            n_ok = offs_n < SK
            kt = tl.load(kt_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        elif BLOCK_D != HEAD_D:
            kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
        else:
            kt = tl.load(kt_ptrs)
        qk = tl.dot(q, kt, input_precision=DOT_PREC)
        if SOFTCAP:
            qk, step_scale = softcap_scores(qk, qk_scale, softcap, SOFTCAP)
        else:
            step_scale = qk_scale
        visible = tile_visible(offs_m, offs_n, n_ok, row_lo, row_hi, OFFSET, CAUSAL, INTERVALS) if MASKED else None
        p, m_new, alpha = softmax_step(qk, m_i, step_scale, visible, MASKED, False)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASKED:
            v = tl.load(vt_ptrs, mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
        elif BLOCK_DV != HEAD_DV:
            v = tl.load(vt_ptrs, mask=dv_ok[None, :], other=0.0)
        else:
            v = tl.load(vt_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
        m_i = m_new
        if not JUMP:
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _row_ptrs(Out, Lse, off_b, off_h, offs_m, offs_d, m_ok, d_ok, stride_ob, stride_os, stride_oh,
              stride_lb, stride_lh, stride_ls):
    """Pointers to this program's rows of `Out` and `Lse`, and the mask of `Out`'s tile."""
    o_ptrs = Out + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
    lse_ptrs = Lse + off_b * stride_lb + off_h * stride_lh + offs_m * stride_ls
    return o_ptrs, lse_ptrs, m_ok[:, None] & d_ok[None, :]


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out, Lse,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_ls,
    H, GROUP, SQ, SK, OFFSET, qk_scale, KeyLo, KeyHi, softcap, Sinks,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, ACCUM: tl.constexpr, DOT_PREC: tl.constexpr, INTERVALS: tl.constexpr,
    HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, SOFTCAP: tl.constexpr, SINK: tl.constexpr,
):
    """Grid `(cdiv(SQ, BLOCK_M), B * H)`. `qk_scale` = softmax_scale * log2(e); Q/K have head dim HEAD_D,
    V/Out HEAD_DV; SOFTCAP (`softcap_mode`) caps the scores at `softcap`. With ACCUM, `Out`/`Lse`
    are the float32 running state, read and merged in place; otherwise fresh outputs. With INTERVALS
    (then not CAUSAL), query `i` sees the keys `[KeyLo[i], KeyHi[i])` (int32 `[SQ]`); otherwise
    KeyLo/KeyHi are None. With SINK, `Sinks` (float32 `[H]`) are folded into every row's state once, as a
    state of output 0 and lse `Sinks[head]` (`ringlse.sinks`)."""
    num_m = tl.num_programs(0)
    pid_m = tl.program_id(0)
    if CAUSAL or INTERVALS:
        # the last query tiles see the most keys: start them first so the short ones fill the tail
        pid_m = num_m - 1 - pid_m
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = pid_bh % H
    off_hk = (off_h // GROUP).to(tl.int64)
    off_h = off_h.to(tl.int64)

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < SQ
    d_ok = offs_d < HEAD_D
    dv_ok = offs_dv < HEAD_DV

    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    k_ptrs = K + off_b * stride_kb + off_hk * stride_kh + tl.arange(0, BLOCK_N)[None, :] * stride_ks + offs_d[:, None]
    v_ptrs = V + off_b * stride_vb + off_hk * stride_vh + tl.arange(0, BLOCK_N)[:, None] * stride_vs + offs_dv[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    if INTERVALS:
        # key tiles [n_lo, n_full_lo) and [n_full_hi, n_hi) are masked, [n_full_lo, n_full_hi) are seen
        # whole by every row with keys; rows without keys ride along unmasked and are dropped below
        row_lo, row_hi, n_lo, n_full_lo, n_full_hi, n_hi = interval_tile_range(
            KeyLo, KeyHi, offs_m, m_ok, SK, BLOCK_N)
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_ks, stride_vs, offs_m, offs_d, offs_dv, n_full_lo, n_full_hi, SK,
            OFFSET, qk_scale, softcap, BLOCK_N, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, False, False, DOT_PREC, SOFTCAP,
            row_lo, row_hi, 0, 0, True,
        )
        # both masked ends in one loop: [n_lo, n_full_lo), then a jump over the unmasked tiles
        gap = n_full_hi - n_full_lo
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_ks, stride_vs, offs_m, offs_d, offs_dv, n_lo, n_hi - gap, SK,
            OFFSET, qk_scale, softcap, BLOCK_N, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, False, True, DOT_PREC, SOFTCAP,
            row_lo, row_hi, n_full_lo, gap, True,
        )
        # rows that see no key of this block: the empty state (-inf, 0, 0), whatever they computed
        # (`live` recomputed here rather than kept from the range: 7 registers fewer at d=64, sm_90)
        live = row_lo < row_hi
        m_i = tl.where(live, m_i, float("-inf"))
        l_i = tl.where(live, l_i, 0.0)
        acc = tl.where(live[:, None], acc, 0.0)
    else:
        # key tiles [0, n_full) need no mask; [n_full, n_hi) are cut by the causal boundary or the key tail
        n_full, n_hi = query_tile_key_range(m0, SK, OFFSET, BLOCK_M, BLOCK_N, CAUSAL)
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_ks, stride_vs, offs_m, offs_d, offs_dv, 0, n_full, SK, OFFSET,
            qk_scale, softcap, BLOCK_N, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, CAUSAL, False, DOT_PREC, SOFTCAP,
        )
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_ks, stride_vs, offs_m, offs_d, offs_dv, n_full, n_hi, SK, OFFSET,
            qk_scale, softcap, BLOCK_N, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, CAUSAL, True, DOT_PREC, SOFTCAP,
        )

    if ACCUM:
        # the running state (lse in base e) is one more state to fold into this block's (m_i, l_i, acc)
        o_ptrs, lse_ptrs, o_mask = _row_ptrs(Out, Lse, off_b, off_h, offs_m, offs_dv, m_ok, dv_ok,
                                             stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls)
        old2 = tl.load(lse_ptrs, mask=m_ok, other=float("-inf")) * 1.4426950408889634
        o_old = tl.load(o_ptrs, mask=o_mask, other=0.0)
        m_i, l_i, acc = merge_fold(m_i, l_i, acc, old2, o_old, True)
    if SINK:
        sink2 = tl.load(Sinks + off_h + offs_m * 0) * 1.4426950408889634
        m_i, l_i, acc = merge_fold(m_i, l_i, acc, sink2, tl.zeros_like(acc), True)
    # rows that saw nothing: (0, -inf), never 0/0
    lse2, out = merge_finish(m_i, l_i, acc, True)
    # (the same pointers as above under ACCUM; computed here, after the math, the plain forward's code
    # stays as it was before the merge math was shared)
    o_ptrs, lse_ptrs, o_mask = _row_ptrs(Out, Lse, off_b, off_h, offs_m, offs_dv, m_ok, dv_ok,
                                         stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=o_mask)
    tl.store(lse_ptrs, lse2 * 0.6931471805599453, mask=m_ok)


# ---------------------------------------------------------------------------------------------------
# launcher


def check_state(out_acc: torch.Tensor, lse_acc: torch.Tensor, q: torch.Tensor, what: str, d_v: int | None = None
                ) -> None:
    """The running state of `q`'s rows: out `[b, sq, h, d_v]` (d_v: q's head dim unless given), lse `[b, h, sq]`."""
    b, sq, h, d = q.shape
    check_accumulator(out_acc, (b, sq, h, d if d_v is None else d_v), q.device, what, "out_acc")
    if tuple(lse_acc.shape) != (b, h, sq) or lse_acc.dtype != torch.float32 or lse_acc.device != q.device:
        raise ValueError(
            f"{what}: lse_acc must be float32 {(b, h, sq)} on {q.device}, got {lse_acc.dtype} "
            f"{tuple(lse_acc.shape)} on {lse_acc.device}"
        )


def _forward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    offset: int,
    accum: bool,
    config: FwdConfig | None = None,
    key_lo: torch.Tensor | None = None,
    key_hi: torch.Tensor | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """Launch the forward kernel writing (or merging into, with `accum`) `out`/`lse` (the Hopper kernel
    where it applies, unless a `config` for this one is given). The caller has
    validated the arguments, made `softmax_scale >= 0` and `offset` a 32-bit `mask_offset`, and
    `sq, sk > 0`; with `key_lo`/`key_hi` (contiguous int32 `[sq]`), `causal` is False; `softcap >= 0`
    (0: none); `sinks` (float32 contiguous `[h]`, not with `accum`) are folded into the state written."""
    b, sq, h, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    bd = block_d(d)
    qk_scale = softmax_scale * LOG2E
    intervals = key_lo is not None
    cap_mode = softcap_mode(softcap, q.dtype, "attention_forward")

    def launch(cfg: FwdConfig) -> None:
        grid = (cdiv(sq, cfg.block_m), b * h)
        _attn_fwd_kernel[grid](
            q, k, v, out, lse,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1), lse.stride(2),
            h, h // hkv, sq, sk, offset, qk_scale, key_lo, key_hi, float(softcap), lse if sinks is None else sinks,
            HEAD_D=d, BLOCK_D=bd, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            CAUSAL=causal, ACCUM=accum, DOT_PREC=dot_precision(q.dtype), INTERVALS=intervals,
            HEAD_DV=dv, BLOCK_DV=block_d(dv), SOFTCAP=cap_mode, SINK=sinks is not None,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    if config is not None:
        launch(config)
        return
    if hopper_forward_applies is not None and hopper_forward_applies(q, k, v, softcap=softcap):
        # sm_90, bf16/fp16, head dims of FWD_HEAD_DIMS: the Gluon kernel (TMA, warp-specialized WGMMA), 1.2-1.3x
        # this one's speed on H200
        hopper_forward(q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal, offset=offset, accum=accum,
                       key_lo=key_lo, key_hi=key_hi, softcap=softcap, sinks=sinks)
        return
    key = (d, q.dtype, causal, accum, q.device.index, intervals, dv, cap_mode)
    # interval masks take the causal configs (masked tiles at the edges, like a causal block); the tiles
    # are sized for the larger of the two head dims
    launch_with_fallback(FWD_CHOSEN, key, fwd_configs(max(d, dv), q.dtype, causal or intervals), launch)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    q_start: int,
    k_start: int,
    out_acc: torch.Tensor | None = None,
    lse_acc: torch.Tensor | None = None,
    key_lo: torch.Tensor | None = None,
    key_hi: torch.Tensor | None = None,
    fresh: bool = False,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block attention forward (the forward of the block-op contract, `ringlse.blocks.contract`).

    The caller classifies the block (CONVENTIONS.md §4): it passes only blocks in which some query
    sees some key, with `causal=True` only where the causal boundary crosses the block. Still correct
    (just not the fastest) when given `causal=True` for a block every query sees entirely: the result
    is the same, bit for bit, as with `causal=False`. A causal block in which no query sees any key
    must not be passed; it still comes out right, at the cost of a launch: every row is `(0, -inf)`,
    i.e. the accumulators keep their values up to a rounding (the merge runs in base 2, and on the GPU
    divides by the weight 1 approximately), with rows whose running lse is `-inf` set to the canonical
    `(0, -inf)`. Zero-length q or k launch
    nothing: `(0, -inf)` rows, or the accumulators untouched.

    Args:
        q: `[b, sq, h, d]`; k: `[b, sk, hkv, d]`, v: `[b, sk, hkv, d_v]` (V's head dim may differ, e.g.
            MLA's 192 / 128; out has d_v) with `h % hkv == 0` (GQA by indexing, K/V never
            repeated); bf16, fp16 or fp32 (fp32 dots in 3-pass TF32); any strides, last dim contiguous
            preferred (copied otherwise). `d, d_v <= 256` (non powers of two are padded in registers).
        softmax_scale: multiplies `q @ k^T` (any sign).
        causal: mask key `j` unless `k_start + j <= q_start + i` (query `i`).
        q_start, k_start: global positions of query 0 and key 0 (any integers); only their difference
            matters, and only with `causal`.
        key_lo, key_hi: optional int32 `[sq]` on q's device, both or neither: an interval mask
            (CONVENTIONS.md §10: causal, sliding windows, packed documents): query `i` sees exactly the
            keys `j` with `key_lo[i] <= j < key_hi[i]` (local indices; none where `key_lo[i] >=
            key_hi[i]`; bounds outside `[0, sk]` are clamped to it). Then `causal` must be False (the
            intervals hold the causal rule) and `q_start`/`k_start` are ignored. Over the rows with a
            non-empty interval both bounds should be non-decreasing in `i` (any bounds give the right
            result; monotone ones keep the masked tiles to the edges of each query tile). Key tiles no
            row of a query tile sees outside `[min key_lo, max key_hi)` of its rows are not visited;
            tiles every row with keys sees whole run unmasked.
        softcap: scores become `softcap * tanh(scale * q.k / softcap)` before the softmax (the lse is over
            the capped scores, so blocks merge exactly); 0 (the default) turns it off.
        out_acc: optional float32 `[b, sq, h, d_v]` running output (may be a strided view, last dim
            contiguous).
        lse_acc: optional float32 `[b, h, sq]` running lse (natural log; any strides).
        fresh: with accumulators, they hold nothing yet: their contents are not read (garbage, NaN
            allowed) and every row is written, the block's state in float32 (rows that see no key get
            `(0, -inf)`). The first block of a row range then costs what a plain forward costs, not a
            read of zeros and a merge.
        sinks: optional `[h]` (any float dtype) learnable attention sinks, without accumulators: folded
            into every row's state in the epilogue (`ringlse.sinks`; the lse includes them, rows that
            see no key get `out = 0`, `lse = sinks[head]`).

    Returns:
        Without accumulators: `(out, lse)`, `out` `[b, sq, h, d_v]` in q's dtype and `lse` `[b, h, sq]`
        float32 natural log; rows that see no key get `out = 0`, `lse = -inf`. With accumulators: the
        block is merged into them in the kernel epilogue (CONVENTIONS.md §3, `-inf`-safe), or with
        `fresh` written into them, and they are returned.

    Raises:
        ValueError: float64 or other unsupported dtypes, mismatched shapes, bad accumulators, bad
            intervals or intervals with `causal=True`.
    """
    check_dtype(q, "attention_forward")
    check_qkv_shapes(q, k, v, "attention_forward")
    if (out_acc is None) != (lse_acc is None):
        raise ValueError("attention_forward: pass both out_acc and lse_acc, or neither")
    b, sq, h, d = q.shape
    sk = k.shape[1]
    if (key_lo is None) != (key_hi is None):
        raise ValueError("attention_forward: pass both key_lo and key_hi, or neither")
    if key_lo is not None:
        if causal:
            raise ValueError("attention_forward: key_lo/key_hi already hold the causal rule; pass causal=False")
        key_lo, key_hi = check_intervals(key_lo, key_hi, sq, q.device, "attention_forward", "key_lo/key_hi")
    accum = out_acc is not None and not fresh
    if out_acc is not None:
        check_state(out_acc, lse_acc, q, "attention_forward", v.shape[3])
    softcap_mode(softcap, q.dtype, "attention_forward")
    if sinks is not None:
        if out_acc is not None:
            raise ValueError("attention_forward: sinks are folded into a finished state, not into accumulators")
        if tuple(sinks.shape) != (h,) or sinks.device != q.device:
            raise ValueError(f"attention_forward: sinks must be [{h}] on {q.device}, got {tuple(sinks.shape)} "
                             f"on {sinks.device}")
        sinks = sinks.detach().to(torch.float32).contiguous()
    if b * h * sq == 0 or sk == 0:
        # nothing to launch: no rows, or rows that see no key, whose state (0, -inf) merges to nothing
        if out_acc is not None:
            if fresh:
                out_acc.zero_()
                lse_acc.fill_(float("-inf"))
            return out_acc, lse_acc
        out = torch.zeros_like(q) if v.shape[3] == d else q.new_zeros((b, sq, h, v.shape[3]))
        if sinks is not None:  # rows that see no key: (0, sink)
            return out, sinks[None, :, None].expand(b, h, sq).contiguous()
        return out, torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    scale = float(softmax_scale)
    if scale < 0:
        # the kernel folds the scale into a max taken before scaling, which needs scale >= 0;
        # (-q) . k * |s| is exactly q . k * s
        q, scale = -q, -scale
    if out_acc is not None:
        # merged into, or (fresh) written as a plain forward writes its output, in float32
        out, lse = out_acc, lse_acc
    else:
        # (q's layout where the head dims agree, as before V could have its own)
        out = torch.empty_like(q) if v.shape[3] == d else q.new_empty((b, sq, h, v.shape[3]))
        lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    _forward_impl(
        q, k, v, out, lse, softmax_scale=scale, causal=causal,
        offset=mask_offset(causal, sq, sk, q_start, k_start), accum=accum, key_lo=key_lo, key_hi=key_hi,
        softcap=softcap, sinks=sinks,
    )
    return out, lse
