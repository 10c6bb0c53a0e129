"""Hopper (sm_90) backward kernel in Gluon: dk/dv, and dq in the same pass. TMA loads by a
producer warp, WGMMA in two consumer warpgroups, gradients added into the float32 accumulators by TMA.

Same contract and formulas as `attention_bwd`'s kernels (P recomputed from the global lse, rows whose lse
is -inf contribute 0, `dV += P^T dO`, `dK += scale * dS^T Q`, `dQ += scale * dS K` with
`dS = P * (dO V^T - delta)`, delta subtracted inside the `dO V^T` MMA's sum here), for bf16/fp16, head
dims 64 and 128 (Q/K and V alike), dense, causal or interval-masked blocks (windows, packed documents),
logit softcapping included; `attention_bwd`'s launcher routes here on sm_90.

Structure: one program owns `BLOCK_N = 128` keys of one kv head (K and V loaded once, 64 keys per
consumer warpgroup) and walks the query tiles that can see them, of every query head of its GQA group
(dk/dv alone) or of one (with dq); the loader warp streams Q and dO tiles, with their rows' lse and delta,
through a ring of shared-memory slots guarded by mbarriers. Per query tile a consumer computes
`S^T = K Q^T` and `dP^T = V dO^T` (both in flight at once), then `P^T`, `dS^T` in registers and
`dV += P^T dO`, `dK += dS^T Q` with P^T and dS^T straight from registers. Interval masks: the walk over
the inverse intervals (the queries that see each key) as the Triton kernel's, query tiles seen whole by
every live key unmasked, keys no query sees reset to 0 at the end.

dq in the same pass (FUSED: 5 GEMMs per pair of tiles where dk/dv and a dq kernel take 7): each step's
dS^T also goes to shared memory, and `dQ = dS K` over the program's 128 keys (head dim 128: each warpgroup
half of the columns; 64: whole tiles, warpgroups taking turns) goes to a float32 slot that a writer warp
adds into the accumulator by TMA. The adds of different programs to one tile come in a fixed order (a
turn per tile in global memory, `hopper_ops.wait_turn`), so dq, dk and dv are the same bit for bit from
run to run: a query tile takes its dQ by descending key tile, which is why a head's key tiles start in
descending order; a kv head's dk/dv take their query heads' adds in ascending order. (Interval bounds that
decrease somewhere, which no mask of ringlse makes, keep the sum but not its order: `_dq_write`.)
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ringlse.kernels.attention_common import LOG2E, cap_scales, key_tile_query_range, softcap_mode, tanh_f32
from ringlse.kernels.attention_fwd_hopper import interval_walk, smem_layout, tma_rows_apply
from ringlse.kernels.hopper_ops import opaque_zero, pass_turn, scale_smem, tma_add, tma_add_from_smem, wait_turn
from ringlse.kernels.host import cdiv, rows_view, tma_indexable
from ringlse.kernels.launch import TmaDesc, launch

BLOCK_N = 128  # keys per program (64 per consumer warpgroup)
# queries per step: 64 (at head dim 128 ptxas spilled 20-104 bytes, dk, dv, S^T, dP^T, P^T and dS^T
# exceeding a consumer's 240 registers, yet 64-query steps ran 1.16-1.28x faster than 32 without
# spills, non-causal, and the same causal: H200)
BLOCK_M = 64
STAGES = 2


@gluon.constexpr_function
def _acc_layout(cols):
    """The register layout of a consumer warpgroup's `[64, cols]` WGMMA accumulator."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 16])


@gluon.jit
def _key_walk(n0, walk, BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr, INTERVALS: gl.constexpr):
    """The query walk of the key tile at key `n0`: `(m_lo, full_lo, full_hi, n_steps)`, `n_steps` query
    tiles of `BM` from `m_lo`, masked outside `[full_lo, full_hi)`."""
    HKV, GROUP, SQ, SK, OFFSET, QueryLo, QueryHi = walk
    if INTERVALS:
        m_lo, full_lo, full_hi, m_hi = interval_walk(QueryLo, QueryHi, n0, SK, SQ, BN, BM)
        n_steps = gl.maximum(gl.cdiv(m_hi - m_lo, BM), 0)
    else:
        m_lo, full_lo = key_tile_query_range(n0, SQ, SK, OFFSET, BM, BN, CAUSAL)
        # (>= 0: a key tile no query sees has m_lo past SQ, and `//` truncates toward zero, so the count
        # could come out negative; the writers' count of slot uses then went wrong, and with it the phase
        # they wait for)
        n_steps = gl.maximum(gl.cdiv(SQ - m_lo, BM), 0)
        full_hi = m_lo + n_steps * BM
    return m_lo, full_lo, full_hi, n_steps


