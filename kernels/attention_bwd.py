"""Triton backward block attention: `delta = rowsum(dout * out)`, then dk/dv and dq kernels.

Both gradient kernels recompute `P = exp(S - lse)` from the *global* lse (the ring reuses it for every
block), so a block's gradients are its exact share of the full attention's gradients:
    dV += P^T dO,   dS = P * (dO V^T - delta),   dQ += scale * dS K,   dK += scale * dS^T Q.
- dk/dv: one program per key tile of one kv head; it loops over the query heads of its GQA group and
  the query tiles that can see its keys, so it owns its dk/dv tile (no atomics, deterministic).
- dq: one program per query tile of one head, walking the key tiles like the forward.
Both split their loops like the forward: tiles entirely inside the causal boundary run unmasked; only
the boundary tiles mask; invisible tiles are never visited. Rows whose lse is -inf (they see no key
anywhere) get P = 0 by treating their lse as +inf. Results are added into float32 accumulators.
On sm_90 GPUs, bf16/fp16 blocks of head dim 64 or 128 (softcap included; V with Q/K's head dim) take the
Gluon dk/dv kernel of
`attention_bwd_hopper` (same contract and numerics, interval masks included); dq stays this module's kernel.
Interval masks: the dq kernel walks `key_lo`/`key_hi` as the forward does, the dk/dv kernel the inverse
intervals `query_lo`/`query_hi` (the queries that see each key) the same way; rows (keys) that see
nothing ride along through the unmasked tiles and their gradients are set to exactly 0 at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ringlse.kernels.attention_common import (
    DKDV_CHOSEN,
    DQ_CHOSEN,
    LOG2E,
    BwdConfig,
    block_d,
    bwd_configs,
    check_accumulator,
    check_dtype,
    check_intervals,
    check_qkv_shapes,
    dot_precision,
    interval_tile_range,
    key_tile_query_range,
    last_dim_contiguous,
    launch_with_fallback,
    mask_offset,
    query_tile_key_range,
    set_tuned_bwd_config,
    softcap_mode,
    softcap_scores,
    tile_visible,
)
try:  # the Hopper dk/dv kernel is Gluon, which Triton before 3.5 does not have
    from ringlse.kernels.attention_bwd_hopper import hopper_dkdv, hopper_dkdv_applies, hopper_fuses_dq
except ImportError:  # pragma: no cover - old Triton
    hopper_dkdv = hopper_dkdv_applies = hopper_fuses_dq = None
from ringlse.kernels.host import cdiv, device_capability, interpreting, tma_indexable
from ringlse.kernels.launch import launch

try:  # host-side TMA descriptors (Triton 3.4 on); without them dq is added by a load, add and store
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - old Triton
    TensorDescriptor = None

# the launchers' tuning knobs live with the forward's in attention_common; benchmarks reach them here
__all__ = ["BwdConfig", "attention_backward", "attention_delta", "bwd_configs", "set_tuned_bwd_config"]


@triton.jit
def _delta_kernel(
    DO, O, Delta,
    stride_dob, stride_dos, stride_doh,
    stride_ob, stride_os, stride_oh,
    H, SQ,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Grid `(cdiv(SQ, BLOCK_M), B * H)`; Delta is a contiguous `[B, H, SQ]` float32."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < SQ)[:, None] & (offs_d < HEAD_D)[None, :]
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :],
                 mask=mask, other=0.0)
    o = tl.load(O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
                mask=mask, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    tl.store(Delta + pid_bh.to(tl.int64) * SQ + offs_m, delta, mask=offs_m < SQ)


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v,
    q_ptrs, do_ptrs, lse_ptr, delta_ptr, stride_qm, stride_dom, stride_lm,
    offs_n, lo, hi, SQ, OFFSET, qk_scale, softcap,
    BLOCK_M: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_DV: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr, SOFTCAP: tl.constexpr,
    col_lo=None, col_hi=None, gap_lo=0, gap=0, INTERVALS: tl.constexpr = False,
):
    """Accumulate one query head's query tiles `[lo, hi)` into this key tile's dk/dv (transposed
    formulation: `[BLOCK_N, BLOCK_M]` score tiles, so nothing but the loaded tiles gets transposed).
    `q_ptrs` is a `[BLOCK_D, BLOCK_M]` (transposed) tile at query 0, `do_ptrs` `[BLOCK_M, BLOCK_DV]`.
    With SOFTCAP, P comes from the capped scores and dS takes the cap's derivative `1 - tanh**2`.
    With INTERVALS, masked tiles keep for each key the queries `[col_lo, col_hi)` that see it instead of
    the causal rule, and the masked walk jumps over `gap` queries at `gap_lo` (see `_fwd_tiles`)."""
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    dv_ok = tl.arange(0, BLOCK_DV) < HEAD_DV
    JUMP: tl.constexpr = INTERVALS and MASKED
    if not JUMP:
        q_ptrs += lo * stride_qm
        do_ptrs += lo * stride_dom
    for step_m in tl.range(lo, hi, BLOCK_M):
        if JUMP:
            start_m = step_m + tl.where(step_m >= gap_lo, gap, 0)
            qt_ptrs = q_ptrs + start_m * stride_qm
            dot_ptrs = do_ptrs + start_m * stride_dom
        else:
            start_m = step_m
            qt_ptrs = q_ptrs
            dot_ptrs = do_ptrs
        offs_m = start_m + offs_m0
        m_ok = offs_m < SQ
        qt = tl.load(qt_ptrs, mask=m_ok[None, :] & d_ok[:, None], other=0.0)
        # rows past SQ and rows that see nothing anywhere (lse -inf): lse -> +inf makes P exactly 0
        lse = tl.load(lse_ptr + offs_m * stride_lm, mask=m_ok, other=float("-inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        st = tl.dot(k, qt, input_precision=DOT_PREC)
        if SOFTCAP:
            tt, cap_scale = softcap_scores(st, qk_scale, softcap, SOFTCAP)
            pt = tl.math.exp2(tt * cap_scale - lse2[None, :])
        else:
            pt = tl.math.exp2(st * qk_scale - lse2[None, :])
        if MASKED:
            if INTERVALS:
                pt = tl.where((offs_m[None, :] >= col_lo[:, None]) & (offs_m[None, :] < col_hi[:, None]), pt, 0.0)
            else:
                pt = tl.where(offs_n[:, None] <= offs_m[None, :] + OFFSET, pt, 0.0)
        do = tl.load(dot_ptrs, mask=m_ok[:, None] & dv_ok[None, :], other=0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PREC)
        if SOFTCAP:
            # dS through the cap: P^T times its derivative, once P^T has gone into dV
            pt = pt * (1.0 - tt * tt)
        delta = tl.load(delta_ptr + offs_m * stride_lm, mask=m_ok, other=0.0)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=DOT_PREC)
        if not JUMP:
            q_ptrs += BLOCK_M * stride_qm
            do_ptrs += BLOCK_M * stride_dom
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_lb, stride_lh, stride_ls,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    HKV, GROUP, SQ, SK, OFFSET, qk_scale, dk_scale, QueryLo, QueryHi, softcap,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
    INTERVALS: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Grid `(cdiv(SK, BLOCK_N), B * HKV)`. Delta shares Lse's strides (both `[B, H, SQ]`). With
    INTERVALS (then not CAUSAL), key `j` is seen by the queries `[QueryLo[j], QueryHi[j])` (int32
    `[SK]`); otherwise QueryLo/QueryHi are None."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // HKV).to(tl.int64)
    off_hk = (pid_bh % HKV).to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    kv_mask = (offs_n < SK)[:, None] & (offs_d < HEAD_D)[None, :]
    v_mask = (offs_n < SK)[:, None] & (offs_dv < HEAD_DV)[None, :]
    k = tl.load(K + off_b * stride_kb + off_hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(V + off_b * stride_vb + off_hk * stride_vh + offs_n[:, None] * stride_vs + offs_dv[None, :],
                mask=v_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    if INTERVALS:
        # query tiles [m_lo, m_full_lo) and [m_full_hi, m_hi) are masked; every query of the tiles
        # [m_full_lo, m_full_hi) sees every key of this tile that any query sees (no mask); keys no
        # query sees ride along unmasked and are dropped below
        col_lo, col_hi, m_lo, m_full_lo, m_full_hi, m_hi = interval_tile_range(
            QueryLo, QueryHi, offs_n, offs_n < SK, SQ, BLOCK_M)
    else:
        m_lo, m_full = key_tile_query_range(n0, SQ, SK, OFFSET, BLOCK_M, BLOCK_N, CAUSAL)

    offs_m0 = tl.arange(0, BLOCK_M)
    for g in range(GROUP):
        off_h = off_hk * GROUP + g
        q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m0[None, :] * stride_qs + offs_d[:, None]
        do_ptrs = DO + off_b * stride_dob + off_h * stride_doh + offs_m0[:, None] * stride_dos + offs_dv[None, :]
        lse_ptr = Lse + off_b * stride_lb + off_h * stride_lh
        delta_ptr = Delta + off_b * stride_lb + off_h * stride_lh
        if INTERVALS:
            dk, dv = _dkdv_tiles(
                dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, stride_qs, stride_dos, stride_ls,
                offs_n, m_full_lo, m_full_hi, SQ, OFFSET, qk_scale, softcap, BLOCK_M, HEAD_D, BLOCK_D, HEAD_DV,
                BLOCK_DV, False, DOT_PREC, SOFTCAP, col_lo, col_hi, 0, 0, True,
            )
            # both masked ends in one loop, jumping over the unmasked tiles (see the forward)
            dk, dv = _dkdv_tiles(
                dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, stride_qs, stride_dos, stride_ls,
                offs_n, m_lo, m_hi - (m_full_hi - m_full_lo), SQ, OFFSET, qk_scale, softcap, BLOCK_M, HEAD_D,
                BLOCK_D, HEAD_DV, BLOCK_DV, True, DOT_PREC, SOFTCAP, col_lo, col_hi, m_full_lo, m_full_hi - m_full_lo,
                True,
            )
        else:
            if CAUSAL:
                dk, dv = _dkdv_tiles(
                    dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, stride_qs, stride_dos, stride_ls,
                    offs_n, m_lo, m_full, SQ, OFFSET, qk_scale, softcap, BLOCK_M, HEAD_D, BLOCK_D, HEAD_DV,
                    BLOCK_DV, True, DOT_PREC, SOFTCAP,
                )
            dk, dv = _dkdv_tiles(
                dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, stride_qs, stride_dos, stride_ls,
                offs_n, m_full, SQ, SQ, OFFSET, qk_scale, softcap, BLOCK_M, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV,
                False, DOT_PREC, SOFTCAP,
            )

    if INTERVALS:
        # keys no query of this block sees: exactly 0, whatever the unmasked tiles made of them
        live = col_lo < col_hi
        dk = tl.where(live[:, None], dk, 0.0)
        dv = tl.where(live[:, None], dv, 0.0)

    # dS was computed for scores already scaled; the chain rule through S = scale * q k^T adds it here
    dk_ptrs = DK + off_b * stride_dkb + off_hk * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :]
    dv_ptrs = DV + off_b * stride_dvb + off_hk * stride_dvh + offs_n[:, None] * stride_dvs + offs_dv[None, :]
    tl.store(dk_ptrs, tl.load(dk_ptrs, mask=kv_mask, other=0.0) + dk * dk_scale, mask=kv_mask)
    tl.store(dv_ptrs, tl.load(dv_ptrs, mask=v_mask, other=0.0) + dv, mask=v_mask)


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, delta,
    k_ptrs, v_ptrs, stride_kn, stride_vn,
    offs_m, lo, hi, SK, OFFSET, qk_scale, softcap,
    BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr,
    SOFTCAP: tl.constexpr, row_lo=None, row_hi=None, gap_lo=0, gap=0, INTERVALS: tl.constexpr = False,
):
    """Accumulate key tiles `[lo, hi)` into this query tile's dq. `k_ptrs` is a `[BLOCK_N, BLOCK_D]`
    tile at key 0 and `v_ptrs` a `[BLOCK_DV, BLOCK_N]` (transposed) one; SOFTCAP as in `_dkdv_tiles`.
    With INTERVALS, masked tiles keep the keys `[row_lo, row_hi)` of each row (`row_hi <= SK`) instead of
    the causal rule, and the masked walk jumps over `gap` keys at `gap_lo` (see `_fwd_tiles`)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    dv_ok = tl.arange(0, BLOCK_DV) < HEAD_DV
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
            k = tl.load(kt_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            vt = tl.load(vt_ptrs, mask=n_ok[None, :] & dv_ok[:, None], other=0.0)
        else:
            if BLOCK_D != HEAD_D:
                k = tl.load(kt_ptrs, mask=d_ok[None, :], other=0.0)
            else:
                k = tl.load(kt_ptrs)
            if BLOCK_DV != HEAD_DV:
                vt = tl.load(vt_ptrs, mask=dv_ok[:, None], other=0.0)
            else:
                vt = tl.load(vt_ptrs)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        if SOFTCAP:
            t, cap_scale = softcap_scores(s, qk_scale, softcap, SOFTCAP)
            p = tl.math.exp2(t * cap_scale - lse2[:, None])
        else:
            p = tl.math.exp2(s * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where(tile_visible(offs_m, offs_n, n_ok, row_lo, row_hi, OFFSET, CAUSAL, INTERVALS), p, 0.0)
        if SOFTCAP:
            # dS through the cap: P times its derivative
            p = p * (1.0 - t * t)
        dp = tl.dot(do, vt, input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
        if not JUMP:
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_lb, stride_lh, stride_ls,
    stride_dqb, stride_dqs, stride_dqh,
    H, GROUP, SQ, SK, OFFSET, qk_scale, dq_scale, KeyLo, KeyHi, softcap,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
    INTERVALS: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, SOFTCAP: tl.constexpr,
    REDUCE: tl.constexpr = False,
):
    """Grid `(cdiv(SQ, BLOCK_M), B * H)`. KeyLo/KeyHi: as in the forward (None without INTERVALS). With
    REDUCE, DQ is a tensor descriptor over `[B * SQ, H * HEAD_D]` (block `[BLOCK_M, HEAD_D]`) that the
    tile is added into by TMA."""
    num_m = tl.num_programs(0)
    pid_m = tl.program_id(0)
    if CAUSAL or INTERVALS:
        pid_m = num_m - 1 - pid_m  # longest rows first (see the forward)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = pid_bh % H
    off_hk = (off_h // GROUP).to(tl.int64)
    off_h = off_h.to(tl.int64)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < SQ
    offs_dv = tl.arange(0, BLOCK_DV)
    md_mask = m_ok[:, None] & (offs_d < HEAD_D)[None, :]
    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=md_mask, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dos + offs_dv[None, :],
                 mask=m_ok[:, None] & (offs_dv < HEAD_DV)[None, :], other=0.0)
    lse = tl.load(Lse + off_b * stride_lb + off_h * stride_lh + offs_m * stride_ls, mask=m_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(Delta + off_b * stride_lb + off_h * stride_lh + offs_m * stride_ls, mask=m_ok, other=0.0)

    k_ptrs = K + off_b * stride_kb + off_hk * stride_kh + tl.arange(0, BLOCK_N)[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = V + off_b * stride_vb + off_hk * stride_vh + tl.arange(0, BLOCK_N)[None, :] * stride_vs + offs_dv[:, None]
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if INTERVALS:
        # the forward's walk; rows that see no key of this block ride along unmasked and are dropped
        row_lo, row_hi, n_lo, n_full_lo, n_full_hi, n_hi = interval_tile_range(
            KeyLo, KeyHi, offs_m, m_ok, SK, BLOCK_N)
        dq = _dq_tiles(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_ks, stride_vs, offs_m, n_full_lo, n_full_hi,
                       SK, OFFSET, qk_scale, softcap, BLOCK_N, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, False, False,
                       DOT_PREC, SOFTCAP, row_lo, row_hi, 0, 0, True)
        gap = n_full_hi - n_full_lo
        dq = _dq_tiles(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_ks, stride_vs, offs_m, n_lo, n_hi - gap, SK,
                       OFFSET, qk_scale, softcap, BLOCK_N, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, False, True, DOT_PREC,
                       SOFTCAP, row_lo, row_hi, n_full_lo, gap, True)
        dq = tl.where((row_lo < row_hi)[:, None], dq, 0.0)
    else:
        n_full, n_hi = query_tile_key_range(m0, SK, OFFSET, BLOCK_M, BLOCK_N, CAUSAL)
        dq = _dq_tiles(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_ks, stride_vs, offs_m, 0, n_full, SK, OFFSET,
                       qk_scale, softcap, BLOCK_N, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, CAUSAL, False, DOT_PREC, SOFTCAP)
        dq = _dq_tiles(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_ks, stride_vs, offs_m, n_full, n_hi, SK,
                       OFFSET, qk_scale, softcap, BLOCK_N, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, CAUSAL, True, DOT_PREC,
                       SOFTCAP)

    if REDUCE:
        DQ.atomic_add([(off_b * SQ + m0).to(tl.int32), (off_h * HEAD_D).to(tl.int32)], dq * dq_scale)
    else:
        dq_ptrs = DQ + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :]
        tl.store(dq_ptrs, tl.load(dq_ptrs, mask=md_mask, other=0.0) + dq * dq_scale, mask=md_mask)


# ---------------------------------------------------------------------------------------------------
# launchers


def dq_through_tma(dq_acc: torch.Tensor, block_m: int) -> bool:
    """Whether the dq kernel adds its tiles into `dq_acc` (float32 `[b, sq, h, d]`) by a TMA reduce-add:
    on sm_90 (where it was measured: 4-14% faster on windows and packed documents, the same on dense
    blocks, H200), head dims 16-128 that are powers of two (the tile is the whole row;
    at 256 its staging tile would not fit beside the loads), rows TMA can index, and no partial last query
    tile with a next batch element behind it (TMA clips only at the end of the `[b * sq]` rows). One add
    per element either way: deterministic."""
    b, sq, _, d = dq_acc.shape
    return (TensorDescriptor is not None and dq_acc.is_cuda and not interpreting()
            and device_capability(dq_acc.device.index) == (9, 0) and d == block_d(d) and d <= 128
            and (b == 1 or sq % block_m == 0) and tma_indexable(dq_acc))


def _delta_impl(dout: torch.Tensor, out: torch.Tensor, delta: torch.Tensor) -> None:
    """Launch the delta kernel into the contiguous `[b, h, s]` float32 `delta` (not empty)."""
    b, s, h, d = out.shape
    block_m = 32 if interpreting() else 64
    grid = (cdiv(s, block_m), b * h)
    launch(
        _delta_kernel, grid, dout, out, delta,
        dout.stride(0), dout.stride(1), dout.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        h, s, HEAD_D=d, BLOCK_D=block_d(d), BLOCK_M=block_m, num_warps=4,
    )


def _backward_impl(
    dout, q, k, v, lse, delta, dq_acc, dk_acc, dv_acc, *,
    qk_scale: float, dq_scale: float, dk_scale: float, causal: bool, offset: int,
    config: BwdConfig | None = None,
    key_lo: torch.Tensor | None = None, key_hi: torch.Tensor | None = None,
    query_lo: torch.Tensor | None = None, query_hi: torch.Tensor | None = None,
    dq_reduce: bool | None = None,
    softcap: float = 0.0,
) -> None:
    """Launch the dk/dv and dq kernels. `delta` must have `lse`'s strides, `offset` be a 32-bit
    `mask_offset`, `qk_scale >= 0` and `sq, sk > 0`; with intervals (all four, contiguous int32, see
    `attention_backward`), `causal` is False. `dq_reduce` (benchmarks only): add dq's tiles through TMA
    or by a load, add and store; None: TMA where `dq_through_tma` says so. `softcap >= 0` (0: none)."""
    b, sq, h, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    bd, bdv = block_d(d), block_d(dv)
    intervals = key_lo is not None
    cap_mode = softcap_mode(softcap, q.dtype, "attention_backward")

    def launch_dkdv(cfg: BwdConfig) -> None:
        grid = (cdiv(sk, cfg.kv_block_n), b * hkv)
        _attn_bwd_dkdv_kernel[grid](
            q, k, v, dout, lse, delta, dk_acc, dv_acc,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2),
            lse.stride(0), lse.stride(1), lse.stride(2),
            dk_acc.stride(0), dk_acc.stride(1), dk_acc.stride(2),
            dv_acc.stride(0), dv_acc.stride(1), dv_acc.stride(2),
            hkv, h // hkv, sq, sk, offset, qk_scale, dk_scale, query_lo, query_hi, float(softcap),
            HEAD_D=d, BLOCK_D=bd, BLOCK_M=cfg.kv_block_m, BLOCK_N=cfg.kv_block_n, CAUSAL=causal,
            DOT_PREC=dot_precision(q.dtype), INTERVALS=intervals, HEAD_DV=dv, BLOCK_DV=bdv, SOFTCAP=cap_mode,
            num_warps=cfg.kv_warps, num_stages=cfg.kv_stages,
        )

    def launch_dq(cfg: BwdConfig) -> None:
        grid = (cdiv(sq, cfg.q_block_m), b * h)
        reduce = dq_through_tma(dq_acc, cfg.q_block_m) if dq_reduce is None else dq_reduce
        dq_arg = dq_acc
        if reduce:
            dq_arg = TensorDescriptor(dq_acc, [b * sq, h * d], [dq_acc.stride(1), 1], [cfg.q_block_m, d])
        _attn_bwd_dq_kernel[grid](
            q, k, v, dout, lse, delta, dq_arg,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2),
            lse.stride(0), lse.stride(1), lse.stride(2),
            dq_acc.stride(0), dq_acc.stride(1), dq_acc.stride(2),
            h, h // hkv, sq, sk, offset, qk_scale, dq_scale, key_lo, key_hi, float(softcap),
            HEAD_D=d, BLOCK_D=bd, BLOCK_M=cfg.q_block_m, BLOCK_N=cfg.q_block_n, CAUSAL=causal,
            DOT_PREC=dot_precision(q.dtype), INTERVALS=intervals, HEAD_DV=dv, BLOCK_DV=bdv, SOFTCAP=cap_mode,
            REDUCE=reduce,
            num_warps=cfg.q_warps, num_stages=cfg.q_stages,
        )

    if config is not None:
        if dk_acc is not None:
            launch_dkdv(config)
        if dq_acc is not None:
            launch_dq(config)
        return
    key = (d, q.dtype, causal, q.device.index, intervals, dv, cap_mode)
    # interval masks take the causal configs (masked tiles at the edges, like a causal block); the tiles
    # are sized for the larger of the two head dims
    configs = bwd_configs(max(d, dv), q.dtype, causal or intervals)
    if dk_acc is not None:
        if hopper_dkdv_applies is not None and hopper_dkdv_applies(q, k, v, dout, softcap=softcap):
            # sm_90, bf16/fp16, head dim 64/128: the Gluon dk/dv kernel (TMA, warp-specialized WGMMA), with
            # dq added in the same pass (5 GEMMs per tile pair instead of 7)
            fuse = dq_acc is not None and hopper_fuses_dq(dq_acc, dk_acc, dv_acc)
            hopper_dkdv(dout, q, k, v, lse, delta, dk_acc, dv_acc, qk_scale=qk_scale, dk_scale=dk_scale,
                        causal=causal, offset=offset, query_lo=query_lo, query_hi=query_hi,
                        dq_acc=dq_acc if fuse else None, dq_scale=dq_scale, softcap=softcap)
            if fuse:
                return
        else:
            launch_with_fallback(DKDV_CHOSEN, key, configs, launch_dkdv)
    if dq_acc is not None:
        launch_with_fallback(DQ_CHOSEN, key, configs, launch_dq)


# ---------------------------------------------------------------------------------------------------
# public functions


def dq_with_dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softcap: float = 0.0) -> bool:
    """Whether `attention_backward` adds dq in the dk/dv pass for these `[b, s, heads, d]` inputs and the
    ring's accumulators (the Hopper kernel, where TMA indexes the float32 accumulators: the ring passes
    row ranges of them, which TMA indexes as rows for one batch element only)."""
    return (q.shape[0] == 1 and hopper_dkdv_applies is not None
            and hopper_dkdv_applies(q, k, v, q, softcap=softcap))