@gluon.jit
def _key_tile(walk, BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr, INTERVALS: gl.constexpr,
              FUSED: gl.constexpr):
    """This program's keys and query walk: `(off_b, off_hk, g_lo, n_g, n0, m_lo, full_lo, full_hi, n_steps)`,
    `n_steps` query tiles of `BM` from `m_lo` for each of the `n_g` query heads from `g_lo` of the kv head's
    group, masked outside `[full_lo, full_hi)`."""
    HKV, GROUP, SQ, SK, OFFSET, QueryLo, QueryHi = walk
    pid_h = gl.program_id(1)
    if FUSED:
        # one query head per program (grid over B * H): a kv head's programs would be GROUP times longer,
        # and the longest start last (below)
        off_b = pid_h // (HKV * GROUP)
        off_hk = pid_h % (HKV * GROUP) // GROUP
        g_lo = pid_h % GROUP
        n_g = 1
        # the key tiles of a head start in descending order, as each query tile takes their dQ adds: a key
        # tile's turn then waits only on key tiles started before it (no deadlock), and causal walks reach
        # each query tile two steps after the key tile above (no waiting)
        n0 = (gl.num_programs(0) - 1 - gl.program_id(0)) * BN
    else:
        off_b = pid_h // HKV
        off_hk = pid_h % HKV
        g_lo = 0
        n_g = GROUP
        # ascending: the longest causal walks start first
        n0 = gl.program_id(0) * BN
    m_lo, full_lo, full_hi, n_steps = _key_walk(n0, walk, BM, BN, CAUSAL, INTERVALS)
    return off_b, off_hk, g_lo, n_g, n0, m_lo, full_lo, full_hi, n_steps


@gluon.jit
def _dkdv_load(descs, smem, bars, walk, HEAD_D: gl.constexpr, CAUSAL: gl.constexpr, INTERVALS: gl.constexpr,
               ROW_TMA: gl.constexpr, FUSED: gl.constexpr):
    """The loader warp: this program's K and V once, then Q and dO tile by tile into the ring (with
    ROW_TMA, each tile's lse and delta rows with them)."""
    q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc = descs
    q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem = smem
    kv_ready, q_ready, q_empty, do_ready, do_empty, ds_ready, ds_empty, dq_full, dq_empty = bars
    HKV, GROUP, SQ, SK, OFFSET, QueryLo, QueryHi = walk
    STAGES_: gl.constexpr = q_smem.type.shape[0]
    CONSUMERS: gl.constexpr = k_smem.type.shape[0]
    ROWS: gl.constexpr = k_smem.type.shape[1]
    BM: gl.constexpr = q_smem.type.shape[1]
    BN: gl.constexpr = CONSUMERS * ROWS
    off_b, off_hk, g_lo, n_g, n0, m_lo, full_lo, full_hi, n_steps = _key_tile(walk, BM, BN, CAUSAL, INTERVALS,
                                                                               FUSED)
    mbarrier.expect(kv_ready, CONSUMERS * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for c in gl.static_range(CONSUMERS):
        tma.async_copy_global_to_shared(k_desc, [off_b * SK + n0 + c * ROWS, off_hk * HEAD_D], kv_ready,
                                        k_smem.index(c))
        tma.async_copy_global_to_shared(v_desc, [off_b * SK + n0 + c * ROWS, off_hk * HEAD_D], kv_ready,
                                        v_smem.index(c))
    ROW_BYTES: gl.constexpr = lse_desc.block_type.nbytes if ROW_TMA else 0
    it = 0
    for gg in range(n_g):
        col = (off_hk * GROUP + g_lo + gg) * HEAD_D
        lse_row = off_b * (HKV * GROUP) + off_hk * GROUP + g_lo + gg  # of the [B * H, SQ] view
        for i in range(n_steps):
            s = it % STAGES_
            # a fresh mbarrier counts as having completed phase 1: the first waits on "empty" return at once
            ph = ((it // STAGES_) & 1) ^ 1
            m0 = m_lo + i * BM
            row = off_b * SQ + m0
            mbarrier.wait(q_empty.index(s), ph)
            mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + ROW_BYTES)
            tma.async_copy_global_to_shared(q_desc, [row, col], q_ready.index(s), q_smem.index(s))
            if ROW_TMA:
                tma.async_copy_global_to_shared(lse_desc, [lse_row, m0], q_ready.index(s),
                                                lse_smem.index(s))
            mbarrier.wait(do_empty.index(s), ph)
            mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes + ROW_BYTES)
            tma.async_copy_global_to_shared(do_desc, [row, col], do_ready.index(s), do_smem.index(s))
            if ROW_TMA:
                tma.async_copy_global_to_shared(delta_desc, [lse_row, m0], do_ready.index(s),
                                                delta_smem.index(s))
            it += 1


@gluon.jit
def _dq_write(dq_smem, bars, DQ, DK, DV, Sem, KvSem, walk, W: gl.constexpr, HEAD_D: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr, INTERVALS: gl.constexpr):
    """A writer warp (FUSED; two of them, W = 0, 1, one per consumer warpgroup's slot): adds each dQ tile
    that consumer W computed into the float32 accumulator by TMA, then W's dk and dv, each in a fixed
    order so that the gradients are the same bit for bit from run to run. A query tile takes its dQ adds
    by descending key tile: where the key tile above this one walks the query tile too, this one waits
    until it has added (Sem, per query tile of each head: the highest `n_kt - key tile` that has added);
    a kv head's 64 keys take their dk/dv adds by ascending query head of the group (KvSem; without GQA
    nobody waits on it, and the program ends once its last copy has read the slot). Each add completes
    before its turn passes on, while its slot goes back to the consumers as soon as the copy has read it
    (x1.00-1.04 over releasing it after the add completed). (Two writers give each
    add two steps' time: a poll, an add and its completion in sequence may take longer than one step at
    head dim 64; not measured apart from the other changes of its version.)

    The key tiles that walk a query tile are consecutive wherever the walks' bounds do not decrease from
    one key tile to the next: causal and dense blocks, windows and documents (monotone intervals), so the
    order is the descending one. Other intervals (the kernel takes any) still never wait on a key tile
    that does not walk the tile, so nothing hangs: their dq is the same sum with its adds in an order that
    may change from run to run."""
    kv_ready, q_ready, q_empty, do_ready, do_empty, ds_ready, ds_empty, dq_full, dq_empty = bars
    HKV, GROUP, SQ, SK, OFFSET, QueryLo, QueryHi = walk
    off_b, off_hk, g_lo, n_g, n0, m_lo, full_lo, full_hi, n_steps = _key_tile(walk, BM, BN, CAUSAL, INTERVALS,
                                                                               True)
    n_qt = gl.cdiv(SQ, BM)
    n_kt = gl.cdiv(SK, BN)
    kt = n0 // BN
    # the query tiles that the key tile above walks: it adds to them before this one does
    above_lo, _, _, above_steps = _key_walk(n0 + BN, walk, BM, BN, CAUSAL, INTERVALS)
    above_hi = gl.where(kt + 1 < n_kt, above_lo + above_steps * BM, above_lo)
    for it in range(W, n_steps * n_g, 2):
        off_h = off_hk * GROUP + g_lo + it // n_steps
        m0 = m_lo + (it % n_steps) * BM
        sem = Sem + (off_b * (HKV * GROUP) + off_h) * n_qt + m0 // BM
        if (m0 >= above_lo) & (m0 < above_hi):
            wait_turn(sem, n_kt - kt - 1)
        mbarrier.wait(dq_full.index(W), (it // 2) & 1)
        tma_add_from_smem(DQ, [off_b * SQ + m0, off_h * HEAD_D], dq_smem.index(W))
        # the slot is free once the copy has read it; the turn passes once the add has landed
        tma.store_wait(0)
        mbarrier.arrive(dq_empty.index(W), count=1)
        pass_turn(sem, n_kt - kt)
    uses = (n_steps * n_g - W + 1) // 2
    kv_sem = KvSem + ((off_b * HKV + off_hk) * n_kt + kt) * 2 + W
    r = off_b * SK + n0 + W * 64
    wait_turn(kv_sem, g_lo)
    mbarrier.wait(dq_full.index(W), uses & 1)
    tma_add_from_smem(DK, [r, off_hk * HEAD_D], dq_smem.index(W))
    tma.store_wait(0)
    mbarrier.arrive(dq_empty.index(W), count=1)
    mbarrier.wait(dq_full.index(W), (uses + 1) & 1)
    tma_add_from_smem(DV, [r, off_hk * HEAD_D], dq_smem.index(W))
    if GROUP > 1:
        pass_turn(kv_sem, g_lo + 1)
    else:
        # no other query head adds to these keys: the program ends once the copy has read the slot (the
        # kernel's end completes the add)
        tma.store_wait(0)


@gluon.jit
def _dkdv_step(it, start_m, masked, dk, dv, ops,
               WG: gl.constexpr, HEAD_D: gl.constexpr, CAUSAL: gl.constexpr, ROW_TMA: gl.constexpr,
               FUSED: gl.constexpr, DQ_HALVES: gl.constexpr, SOFTCAP: gl.constexpr, MASKED: gl.constexpr):
    """One query tile of `_dkdv_consume`'s walk (step `it`, queries from `start_m`; `ops` what every step
    reads): returns `(dk, dv)`. MASKED: the tile may be cut by the causal boundary (CAUSAL) or the keys'
    query intervals, and is where `masked` holds."""
    st_zero, smem, bars, rows_in, mask_in, scales = ops
    q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem = smem
    kv_ready, q_ready, q_empty, do_ready, do_empty, ds_ready, ds_empty, dq_full, dq_empty = bars
    lse_base, delta_base, stride_ls, SQ = rows_in
    offs_n, offs_m0, col_lo, col_hi, OFFSET = mask_in
    qk_scale, cap_scale, dq_scale = scales
    STAGES_: gl.constexpr = q_smem.type.shape[0]
    BM: gl.constexpr = q_smem.type.shape[1]
    dtype: gl.constexpr = q_smem.dtype
    st_layout: gl.constexpr = _acc_layout(BM)
    kv_layout: gl.constexpr = _acc_layout(HEAD_D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    DQ_COLS: gl.constexpr = HEAD_D // 2
    dq_layout: gl.constexpr = _acc_layout(DQ_COLS)
    offs_m = start_m + offs_m0
    s = it % STAGES_
    ph = (it // STAGES_) & 1
    kv_slot = WG
    if SOFTCAP:
        # K's and V's MMA operand descriptors made anew each step: hoisted out of the walk, a capped
        # kernel ran out of uniform registers and reloaded spilled descriptors before each step's MMAs
        # (causal: 24 local loads per step, now 10; kernel x0.90, gradients bitwise the same; H200)
        kv_slot = WG + opaque_zero(it)
    k_rows, v_rows = k_smem.index(kv_slot), v_smem.index(kv_slot)
    q_buf = q_smem.index(s)
    do_buf = do_smem.index(s)
    if not ROW_TMA:
        m_ok = offs_m < SQ
        lse = gl.load(lse_base + offs_m * stride_ls, mask=m_ok, other=float("-inf"))
        delta = gl.load(delta_base + offs_m * stride_ls, mask=m_ok, other=0.0)
    mbarrier.wait(q_ready.index(s), ph)
    st = warpgroup_mma(k_rows, q_buf.permute((1, 0)), st_zero, use_acc=False, is_async=True)
    if ROW_TMA:
        # (rows past SQ come as 0, like their Q and dO rows: P = 1 there, dP = delta = 0, so
        # they add exactly 0 to dV and dK)
        lse = lse_smem.index(s).reshape([BM]).load(col_layout)
    # rows that see nothing anywhere (lse -inf; past SQ, loaded here): lse -> +inf makes P exactly 0
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    mbarrier.wait(do_ready.index(s), ph)
    if ROW_TMA:
        delta = delta_smem.index(s).reshape([BM]).load(col_layout)
    # dP^T - delta: the accumulator starts at -delta (its registers are the MMA's anyway, and delta's
    # are free before P^T): ptxas spilled 232 B at head dim 128 under intervals, 68 B causal, now
    # 100 and 0; masked x1.02-1.07, dense x1.00-1.04 (H200).
    # dS^T's last bits, and so some of its bf16 roundings, differ from the Triton kernels' (they
    # subtract after): gradients within 1e-3 of max |dq| of theirs, no longer bit for bit
    dpt = warpgroup_mma(v_rows, do_buf.permute((1, 0)), st_zero - delta[None, :], is_async=True)
    # P^T while dP^T is still on the tensor cores
    st, _, _ = warpgroup_mma_wait(1, deps=[st, k_rows, q_buf])
    if SOFTCAP:
        tt = tanh_f32(st, 2)
        pt = gl.exp2(tt * cap_scale - lse2[None, :])
    else:
        pt = gl.exp2(st * qk_scale - lse2[None, :])
    if MASKED:
        if masked:
            if CAUSAL:
                pt = gl.where(offs_n[:, None] <= offs_m[None, :] + OFFSET, pt, 0.0)
            else:
                pt = gl.where((offs_m[None, :] >= col_lo[:, None]) & (offs_m[None, :] < col_hi[:, None]), pt,
                              0.0)
    # dV += P^T dO goes to the tensor cores before dP^T is waited for (groups retire in order)
    dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), do_buf, dv, is_async=True)
    if SOFTCAP:
        # the cap's derivative folded into P^T once its dV operand is formed: tanh dies here, before
        # dP^T's wait, instead of being recovered from P by a log2 after it
        pt = pt * (1.0 - tt * tt)
    dpt, _, _ = warpgroup_mma_wait(1, deps=[dpt, v_rows, do_buf])
    dst = pt * dpt
    if FUSED:
        # this warpgroup's half of dS^T to its slot of the step's pair (the dQ warpgroup of two
        # steps ago has read it)
        ds_phase = (it // 2) & 1
        mbarrier.wait(ds_empty.index(s), ds_phase ^ 1)
        ds_smem.index(2 * s + WG).store(dst.to(dtype))
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(s), count=1)
    dk = warpgroup_mma(gl.convert_layout(dst.to(dtype), op_layout), q_buf, dk, is_async=True)
    dv, dk, _, _ = warpgroup_mma_wait(0, deps=[dv, dk, q_buf, do_buf])
    mbarrier.arrive(q_empty.index(s), count=1)
    mbarrier.arrive(do_empty.index(s), count=1)
    if DQ_HALVES:
        # this warpgroup's half of the tile's columns of dQ = dS K over both warpgroups' keys (dS from
        # the two halves of dS^T, read transposed), into the step's dQ slot
        mbarrier.wait(ds_ready.index(s), ds_phase)
        ds0 = ds_smem.index(2 * s).permute((1, 0))
        ds1 = ds_smem.index(2 * s + 1).permute((1, 0))
        k0 = k_smem.index(0).slice(WG * DQ_COLS, DQ_COLS, 1)
        k1 = k_smem.index(1).slice(WG * DQ_COLS, DQ_COLS, 1)
        dq = warpgroup_mma(ds0, k0, gl.zeros([BM, DQ_COLS], gl.float32, dq_layout), use_acc=False,
                           is_async=True)
        dq = warpgroup_mma(ds1, k1, dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=[dq, ds0, ds1, k0, k1])[0]
        mbarrier.arrive(ds_empty.index(s), count=1)
        mbarrier.wait(dq_empty.index(s), ds_phase ^ 1)
        dq_smem.index(s).slice(WG * DQ_COLS, DQ_COLS, 1).store(dq * dq_scale)
        fence_async_shared()
        mbarrier.arrive(dq_full.index(s), count=1)
    elif FUSED:
        if it % 2 == WG:
            # the whole tile of dQ = dS K on every other step (this step's stage is WG's)
            mbarrier.wait(ds_ready.index(WG), ds_phase)
            ds0 = ds_smem.index(2 * WG).permute((1, 0))
            ds1 = ds_smem.index(2 * WG + 1).permute((1, 0))
            dq = warpgroup_mma(ds0, k_smem.index(0), gl.zeros([BM, HEAD_D], gl.float32, kv_layout),
                               use_acc=False, is_async=True)
            dq = warpgroup_mma(ds1, k_smem.index(1), dq, is_async=True)
            dq = warpgroup_mma_wait(0, deps=[dq, ds0, ds1, k_smem.index(0), k_smem.index(1)])[0]
            mbarrier.arrive(ds_empty.index(WG), count=1)
            mbarrier.wait(dq_empty.index(WG), ds_phase ^ 1)
            dq_smem.index(WG).store(dq * dq_scale)
            fence_async_shared()
            mbarrier.arrive(dq_full.index(WG), count=1)
    return dk, dv


@gluon.jit
def _dkdv_consume(smem, bars, Lse, Delta, DK, DV, strides, walk, qk_scale, dk_scale, dq_scale, softcap,
                  WG: gl.constexpr, HEAD_D: gl.constexpr, CAUSAL: gl.constexpr, INTERVALS: gl.constexpr,
                  REDUCE: gl.constexpr, ROW_TMA: gl.constexpr, FUSED: gl.constexpr, DQ_HALVES: gl.constexpr,
                  SOFTCAP: gl.constexpr):
    """A consumer warpgroup: dk/dv of its 64 keys over every query tile, added into DK/DV (pointers, or
    with REDUCE descriptors over `[B * SK, HKV * HEAD_D]` that TMA adds into). Each tile's lse and delta
    rows come from the loader's slots (ROW_TMA) or are loaded here. With FUSED, each step's dS^T goes to
    shared memory too, this warpgroup computes its part of the tile's `dQ = dq_scale * dS K` over the
    program's 128 keys (DQ_HALVES) into the step's dQ slot for a writer warp, and its final dk/dv go to the
    writer of its slot. SOFTCAP: P from the capped scores, dS^T times the cap's derivative `1 - tanh**2`."""
    q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem = smem
    kv_ready, q_ready, q_empty, do_ready, do_empty, ds_ready, ds_empty, dq_full, dq_empty = bars
    stride_lb, stride_lh, stride_ls, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh = strides
    HKV, GROUP, SQ, SK, OFFSET, QueryLo, QueryHi = walk
    STAGES_: gl.constexpr = q_smem.type.shape[0]
    CONSUMERS: gl.constexpr = k_smem.type.shape[0]
    ROWS: gl.constexpr = k_smem.type.shape[1]
    BM: gl.constexpr = q_smem.type.shape[1]
    BN: gl.constexpr = CONSUMERS * ROWS
    dtype: gl.constexpr = q_smem.dtype
    st_layout: gl.constexpr = _acc_layout(BM)
    kv_layout: gl.constexpr = _acc_layout(HEAD_D)

    off_b, off_hk, g_lo, n_g, n0, m_lo, full_lo, full_hi, n_steps = _key_tile(walk, BM, BN, CAUSAL, INTERVALS,
                                                                               FUSED)
    offs_n = n0 + WG * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, st_layout))
    if INTERVALS:
        # the queries that see each of this warpgroup's keys (keys past SK: none)
        n_ok = offs_n < SK
        col_lo = gl.maximum(gl.load(QueryLo + offs_n, mask=n_ok, other=0), 0)
        col_hi = gl.minimum(gl.load(QueryHi + offs_n, mask=n_ok, other=0), SQ)
    st_zero = gl.zeros([ROWS, BM], gl.float32, st_layout)
    dk = gl.zeros([ROWS, HEAD_D], gl.float32, kv_layout)
    dv = gl.zeros([ROWS, HEAD_D], gl.float32, kv_layout)

    mbarrier.wait(kv_ready, 0)
    if SOFTCAP:
        # K scaled by scale / softcap (`scale_smem`): S^T comes out as tanh's argument; the dQ of the fused
        # path, which reads the scaled K, is scaled back by `hopper_dkdv`
        into_tanh, cap_scale = cap_scales(qk_scale, softcap)
        scale_smem(k_smem.index(WG), into_tanh)
    it = 0
    if not INTERVALS:
        col_lo, col_hi = offs_n, offs_n  # (unused)
    mask_in = (offs_n, gl.arange(0, BM, gl.SliceLayout(0, st_layout)), col_lo, col_hi, OFFSET)
    if not SOFTCAP:
        cap_scale = qk_scale  # (unused)
    scales = (qk_scale, cap_scale, dq_scale)
    MASKS: gl.constexpr = CAUSAL or INTERVALS
    # a capped kernel walks the masked query tiles (causal: those the boundary cuts; intervals: also those
    # past full_hi) in loops of their own around the unmasked ones, so that the mask's registers stay out of
    # the main loop, where it spilled: windows x0.79-0.81, causal x0.98-0.99 (H200); uncapped, whose one loop
    # spills nothing, the split spilled and gained nothing
    SPLIT: gl.constexpr = SOFTCAP and MASKS
    n_head = gl.minimum(gl.cdiv(gl.maximum(full_lo - m_lo, 0), BM), n_steps)
    n_mid = n_steps
    if INTERVALS:
        n_mid = gl.minimum(gl.maximum(gl.maximum(full_hi - m_lo, 0) // BM, n_head), n_steps)
    for gg in range(n_g):
        off_h = off_hk * GROUP + g_lo + gg
        rows_in = (Lse + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh,
                   Delta + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh, stride_ls, SQ)
        ops = (st_zero, smem, bars, rows_in, mask_in, scales)
        if SPLIT:
            for i in range(n_head):
                dk, dv = _dkdv_step(it, m_lo + i * BM, True, dk, dv, ops, WG, HEAD_D, CAUSAL, ROW_TMA, FUSED,
                                    DQ_HALVES, SOFTCAP, True)
                it += 1
            for i in range(n_head, n_mid):
                dk, dv = _dkdv_step(it, m_lo + i * BM, False, dk, dv, ops, WG, HEAD_D, CAUSAL, ROW_TMA, FUSED,
                                    DQ_HALVES, SOFTCAP, False)
                it += 1
            for i in range(n_mid, n_steps):
                dk, dv = _dkdv_step(it, m_lo + i * BM, True, dk, dv, ops, WG, HEAD_D, CAUSAL, ROW_TMA, FUSED,
                                    DQ_HALVES, SOFTCAP, True)
                it += 1
        else:
            for i in range(n_steps):
                start_m = m_lo + i * BM
                masked = start_m < full_lo
                if INTERVALS:
                    masked = masked | (start_m + BM > full_hi)
                dk, dv = _dkdv_step(it, start_m, masked, dk, dv, ops, WG, HEAD_D, CAUSAL, ROW_TMA, FUSED,
                                    DQ_HALVES, SOFTCAP, MASKS)
                it += 1

    if INTERVALS:
        # keys no query of this block sees: exactly 0, whatever the unmasked tiles made of them
        live = gl.convert_layout(col_lo < col_hi, gl.SliceLayout(1, kv_layout))
        dk = gl.where(live[:, None], dk, 0.0)
        dv = gl.where(live[:, None], dv, 0.0)
    # dS was computed for scores already scaled; the chain rule through S = scale * q k^T adds it here
    if FUSED:
        # dk, then dv, to this warpgroup's writer warp through its dQ slot (the writer adds them in turn)
        # (with DQ_HALVES slot WG's barrier counts both warpgroups' halves of a dQ tile: this whole tile
        # arrives for both)
        uses = (it - WG + 1) // 2
        mbarrier.wait(dq_empty.index(WG), (uses & 1) ^ 1)
        dq_smem.index(WG).store(dk * dk_scale)
        fence_async_shared()
        mbarrier.arrive(dq_full.index(WG), count=1 + DQ_HALVES)
        mbarrier.wait(dq_empty.index(WG), ((uses + 1) & 1) ^ 1)
        dq_smem.index(WG).store(dv)
        fence_async_shared()
        mbarrier.arrive(dq_full.index(WG), count=1 + DQ_HALVES)
    elif REDUCE:
        r = off_b * SK + n0 + WG * ROWS
        tma_add(DK, [r, off_hk * HEAD_D], dk * dk_scale)
        tma_add(DV, [r, off_hk * HEAD_D], dv)
    else:
        offs_k = n0 + WG * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, kv_layout))
        offs_d = gl.arange(0, HEAD_D, gl.SliceLayout(0, kv_layout))
        kv_mask = (offs_k < SK)[:, None] & (offs_d < HEAD_D)[None, :]
        rows = offs_k[:, None].to(gl.int64)
        dk_ptrs = (DK + off_b.to(gl.int64) * stride_kb + off_hk.to(gl.int64) * stride_kh + rows * stride_ks
                   + offs_d[None, :])
        gl.store(dk_ptrs, gl.load(dk_ptrs, mask=kv_mask, other=0.0) + dk * dk_scale, mask=kv_mask)
        dv_ptrs = (DV + off_b.to(gl.int64) * stride_vb + off_hk.to(gl.int64) * stride_vh + rows * stride_vs
                   + offs_d[None, :])
        gl.store(dv_ptrs, gl.load(dv_ptrs, mask=kv_mask, other=0.0) + dv, mask=kv_mask)


@gluon.jit
def _attn_bwd_dkdv_hopper_kernel(
    q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, Lse, Delta, DK, DV, DQ, Sem, KvSem,
    stride_lb, stride_lh, stride_ls, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    HKV, GROUP, SQ, SK, OFFSET, qk_scale, dk_scale, dq_scale, QueryLo, QueryHi, softcap,
    HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    CAUSAL: gl.constexpr, INTERVALS: gl.constexpr, REDUCE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    ROW_TMA: gl.constexpr, FUSED: gl.constexpr, SOFTCAP: gl.constexpr,
):
    """Grid `(cdiv(SK, BLOCK_N), B * HKV)`; descriptors over `[B * S, heads * HEAD_D]` views (K/V boxes
    of 64 rows, Q/dO boxes of BLOCK_M). Delta shares Lse's strides; DK/DV are float32 accumulators. With
    INTERVALS (then not CAUSAL), key `j` is seen by the queries `[QueryLo[j], QueryHi[j])` (int32 `[SK]`);
    otherwise QueryLo/QueryHi are None. With ROW_TMA, `lse_desc`/`delta_desc` index Lse/Delta as
    `[B * H, SQ]` rows (boxes of `[1, BLOCK_M]`); else they are unused. With FUSED (REDUCE),
    dq is added too: DQ a descriptor over the float32 `[B * SQ, H * HEAD_D]` accumulator (boxes of
    `[BLOCK_M, HEAD_D]`, DK's and DV's layout), Sem and KvSem int32 zeros `[B * H, cdiv(SQ, BLOCK_M)]` and
    `[B * HKV, cdiv(SK, BLOCK_N), 2]`, and the grid `(cdiv(SK, BLOCK_N), B * H)`: one query head per program."""
    dtype: gl.constexpr = q_desc.dtype
    CONSUMERS: gl.constexpr = BLOCK_N // 64
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + v_desc.block_type.shape, v_desc.layout)
    ROW_SLOTS: gl.constexpr = STAGES if ROW_TMA else 1
    lse_smem = gl.allocate_shared_memory(gl.float32, [ROW_SLOTS] + lse_desc.block_type.shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [ROW_SLOTS] + delta_desc.block_type.shape,
                                           delta_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=CONSUMERS)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(do_empty.index(i), count=CONSUMERS)
    # dQ (FUSED) by column halves in both warpgroups at head dim 128 (a [64, 128] float32 accumulator beside
    # dk and dv spilled), by whole tiles in alternate warpgroups at 64 (faster there: no spills either way)
    DQ_HALVES: gl.constexpr = FUSED and HEAD_D == 128
    if FUSED:
        # dS^T halves, a pair per stage; one dQ slot per consumer warpgroup (also its dk/dv staging)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, 64, BLOCK_M], ds_layout)
        dq_smem = gl.allocate_shared_memory(gl.float32, [CONSUMERS] + DQ.block_type.shape, DQ.layout)
        ds_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        dq_full = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        DQ_WGS: gl.constexpr = 2 if DQ_HALVES else 1  # the consumers that write a dQ tile
        for i in gl.static_range(STAGES):
            mbarrier.init(ds_ready.index(i), count=CONSUMERS)
            mbarrier.init(ds_empty.index(i), count=DQ_WGS)
        for i in gl.static_range(CONSUMERS):
            mbarrier.init(dq_full.index(i), count=DQ_WGS)
            mbarrier.init(dq_empty.index(i), count=1)
    else:  # unused
        ds_smem, dq_smem = q_smem, q_smem
        ds_ready, ds_empty, dq_full, dq_empty = q_ready, q_empty, q_ready, q_empty

    descs = (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc)
    smem = (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem)
    bars = (kv_ready, q_ready, q_empty, do_ready, do_empty, ds_ready, ds_empty, dq_full, dq_empty)
    strides = (stride_lb, stride_lh, stride_ls, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh)
    walk = (HKV, GROUP, SQ, SK, OFFSET, QueryLo, QueryHi)
    gl.static_assert(CONSUMERS == 2)
    gl.static_assert(STAGES == 2)  # FUSED: the dQ warpgroup of step `it` is `it % 2`, as is its stage
    # (the partitions' functions cannot be held in variables: each call spells them out)
    if FUSED:
        gl.warp_specialize((
            (_dkdv_consume, (smem, bars, Lse, Delta, DK, DV, strides, walk, qk_scale, dk_scale, dq_scale, softcap,
                             0, HEAD_D, CAUSAL, INTERVALS, REDUCE, ROW_TMA, FUSED, DQ_HALVES, SOFTCAP)),
            (_dkdv_consume, (smem, bars, Lse, Delta, DK, DV, strides, walk, qk_scale, dk_scale, dq_scale, softcap,
                             1, HEAD_D, CAUSAL, INTERVALS, REDUCE, ROW_TMA, FUSED, DQ_HALVES, SOFTCAP)),
            (_dkdv_load, (descs, smem, bars, walk, HEAD_D, CAUSAL, INTERVALS, ROW_TMA, FUSED)),
            (_dq_write, (dq_smem, bars, DQ, DK, DV, Sem, KvSem, walk, 0, HEAD_D, BLOCK_M, BLOCK_N, CAUSAL,
                         INTERVALS)),
            (_dq_write, (dq_smem, bars, DQ, DK, DV, Sem, KvSem, walk, 1, HEAD_D, BLOCK_M, BLOCK_N, CAUSAL,
                         INTERVALS)),
        ), [4, 1, 1, 1], [CONSUMER_REGS, 24, 24, 24])
    else:
        gl.warp_specialize((
            (_dkdv_consume, (smem, bars, Lse, Delta, DK, DV, strides, walk, qk_scale, dk_scale, dq_scale, softcap,
                             0, HEAD_D, CAUSAL, INTERVALS, REDUCE, ROW_TMA, FUSED, DQ_HALVES, SOFTCAP)),
            (_dkdv_consume, (smem, bars, Lse, Delta, DK, DV, strides, walk, qk_scale, dk_scale, dq_scale, softcap,
                             1, HEAD_D, CAUSAL, INTERVALS, REDUCE, ROW_TMA, FUSED, DQ_HALVES, SOFTCAP)),
            (_dkdv_load, (descs, smem, bars, walk, HEAD_D, CAUSAL, INTERVALS, ROW_TMA, FUSED)),
        ), [4, 1], [CONSUMER_REGS, 24])