def attention_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`rowsum(dout * out)` in float32.

    Args:
        dout, out: `[b, s, h, d]` (any float dtypes but float64, last dim contiguous preferred).

    Returns:
        delta `[b, h, s]` float32, contiguous.
    """
    if dout.shape != out.shape or dout.dim() != 4:
        raise ValueError(f"attention_delta: dout {tuple(dout.shape)} and out {tuple(out.shape)} must be equal [b, s, h, d]")
    if dout.dtype == torch.float64 or out.dtype == torch.float64:
        raise ValueError("attention_delta: float64 is not supported by the Triton kernels; use backend='torch'")
    dout, out = last_dim_contiguous(dout), last_dim_contiguous(out)
    b, s, h, _ = out.shape
    delta = torch.empty((b, h, s), dtype=torch.float32, device=out.device)
    if delta.numel():
        _delta_impl(dout, out, delta)
    return delta


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    q_start: int,
    k_start: int,
    dq_acc: torch.Tensor | None,
    dk_acc: torch.Tensor | None,
    dv_acc: torch.Tensor | None,
    lse_grad: torch.Tensor | None = None,
    key_lo: torch.Tensor | None = None,
    key_hi: torch.Tensor | None = None,
    query_lo: torch.Tensor | None = None,
    query_hi: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> None:
    """Add one block's attention gradients into float32 accumulators (the backward of the block-op
    contract, `ringlse.blocks.contract`).

    The caller classifies the block as for `attention_forward`: only blocks in which some query sees
    some key, `causal=True` only where the causal boundary crosses the block. `causal=True` on a block
    every query sees entirely gives the same gradients, bit for bit, as `causal=False`; a causal block
    in which no query sees any key must not be passed (it launches the kernels and adds exact zeros);
    zero-length q or k launch nothing.

    Args:
        dout: `[b, sq, h, d_v]` gradient of the global output (any strides, last dim contiguous preferred).
        q: `[b, sq, h, d]`; k: `[b, sk, hkv, d]`, v: `[b, sk, hkv, d_v]`; bf16, fp16 or fp32 (fp32 dots in
            3-pass TF32).
        out: `[b, sq, h, d_v]` the *global* output (unused here: `delta` already carries it).
        lse: `[b, h, sq]` float32, the *global* lse (natural log); rows with `-inf` contribute 0.
        delta: `[b, h, sq]` float32, `rowsum(dout * out)` (minus any lse gradient).
        softmax_scale, causal, q_start, k_start, softcap: as in `attention_forward` (with a cap, dS is
            multiplied by its derivative `1 - tanh**2`, recomputed from q.k and the lse; nothing is stored).
        dq_acc: float32 `[b, sq, h, d]`; dk_acc `[b, sk, hkv, d]`, dv_acc `[b, sk, hkv, d_v]`, float32
            (views allowed, last dim contiguous); this block's gradients are added in place. `dq_acc=None` skips the dq
            kernel, `dk_acc=dv_acc=None` the dk/dv kernel (a caller that sends dk/dv in pieces of
            keys computes dq once over all of them).
        lse_grad: unused: the block-op contract has it folded into `delta` already.
        key_lo, key_hi, query_lo, query_hi: optional, all four or none: an interval mask (see
            `attention_forward`). `key_lo`, `key_hi`: int32 `[sq]`, query `i` sees keys
            `[key_lo[i], key_hi[i])` (the dq kernel walks these); `query_lo`, `query_hi`: int32 `[sk]`,
            the inverse intervals, key `j` is seen by queries `[query_lo[j], query_hi[j])` (the dk/dv
            kernel walks these). The caller guarantees they describe the same mask (`key_lo[i] <= j <
            key_hi[i]` iff `query_lo[j] <= i < query_hi[j]`) and the forward's: both then give a
            block's exact gradients. Bounds are clamped to `[0, sk]` and `[0, sq]`. Then `causal`
            must be False and `q_start`/`k_start` are ignored.

    Raises:
        ValueError: float64 or other unsupported dtypes, mismatched shapes, bad accumulators, bad
            intervals (or only some of the four) or intervals with `causal=True`.
    """
    what = "attention_backward"
    check_dtype(q, what)
    check_qkv_shapes(q, k, v, what)
    b, sq, h, d = q.shape
    sk = k.shape[1]
    if dout.shape != (*q.shape[:3], v.shape[3]):
        raise ValueError(f"{what}: dout {tuple(dout.shape)} must be q's {tuple(q.shape[:3])} x v's head dim "
                         f"{v.shape[3]}")
    softcap_mode(softcap, q.dtype, what)
    if tuple(lse.shape) != (b, h, sq) or tuple(delta.shape) != (b, h, sq):
        raise ValueError(f"{what}: lse and delta must be {(b, h, sq)}, got {tuple(lse.shape)}, {tuple(delta.shape)}")
    if (dk_acc is None) != (dv_acc is None):
        raise ValueError(f"{what}: pass both dk_acc and dv_acc, or neither")
    for acc, shape, name in ((dq_acc, q.shape, "dq_acc"), (dk_acc, k.shape, "dk_acc"), (dv_acc, v.shape, "dv_acc")):
        if acc is not None:
            check_accumulator(acc, shape, q.device, what, name)
    given = [t is not None for t in (key_lo, key_hi, query_lo, query_hi)]
    if any(given) and not all(given):
        raise ValueError(f"{what}: pass all of key_lo, key_hi, query_lo, query_hi, or none")
    if key_lo is not None:
        if causal:
            raise ValueError(f"{what}: the intervals already hold the causal rule; pass causal=False")
        key_lo, key_hi = check_intervals(key_lo, key_hi, sq, q.device, what, "key_lo/key_hi")
        query_lo, query_hi = check_intervals(query_lo, query_hi, sk, q.device, what, "query_lo/query_hi")
    if b * h * sq == 0 or sk == 0:
        return
    q, k, v, dout = (last_dim_contiguous(t) for t in (q, k, v, dout))
    if dout.dtype != q.dtype:
        dout = dout.to(q.dtype)
    lse = lse.float()
    # the kernels index delta with lse's strides
    delta = delta.float()
    if delta.stride() != lse.stride():
        lse, delta = lse.contiguous(), delta.contiguous()
    scale = float(softmax_scale)
    # the kernel's exponent needs a scale >= 0 (as in the forward); with s < 0 run on -q:
    # S is unchanged, dq = s * dS K stays, dk = s * dS^T q = |s| * dS^T (-q)
    dq_scale, dk_scale = scale, abs(scale)
    if scale < 0:
        q = -q
    _backward_impl(
        dout, q, k, v, lse, delta, dq_acc, dk_acc, dv_acc,
        qk_scale=abs(scale) * LOG2E, dq_scale=dq_scale, dk_scale=dk_scale,
        causal=causal, offset=mask_offset(causal, sq, sk, q_start, k_start),
        key_lo=key_lo, key_hi=key_hi, query_lo=query_lo, query_hi=query_hi, softcap=softcap,
    )