# ---------------------------------------------------------------------------------------------------
# launcher


def hopper_dkdv_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                        softcap: float = 0.0) -> bool:
    """Whether `hopper_dkdv` takes these inputs (see `attention_fwd_hopper.tma_rows_apply`; any softcap):
    not with a V head dim of its own (the portable kernels compute those)."""
    return v.shape[-1] == q.shape[-1] and tma_rows_apply(q, k, v, dout)


@functools.cache
def _unused_rows(device: torch.device, bm: int) -> torch.Tensor:
    """The never-read float32 `[4, bm]` behind the row descriptors of a call without row TMA, one per device
    and box: a fresh one per call would cost the launch a new tensor map each time."""
    return torch.empty(4, bm, dtype=torch.float32, device=device)


def hopper_fuses_dq(dq_acc: torch.Tensor, dk_acc: torch.Tensor, dv_acc: torch.Tensor) -> bool:
    """Whether `hopper_dkdv` adds dq too: where TMA indexes the three float32 accumulators (dense blocks,
    causal or not, and interval masks)."""
    return all(tma_indexable(t) for t in (dq_acc, dk_acc, dv_acc))


def hopper_dkdv(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
    delta: torch.Tensor, dk_acc: torch.Tensor, dv_acc: torch.Tensor, *,
    qk_scale: float, dk_scale: float, causal: bool, offset: int, block_m: int | None = None,
    query_lo: torch.Tensor | None = None, query_hi: torch.Tensor | None = None,
    dq_acc: torch.Tensor | None = None, dq_scale: float = 0.0, softcap: float = 0.0,
) -> None:
    """Add this block's dk/dv (with `dq_acc`, its dq too) into the float32 accumulators. The caller has
    checked `hopper_dkdv_applies` (with `dq_acc`, `hopper_fuses_dq`) and the arguments (`delta` with `lse`'s
    strides, `qk_scale >= 0`, a 32-bit `offset`, `sq, sk > 0`; with `query_lo`/`query_hi`, contiguous int32
    `[sk]` (see `attention_bwd.attention_backward`), `causal` is False). `block_m` (benchmarks only)
    replaces the table's.

    Accumulators that TMA can index take the tiles through TMA reduce-adds, others a load, add and store:
    the reduce-add left the programs' ends to the copy engine, 4-13% faster on windows and packed documents
    and the same on dense blocks (H100); one add per element, deterministic like the
    other (they differ in the last bit where the load-add-store fuses `dk * scale` into its add)."""
    b, sq, h, d = q.shape
    reduce = tma_indexable(dk_acc) and tma_indexable(dv_acc)
    fused = dq_acc is not None
    bm = BLOCK_M if block_m is None else block_m
    assert not fused or (reduce and bm == 64)
    sk, hkv = k.shape[1], k.shape[2]
    if b > 1 and (sq % bm or (reduce and sk % BLOCK_N)):
        # the descriptors see the batch as one [b * s] matrix: a partial last query tile would read the next
        # element's first rows of Q and dO (P is 0 there, but a NaN or inf would still reach dK and dV
        # through the products), and a partial last key tile's TMA add would reach the next element's dk/dv;
        # one launch per element lets TMA fill (and clip) the tile's tail instead
        for i in range(b):
            hopper_dkdv(dout[i:i + 1], q[i:i + 1], k[i:i + 1], v[i:i + 1], lse[i:i + 1], delta[i:i + 1],
                        dk_acc[i:i + 1], dv_acc[i:i + 1], qk_scale=qk_scale, dk_scale=dk_scale, causal=causal,
                        offset=offset, block_m=block_m, query_lo=query_lo, query_hi=query_hi,
                        dq_acc=None if dq_acc is None else dq_acc[i:i + 1], dq_scale=dq_scale, softcap=softcap)
        return
    gl_dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    descs = []
    for t, rows in ((q, bm), (dout, bm), (k, 64), (v, 64)):
        shape, strides = rows_view(t)
        descs.append(TmaDesc(t, shape, strides, (rows, d), smem_layout(rows, d, gl_dtype)))
    # lse and delta rows through TMA with Q and dO, where TMA can index them as [b * h, sq] rows: loaded by
    # each consumer at each step, their latency sat before P (dk/dv x1.08-1.21 by TMA)
    row_tma = (lse.is_contiguous() and delta.stride() == lse.stride() and sq % 4 == 0
               and lse.data_ptr() % 16 == 0 and delta.data_ptr() % 16 == 0)
    row_layout = smem_layout(1, bm, gl.float32)
    for t in (lse, delta):
        if row_tma:
            descs.append(TmaDesc(t, (b * h, sq), (sq, 1), (1, bm), row_layout))
        else:  # unused: any descriptor of the kernel's box
            descs.append(TmaDesc(_unused_rows(lse.device, bm), (4, bm), (bm, 1), (1, bm), row_layout))
    accs = [dk_acc, dv_acc]
    sems = [None, None]
    n_kt = cdiv(sk, BLOCK_N)
    if reduce:
        layout = smem_layout(64, d, gl.float32)
        accs = [TmaDesc(t, *rows_view(t), (64, d), layout) for t in accs]
        if fused:
            accs.append(TmaDesc(dq_acc, *rows_view(dq_acc), (64, d), layout))
            # the turns that keep the adds' order fixed: per query tile's dq, the highest `n_kt - key tile`
            # that has added; per key tile half's dk/dv, the query heads that have added
            n_dq = b * h * cdiv(sq, bm)
            sem = torch.zeros(n_dq + b * hkv * n_kt * 2, dtype=torch.int32, device=q.device)
            sems = [sem[:n_dq], sem[n_dq:]]
    if not fused:
        accs.append(None)
    cap_mode = softcap_mode(softcap, q.dtype, "hopper_dkdv")
    if cap_mode and qk_scale > 0:
        # the kernel's K is scaled by scale / softcap (see `_dkdv_consume`), and so is the dQ it adds
        dq_scale = dq_scale * softcap * LOG2E / qk_scale
    grid = (n_kt, b * (h if fused else hkv))
    launch(
        _attn_bwd_dkdv_hopper_kernel, grid, *descs, lse, delta, *accs, *sems,
        lse.stride(0), lse.stride(1), lse.stride(2),
        dk_acc.stride(0), dk_acc.stride(1), dk_acc.stride(2), dv_acc.stride(0), dv_acc.stride(1), dv_acc.stride(2),
        hkv, h // hkv, sq, sk, offset, qk_scale, dk_scale, dq_scale, query_lo, query_hi, float(softcap),
        HEAD_D=d, BLOCK_M=bm, BLOCK_N=BLOCK_N, STAGES=STAGES, CAUSAL=causal, INTERVALS=query_lo is not None,
        REDUCE=reduce, CONSUMER_REGS=240, ROW_TMA=row_tma, FUSED=fused,
        SOFTCAP=cap_mode,
        num_warps=4, maxnreg=168,
    )
