"""Hopper (sm_90) forward block attention in Gluon: TMA loads by a producer warp, WGMMA in two or three
consumer warpgroups, the in-kernel merge into float32 accumulators kept.

Same contract and numerics as `attention_fwd` (online softmax in base 2, rows that see no key come out
`(0, -inf)`, the ring's running state folded in the epilogue), for the cases where it pays: bf16/fp16,
head dims 64 and 128 (and Q/K 192 with V 128, MLA's; 128 with V 64), dense, causal or interval-masked blocks
(windows, packed documents), logit softcapping included.
`attention_fwd`'s launcher routes here on sm_90 and keeps its own Triton kernel for everything else (and
for the CPU interpreter, which does not run Gluon).

Structure (FlashAttention-3's): a program owns `BLOCK_M` (128 or 192) query rows of one head: one 4-warp
consumer warpgroup per 64 rows and one loader warp. The loader brings Q and the K/V tiles through a ring
of `STAGES` shared-memory slots, each guarded by a "ready" mbarrier (TMA bytes landed) and an "empty" one
(the consumers are done reading). Consumers issue `S = Q K^T` from shared memory, do the online softmax
in registers and issue `O += P V` with P straight from registers, each at its own pace (a row's max moves
only when it grows by more than 8 in base 2, so most key tiles skip rescaling O); O leaves
through shared memory and a TMA store (128-row tiles). The merging forward's float32 state comes the
same way: by TMA into a buffer of its own while the key tiles run, back by TMA after the fold (its store
drains while a persistent program's next tile runs). Programs take one work tile each, or run
persistently (`CONFIGS`: measured per head dim and mask): even tiles round-robin, uneven ones (interval
masks) taken from a global counter by the loader as it goes, which publishes each tile's walk to the
consumers through a small ring in shared memory, while they finish the tile before.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ringlse.kernels.attention_common import (
    LOG2E,
    cap_scales,
    interval_tile_range,
    query_tile_key_range,
    softcap_mode,
    softmax_step,
    tanh_f32,
    tile_visible,
)
from ringlse.kernels.hopper_ops import scale_smem
from ringlse.kernels.host import cdiv, device_capability, rows_view, sm_count, tma_indexable
from ringlse.kernels.launch import TmaDesc, launch
from ringlse.kernels.merge_math import merge_finish, merge_fold

# causal and interval blocks: the heads whose tiles go longest first together, at most 8 and as many as
# have 16 MB of K/V (a third of the L2): against a head at a time, d 64 causal S 8K x1.03, d 128 x1.02 (4
# heads), while 8 heads of 16 MB each lost 4-5% (32K causal, 8K windows; H200)
HEADS_AT_ONCE = 8
KV_AT_ONCE = 16 << 20


@gluon.jit
def interval_walk(Lo, Hi, r0, ROWS_TOTAL, LIMIT, ROWS: gl.constexpr, BLOCK: gl.constexpr):
    """A program's walk under interval masks: its rows `[r0, r0 + ROWS)` (of `ROWS_TOTAL`) see the columns
    `[Lo[r], Hi[r])` of `[0, LIMIT)` (the forward: query rows seeing keys; dk/dv: key rows seen by
    queries). `(start, full_lo, full_hi, end)` of `attention_common.interval_tile_range` (the Triton
    kernels' walk) over column tiles of `BLOCK`, with `end >= start` when no row sees a column. Every
    partition may call it (the layout spans the calling partition's warps)."""
    PAD: gl.constexpr = 256 if ROWS > 128 else ROWS  # aranges are powers of two
    offs = r0 + gl.arange(0, PAD, gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    ok = (offs < ROWS_TOTAL) & (offs < r0 + ROWS)
    _, _, start, full_lo, full_hi, end = interval_tile_range(Lo, Hi, offs, ok, LIMIT, BLOCK)
    return start, full_lo, full_hi, gl.maximum(end, start)


@gluon.jit
def _tile_coords(t, walk, BLOCK_M: gl.constexpr, LONGEST_FIRST: gl.constexpr):
    """Work tile `t`'s `(off_b, off_h, off_hk, m0)`. Even tiles: a head's query tiles consecutive, so the
    programs in flight read the same K/V (from L2). Causal and interval blocks: longest first across groups
    of heads (the longest query tile of each head of the group, then the next ones), so the work handed
    out last is short everywhere and few heads' K/V are read at a time."""
    num_m, H, GROUP, SQ, SK, OFFSET, KeyLo, KeyHi, Counter, TOTAL, LG_HEADS, Sinks = walk
    if LONGEST_FIRST:
        # groups of 2**LG_HEADS heads (a power of two that divides B * H: shifts, no division, no spills)
        first = (t // num_m) >> LG_HEADS << LG_HEADS
        r = t - first * num_m
        bh = first + (r & ((1 << LG_HEADS) - 1))
        pid_m = num_m - 1 - (r >> LG_HEADS)
    else:
        bh = t // num_m
        pid_m = t % num_m
    off_h = bh % H
    return bh // H, off_h, off_h // GROUP, pid_m * BLOCK_M


@gluon.jit
def _work_tile(t, walk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
               INTERVALS: gl.constexpr):
    """Work tile `t`: `(off_b, off_h, off_hk, m0, n_lo, full_lo, full_hi, n_tiles)`: key tiles from `n_lo`,
    those inside `[full_lo, full_hi)` unmasked."""
    num_m, H, GROUP, SQ, SK, OFFSET, KeyLo, KeyHi, Counter, TOTAL, LG_HEADS, Sinks = walk
    off_b, off_h, off_hk, m0 = _tile_coords(t, walk, BLOCK_M, CAUSAL or INTERVALS)
    if INTERVALS:
        n_lo, full_lo, full_hi, n_hi = interval_walk(KeyLo, KeyHi, m0, SQ, SK, BLOCK_M, BLOCK_N)
    else:
        n_lo = 0
        full_lo = 0
        full_hi, n_hi = query_tile_key_range(m0, SK, OFFSET, BLOCK_M, BLOCK_N, CAUSAL)
    return off_b, off_h, off_hk, m0, n_lo, full_lo, full_hi, gl.cdiv(n_hi - n_lo, BLOCK_N)


@gluon.jit
def _publish(info, count, t, n_lo, full_lo, full_hi, n_tiles):
    """The loader tells the consumers their `count`-th work tile (`t < 0`: none left) through a 2-slot
    ring in shared memory: they need not recompute its walk (loads of the row bounds and reductions,
    ~1.5 us that sat before each tile's first S on an H100)."""
    info_smem, info_ready, info_empty = info
    slot = count % 2
    mbarrier.wait(info_empty.index(slot), ((count // 2) & 1) ^ 1)
    idx = gl.arange(0, 8, gl.BlockedLayout([8], [32], [gl.num_warps()], [0]))
    vals = gl.where(idx == 0, t, gl.where(idx == 1, n_lo, gl.where(idx == 2, full_lo,
                                                                   gl.where(idx == 3, full_hi, n_tiles))))
    info_smem.index(slot).store(vals)
    mbarrier.arrive(info_ready.index(slot), count=1)


@gluon.jit
def _peek(info, count):
    """The `count`-th work tile's index `t` (`< 0`: none left), once the loader has published it."""
    info_smem, info_ready, info_empty = info
    slot = count % 2
    layout: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])
    mbarrier.wait(info_ready.index(slot), (count // 2) & 1)
    vals = info_smem.index(slot).load(layout)
    return gl.sum(gl.where(gl.arange(0, 8, layout) == 0, vals, 0), 0)


@gluon.jit
def _receive(info, count):
    """A consumer's `count`-th work tile from the loader (published: see `_peek`), `(t, n_lo, full_lo,
    full_hi, n_tiles)`, its slot handed back."""
    info_smem, info_ready, info_empty = info
    slot = count % 2
    layout: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])
    vals = info_smem.index(slot).load(layout)
    mbarrier.arrive(info_empty.index(slot), count=1)
    idx = gl.arange(0, 8, layout)
    return (gl.sum(gl.where(idx == 0, vals, 0), 0), gl.sum(gl.where(idx == 1, vals, 0), 0),
            gl.sum(gl.where(idx == 2, vals, 0), 0), gl.sum(gl.where(idx == 3, vals, 0), 0),
            gl.sum(gl.where(idx == 4, vals, 0), 0))


@gluon.jit
def _load_tile(descs, smem, bars, info, t, it, count, walk,
               HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
               INTERVALS: gl.constexpr, DYNAMIC: gl.constexpr):
    """The loader's work tile `t` (the `count`-th of this program, its first K/V tile the `it`-th through
    the ring): its walk published to the consumers (DYNAMIC), Q into its slot once the consumers are done
    with the tile before last's, then K and V tile by tile, a slot reused once the consumers released it.
    Returns the ring position after it."""
    q_desc, k_desc, v_desc = descs
    HEAD_DV: gl.constexpr = v_desc.block_type.shape[1]
    q_smem, k_smem, v_smem, _, _, _ = smem
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = bars
    SQ = walk[3]
    SK = walk[4]
    # Q and K in head-dim chunks (one for 64 and 128; 192 is no TMA box: boxes are powers of two)
    CHUNK: gl.constexpr = q_smem.type.shape[2]
    QK_CHUNKS: gl.constexpr = HEAD_D // CHUNK
    STAGES: gl.constexpr = k_smem.type.shape[0] // QK_CHUNKS
    Q_SLOTS: gl.constexpr = q_ready.type.shape[0]
    # Q in 64-row pieces, one per consumer (a 192-row tile is no TMA box either)
    CONSUMERS: gl.constexpr = q_smem.type.shape[0] // (Q_SLOTS * QK_CHUNKS)
    ROWS: gl.constexpr = q_smem.type.shape[1]
    off_b, off_h, off_hk, m0, n_lo, full_lo, full_hi, n_tiles = _work_tile(t, walk, BLOCK_M, BLOCK_N, CAUSAL,
                                                                           INTERVALS)
    if DYNAMIC:
        _publish(info, count, t, n_lo, full_lo, full_hi, n_tiles)
    qs = count % Q_SLOTS
    # a fresh mbarrier counts as having completed phase 1: the first waits on "empty" return at once
    mbarrier.wait(q_empty.index(qs), ((count // Q_SLOTS) & 1) ^ 1)
    mbarrier.expect(q_ready.index(qs), CONSUMERS * QK_CHUNKS * q_desc.block_type.nbytes)
    for c in gl.static_range(CONSUMERS):
        for j in gl.static_range(QK_CHUNKS):
            tma.async_copy_global_to_shared(q_desc, [off_b * SQ + m0 + c * ROWS, off_h * HEAD_D + j * CHUNK],
                                            q_ready.index(qs), q_smem.index((qs * CONSUMERS + c) * QK_CHUNKS + j))
    for i in range(n_tiles):
        s = (it + i) % STAGES
        ph = (((it + i) // STAGES) & 1) ^ 1
        row = off_b * SK + n_lo + i * BLOCK_N
        mbarrier.wait(k_empty.index(s), ph)
        mbarrier.expect(k_ready.index(s), QK_CHUNKS * k_desc.block_type.nbytes)
        for j in gl.static_range(QK_CHUNKS):
            tma.async_copy_global_to_shared(k_desc, [row, off_hk * HEAD_D + j * CHUNK], k_ready.index(s),
                                            k_smem.index(s * QK_CHUNKS + j))
        mbarrier.wait(v_empty.index(s), ph)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, off_hk * HEAD_DV], v_ready.index(s), v_smem.index(s))
    return it + n_tiles


@gluon.jit
def _fwd_load(descs, smem, bars, info, walk,
              HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
              INTERVALS: gl.constexpr, PERSISTENT: gl.constexpr, DYNAMIC: gl.constexpr):
    """The loader warp: its program's work tiles one after the other. DYNAMIC programs (persistent ones
    over uneven tiles: causal, interval masks) take the next tile from a global counter as they go, in the
    order the hardware hands out one program per tile and balanced as it balances them, and tell the
    consumers which (and "none left" at the end); the others walk `t = program_id + j * num_programs`
    (one tile each when there are as many programs as tiles)."""
    Counter = walk[8]
    TOTAL = walk[9]
    it = 0
    count = 0
    if not PERSISTENT:
        _load_tile(descs, smem, bars, info, gl.program_id(0), 0, 0, walk, HEAD_D, BLOCK_M, BLOCK_N, CAUSAL,
                   INTERVALS, False)
        return
    if DYNAMIC:
        t = gl.atomic_add(Counter, 1)
    else:
        t = gl.program_id(0)
    while t < TOTAL:
        it = _load_tile(descs, smem, bars, info, t, it, count, walk, HEAD_D, BLOCK_M, BLOCK_N, CAUSAL, INTERVALS,
                        DYNAMIC)
        count += 1
        if DYNAMIC:
            t = gl.atomic_add(Counter, 1)
        else:
            t += gl.num_programs(0)
    if DYNAMIC:
        _publish(info, count, -1, 0, 0, 0, 0)


@gluon.jit
def cap_shift(cap_scale):
    """The fixed shift of SOFTCAP 3, in base 2: capped scores lie in `[-C, C]` (C = `cap_scale` = softcap *
    log2 e), so `2**(score - shift)` with `shift = min(C, 125 - C)` is a normal float32 (and bf16) for every
    score, at most 1 while C <= 62.5 and `2**(2C - 125)` above (`hopper_forward` takes it for C <= 78)."""
    return gl.minimum(cap_scale, 125.0 - cap_scale)


@gluon.jit
def _softmax_tile(qk, m_i, l_i, offs_m, offs_n0, start_n, full_lo, full_hi, SK, OFFSET, qk_scale, row_lo,
                  row_hi, CAUSAL: gl.constexpr, INTERVALS: gl.constexpr, LAZY: gl.constexpr, SOFTCAP: gl.constexpr):
    """One key tile's online-softmax step in base 2: `(p, m_new, l_new, alpha)`, `qk_scale` the base-2 scale
    of what the exps see; the tile is masked unless it lies inside `[full_lo, full_hi)`. SOFTCAP caps the
    scores first: Q arrives scaled by scale / softcap (`scale_smem`), so the dots are tanh's arguments
    already, and `qk_scale` is the cap's (`cap_scales`); SOFTCAP 3 (`cap_shift`) subtracts the fixed `m_i`
    instead of a running max (no max, no rescaling: `alpha` is 1)."""
    masked = (start_n < full_lo) | (start_n + qk.shape[1] > full_hi)
    if SOFTCAP:
        qk = tanh_f32(qk, 2)
    if SOFTCAP == 3:
        arg = qk * qk_scale - m_i[:, None]
        if masked:
            offs_n = start_n + offs_n0
            visible = tile_visible(offs_m, offs_n, offs_n < SK, row_lo, row_hi, OFFSET, CAUSAL, INTERVALS)
            arg = gl.where(visible, arg, float("-inf"))
        p = gl.exp2(arg)
        m_new = m_i
        alpha = m_i * 0.0 + 1.0
        l_new = l_i + gl.sum(p, 1)
    else:
        if masked:
            offs_n = start_n + offs_n0
            visible = tile_visible(offs_m, offs_n, offs_n < SK, row_lo, row_hi, OFFSET, CAUSAL, INTERVALS)
            p, m_new, alpha = softmax_step(qk, m_i, qk_scale, visible, True, LAZY)
        else:
            p, m_new, alpha = softmax_step(qk, m_i, qk_scale, None, False, LAZY)
        l_new = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_new, alpha


@gluon.jit
def _qk_issue(q_smem, qb, k_smem, kb, s_zero, QK_CHUNKS: gl.constexpr):
    """`S = Q K^T` issued asynchronously as one WGMMA per head-dim chunk, Q's chunks at `q_smem[qb:]`, K's
    at `k_smem[kb:]`."""
    qk = warpgroup_mma(q_smem.index(qb), k_smem.index(kb).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    for j in gl.static_range(1, QK_CHUNKS):
        qk = warpgroup_mma(q_smem.index(qb + j), k_smem.index(kb + j).permute((1, 0)), qk, is_async=True)
    return qk


@gluon.jit
def _lse_rows(Lse, strides, off_b, off_h, rows):
    """The lse's addresses for `rows` of head `off_h` of batch element `off_b`."""
    _, _, _, stride_lb, stride_lh, stride_ls = strides
    return Lse + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh + rows * stride_ls


@gluon.jit
def _consume_tile(smem, bars, Out, o_desc, Lse, strides, tile, it, count, walk, qk_scale, softcap,
                  WG: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                  CAUSAL: gl.constexpr, INTERVALS: gl.constexpr, ACCUM: gl.constexpr, TMA_STORE: gl.constexpr,
                  STATE_TMA: gl.constexpr, SOFTCAP: gl.constexpr, SINK: gl.constexpr):
    """A consumer warpgroup's share of work tile `tile = (t, n_lo, full_lo, full_hi, n_tiles)` (the
    `count`-th of its program, its first K/V tile the `it`-th through the ring): its 64 query rows (the
    `WG`-th slice) through every key tile, then its own epilogue (the running state folded in with ACCUM;
    O through its Q rows' shared memory and a TMA store with TMA_STORE). Returns the ring position after it."""
    q_smem, k_smem, v_smem, flag_smem, st_smem, st_bar = smem
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = bars
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls = strides
    num_m, H, GROUP, SQ, SK, OFFSET, KeyLo, KeyHi, Counter, TOTAL, LG_HEADS, Sinks = walk
    t, n_lo, full_lo, full_hi, n_tiles = tile
    QK_CHUNKS: gl.constexpr = HEAD_D // q_smem.type.shape[2]  # (see `_load_tile`)
    STAGES: gl.constexpr = k_smem.type.shape[0] // QK_CHUNKS
    Q_SLOTS: gl.constexpr = q_ready.type.shape[0]
    CONSUMERS: gl.constexpr = q_smem.type.shape[0] // (Q_SLOTS * QK_CHUNKS)
    ROWS: gl.constexpr = q_smem.type.shape[1]
    # V and O have their own head dim (MLA: Q/K 192, V 128)
    HEAD_DV: gl.constexpr = v_smem.type.shape[2]
    # lazy maxima (FlashAttention-4's conditional rescaling) in 128-row tiles: x1.004-1.020 on H200, 64
    # documents of 512 x0.991; 192-row tiles (head dim
    # 64) spill 56 B more with them (ptxas), so they rescale every key tile
    LAZY: gl.constexpr = CONSUMERS == 2
    flags = flag_smem.index(WG)
    flag_layout: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DV, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = v_smem.dtype
    qs = count % Q_SLOTS
    qb = (qs * CONSUMERS + WG) * QK_CHUNKS
    q_rows = q_smem.index(qb)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    offs_n0 = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
    offs_d = gl.arange(0, HEAD_DV, gl.SliceLayout(0, o_layout))
    off_b, off_h, off_hk, m0 = _tile_coords(t, walk, BLOCK_M, CAUSAL or INTERVALS)
    r0 = m0 + WG * ROWS
    offs_m = r0 + gl.arange(0, ROWS, row_layout)
    if INTERVALS:
        # rows past SQ get lo = hi = 0: no key (their results are dropped by the live reset below)
        row_ok = offs_m < SQ
        row_lo = gl.maximum(gl.load(KeyLo + offs_m, mask=row_ok, other=0), 0)
        row_hi = gl.minimum(gl.load(KeyHi + offs_m, mask=row_ok, other=0), SK)
    else:
        row_lo = offs_m
        row_hi = offs_m
    if SOFTCAP:
        # from here on `qk_scale` is the scale of the capped scores (tanh's outputs)
        into_tanh, qk_scale = cap_scales(qk_scale, softcap)
    if SOFTCAP == 3:
        m_i = gl.full([ROWS], 0.0, gl.float32, row_layout) + cap_shift(qk_scale)
    else:
        m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([ROWS], gl.float32, row_layout)
    acc = gl.zeros([ROWS, HEAD_DV], gl.float32, o_layout)
    mbarrier.wait(q_ready.index(qs), (count // Q_SLOTS) & 1)
    if SOFTCAP:
        for j in gl.static_range(QK_CHUNKS):
            scale_smem(q_smem.index(qb + j), into_tanh)
    if STATE_TMA:
        # the running state on its way while the key tiles run: O by TMA into this warpgroup's float32
        # buffer (bulk copies: as plain loads in O's register layout, each warp's request touched eight
        # 128-byte lines for 256 bytes, and the epilogue waited on the L1 queue and the loads' latency);
        # issued once Q has landed, so that it does not delay Q
        st = st_smem.index(WG)
        tma.store_wait(0)  # (persistent programs: the tile before's state has left the buffer)
        mbarrier.expect(st_bar.index(WG), o_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(o_desc, [off_b * SQ + r0, off_h * HEAD_DV], st_bar.index(WG), st)
        rows_o = r0 + gl.arange(0, ROWS, orow_layout)
        old2 = gl.load(_lse_rows(Lse, strides, off_b, off_h, rows_o), mask=rows_o < SQ,
                       other=float("-inf")) * 1.4426950408889634
    if n_tiles > 0:
        # FlashAttention-3's intra-warpgroup overlap: S of tile i is issued before P V of tile i-1, so
        # the softmax of tile i runs while the tensor cores do P V of tile i-1 (600 against 577 TFLOP/s
        # without, hd 128, S 8K, H200)
        s = it % STAGES
        k_buf = k_smem.index(s * QK_CHUNKS)
        mbarrier.wait(k_ready.index(s), (it // STAGES) & 1)
        qk = _qk_issue(q_smem, qb, k_smem, s * QK_CHUNKS, s_zero, QK_CHUNKS)
        qk, _, _ = warpgroup_mma_wait(0, deps=[qk, q_rows, k_buf])
        mbarrier.arrive(k_empty.index(s), count=1)
        p, m_i, l_i, alpha = _softmax_tile(qk, m_i, l_i, offs_m, offs_n0, n_lo, full_lo, full_hi, SK, OFFSET,
                                           qk_scale, row_lo, row_hi, CAUSAL, INTERVALS, LAZY, SOFTCAP)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for i in range(1, n_tiles):
            s = (it + i) % STAGES
            k_buf = k_smem.index(s * QK_CHUNKS)
            mbarrier.wait(k_ready.index(s), ((it + i) // STAGES) & 1)
            qk = _qk_issue(q_smem, qb, k_smem, s * QK_CHUNKS, s_zero, QK_CHUNKS)
            sp = (it + i - 1) % STAGES
            v_buf = v_smem.index(sp)
            mbarrier.wait(v_ready.index(sp), ((it + i - 1) // STAGES) & 1)
            acc = warpgroup_mma(p_op, v_buf, acc, is_async=True)
            qk, _, _ = warpgroup_mma_wait(1, deps=[qk, q_rows, k_buf])
            mbarrier.arrive(k_empty.index(s), count=1)
            m_old = m_i
            p, m_i, l_i, alpha = _softmax_tile(qk, m_i, l_i, offs_m, offs_n0, n_lo + i * BLOCK_N, full_lo, full_hi,
                                               SK, OFFSET, qk_scale, row_lo, row_hi, CAUSAL, INTERVALS, LAZY, SOFTCAP)
            if LAZY and SOFTCAP != 3:
                # alpha is 1 in every row whose max stayed: most tiles skip the rescaling, a branch the
                # warpgroup must take as one. Each warp reduces its own 16 rows (shuffles only) and its
                # verdict goes through shared memory, read after the V slot's release (the compiler adds
                # two barriers a key tile; a reduction over the warpgroup's 64 rows cost three and
                # ran x0.95-1.01)
                flags.store(gl.max(gl.reshape((m_i != m_old).to(gl.int32), [4, ROWS // 4]), 1))
            # (not `_`, which carries K's slot through the loop: V's differs where it has its own head dim)
            acc, _v = warpgroup_mma_wait(0, deps=[acc, v_buf])
            mbarrier.arrive(v_empty.index(sp), count=1)
            if SOFTCAP != 3:  # (a fixed shift never rescales)
                if LAZY:
                    if gl.max(flags.load(flag_layout), 0) > 0:
                        acc = acc * gl.convert_layout(alpha, orow_layout)[:, None]
                else:
                    acc = acc * gl.convert_layout(alpha, orow_layout)[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        if not TMA_STORE:
            # every S of this work tile is done: the loader may bring a later tile's Q
            mbarrier.arrive(q_empty.index(qs), count=1)
        sp = (it + n_tiles - 1) % STAGES
        v_buf = v_smem.index(sp)
        mbarrier.wait(v_ready.index(sp), ((it + n_tiles - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_buf, acc, is_async=True)
        acc, _ = warpgroup_mma_wait(0, deps=[acc, v_buf])
        mbarrier.arrive(v_empty.index(sp), count=1)
    elif not TMA_STORE:
        mbarrier.arrive(q_empty.index(qs), count=1)

    if INTERVALS:
        # rows that see no key of this block: the empty state, whatever the unmasked tiles made of them
        live = row_lo < row_hi
        m_i = gl.where(live, m_i, float("-inf"))
        l_i = gl.where(live, l_i, 0.0)
        acc = gl.where(gl.convert_layout(live, orow_layout)[:, None], acc, 0.0)
    m_o = gl.convert_layout(m_i, orow_layout)
    l_o = gl.convert_layout(l_i, orow_layout)
    offs_mo = r0 + gl.arange(0, ROWS, orow_layout)
    m_ok = offs_mo < SQ
    o_ptrs = (Out + off_b.to(gl.int64) * stride_ob + off_h.to(gl.int64) * stride_oh
              + offs_mo[:, None].to(gl.int64) * stride_os + offs_d[None, :])
    lse_ptrs = _lse_rows(Lse, strides, off_b, off_h, offs_mo)
    o_mask = m_ok[:, None] & (offs_d[None, :] < HEAD_DV)
    if STATE_TMA:
        mbarrier.wait(st_bar.index(WG), count & 1)
        m_o, l_o, acc = merge_fold(m_o, l_o, acc, old2, st.load(o_layout), True)
    elif ACCUM:
        # the running state (lse in base e) is one more state to fold in
        old2 = gl.load(lse_ptrs, mask=m_ok, other=float("-inf")) * 1.4426950408889634
        o_old = gl.load(o_ptrs, mask=o_mask, other=0.0)
        m_o, l_o, acc = merge_fold(m_o, l_o, acc, old2, o_old, True)
    if SINK:
        # the sink: a state of output 0 and lse Sinks[head] (base e), folded once per row
        sink2 = gl.load(Sinks + off_h + offs_mo * 0) * 1.4426950408889634
        m_o, l_o, acc = merge_fold(m_o, l_o, acc, sink2, gl.zeros_like(acc), True)
    # rows that saw nothing: (0, -inf), never 0/0
    lse2, out = merge_finish(m_o, l_o, acc, True)
    if STATE_TMA:
        # back through the same buffer (TMA clips rows past the end); the lse goes while TMA reads it
        st.store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [off_b * SQ + r0, off_h * HEAD_DV], st)
        gl.store(lse_ptrs, lse2 * 0.6931471805599453, mask=m_ok)
    elif TMA_STORE:
        # one bulk copy instead of 32 scattered 4-byte stores per thread: the epilogue took ~1.7 us per
        # program that way, a tile's time on an H100; TMA clips rows past the end
        # (staged in this warpgroup's Q rows, free since its last S; the loader refills them once read.
        # Waiting for the copy during the next tile's first S instead measured the same)
        q_rows.store(out.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [off_b * SQ + r0, off_h * HEAD_DV], q_rows)
        tma.store_wait(0)
        mbarrier.arrive(q_empty.index(qs), count=1)
    else:
        gl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=o_mask)
    if not STATE_TMA:
        gl.store(lse_ptrs, lse2 * 0.6931471805599453, mask=m_ok)
    return it + n_tiles


@gluon.jit
def _fwd_consume(smem, bars, info, Out, o_desc, Lse, strides, walk, qk_scale, softcap,
                 WG: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                 CAUSAL: gl.constexpr, INTERVALS: gl.constexpr, ACCUM: gl.constexpr, TMA_STORE: gl.constexpr,
                 STATE_TMA: gl.constexpr, PERSISTENT: gl.constexpr, DYNAMIC: gl.constexpr, SOFTCAP: gl.constexpr,
                 SINK: gl.constexpr):
    """A consumer warpgroup: its program's work tiles one after the other (DYNAMIC: the ones the loader
    hands it)."""
    it = 0
    count = 0
    if DYNAMIC:
        # (only the ring positions cross iterations: a tile's walk carried from one to the next cost
        # registers the main loop spilled at head dim 64)
        while _peek(info, count) >= 0:
            it = _consume_tile(smem, bars, Out, o_desc, Lse, strides, _receive(info, count), it, count, walk,
                               qk_scale, softcap, WG, BLOCK_M, BLOCK_N, HEAD_D, CAUSAL, INTERVALS, ACCUM, TMA_STORE,
                               STATE_TMA, SOFTCAP, SINK)
            count += 1
    elif PERSISTENT:
        # (a tile index that is arithmetic on the program id keeps the walk out of registers: read from
        # the loader, the head dim 64 main loop spilled 116 B non-causal; causal, the other way round)
        for t in range(gl.program_id(0), walk[9], gl.num_programs(0)):
            _, _, _, _, n_lo, full_lo, full_hi, n_tiles = _work_tile(t, walk, BLOCK_M, BLOCK_N, CAUSAL, INTERVALS)
            it = _consume_tile(smem, bars, Out, o_desc, Lse, strides, (t, n_lo, full_lo, full_hi, n_tiles), it,
                               count, walk, qk_scale, softcap, WG, BLOCK_M, BLOCK_N, HEAD_D, CAUSAL, INTERVALS,
                               ACCUM, TMA_STORE, STATE_TMA, SOFTCAP, SINK)
            count += 1
    else:
        # one tile: ring positions known at compile time (a loop of one ran 1.5-2% slower, d 128 causal)
        t = gl.program_id(0)
        _, _, _, _, n_lo, full_lo, full_hi, n_tiles = _work_tile(t, walk, BLOCK_M, BLOCK_N, CAUSAL, INTERVALS)
        _consume_tile(smem, bars, Out, o_desc, Lse, strides, (t, n_lo, full_lo, full_hi, n_tiles), 0, 0, walk,
                      qk_scale, softcap, WG, BLOCK_M, BLOCK_N, HEAD_D, CAUSAL, INTERVALS, ACCUM, TMA_STORE, STATE_TMA,
                      SOFTCAP, SINK)
    if STATE_TMA:
        # the last state store must have read its buffer before the program ends (persistent programs
        # wait only when the buffer is wanted again: the next tile's epilogue runs while it drains)
        tma.store_wait(0)


@gluon.jit
def _attn_fwd_hopper_kernel(
    q_desc, k_desc, v_desc, o_desc, Out, Lse,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
    B, H, GROUP, SQ, SK, OFFSET, qk_scale, KeyLo, KeyHi, Counter, LG_HEADS, softcap, Sinks,
    HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    CAUSAL: gl.constexpr, INTERVALS: gl.constexpr, ACCUM: gl.constexpr, PERSISTENT: gl.constexpr,
    DYNAMIC: gl.constexpr, TMA_STORE: gl.constexpr, STATE_TMA: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    SOFTCAP: gl.constexpr, SINK: gl.constexpr,
):
    """Persistent: `min(#SMs, work tiles)` programs walk the `cdiv(SQ, BLOCK_M) * B * H` work tiles
    round-robin, or (DYNAMIC) take them from `Counter` (int32, 0 at launch); else one program per work tile.
    Descriptors over `[B * S, heads * head dim]` views (Q's box 64 rows; V and O may have their own head
    dim, from their descriptors). SOFTCAP (`softcap_mode`, or 3: the same with a fixed shift, `cap_shift`)
    caps the scores at `softcap`; SINK folds `Sinks` (float32 `[H]`) into every row's state once (not with
    ACCUM). `BLOCK_M / 64` consumer
    warpgroups (the default partition and one or two workers, 4 warps each, which never wait for each
    other) and a loader warp; `num_warps` must be 4."""
    num_m = gl.cdiv(SQ, BLOCK_M)
    dtype: gl.constexpr = q_desc.dtype
    CONSUMERS: gl.constexpr = BLOCK_M // 64
    # two Q slots in persistent programs: the next tile's Q lands while this one runs (one with the
    # merging forward's state buffer, for shared memory; it is freed after the tile's last S)
    Q_SLOTS: gl.constexpr = 2 if PERSISTENT and not STATE_TMA else 1
    # Q and K in head-dim chunks of their descriptors' boxes (see `_load_tile`)
    QK_CHUNKS: gl.constexpr = HEAD_D // q_desc.block_type.shape[1]
    q_smem = gl.allocate_shared_memory(dtype, [Q_SLOTS * CONSUMERS * QK_CHUNKS] + q_desc.block_type.shape,
                                       q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES * QK_CHUNKS] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
    info_smem = gl.allocate_shared_memory(gl.int32, [2, 8], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    info_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    info_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_SLOTS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(2):
        mbarrier.init(info_ready.index(i), count=1)
        mbarrier.init(info_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)

    # each consumer warpgroup's 4 warps' verdicts: did a row's max move (lazy maxima, `_consume_tile`)
    flag_smem = gl.allocate_shared_memory(gl.int32, [CONSUMERS, 4], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    if STATE_TMA:
        # the merging forward's float32 state, 64 rows per consumer, and its "landed" barriers
        st_smem = gl.allocate_shared_memory(gl.float32, [CONSUMERS] + o_desc.block_type.shape, o_desc.layout)
        st_bar = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(CONSUMERS):
            mbarrier.init(st_bar.index(i), count=1)
    else:
        st_smem = q_smem  # (unused)
        st_bar = q_ready
    smem = (q_smem, k_smem, v_smem, flag_smem, st_smem, st_bar)
    info = (info_smem, info_ready, info_empty)
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty)
    strides = (stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls)
    descs = (q_desc, k_desc, v_desc)
    walk = (num_m, H, GROUP, SQ, SK, OFFSET, KeyLo, KeyHi, Counter, num_m * B * H, LG_HEADS, Sinks)
    # (tuples built by `+` do not reach the partitions: every argument list is written out)
    if CONSUMERS == 2:
        gl.warp_specialize((
            (_fwd_consume, (smem, bars, info, Out, o_desc, Lse, strides, walk, qk_scale, softcap, 0, BLOCK_M,
                            BLOCK_N, HEAD_D, CAUSAL, INTERVALS, ACCUM, TMA_STORE, STATE_TMA, PERSISTENT, DYNAMIC,
                            SOFTCAP, SINK)),
            (_fwd_consume, (smem, bars, info, Out, o_desc, Lse, strides, walk, qk_scale, softcap, 1, BLOCK_M,
                            BLOCK_N, HEAD_D, CAUSAL, INTERVALS, ACCUM, TMA_STORE, STATE_TMA, PERSISTENT, DYNAMIC,
                            SOFTCAP, SINK)),
            (_fwd_load, (descs, smem, bars, info, walk, HEAD_D, BLOCK_M, BLOCK_N, CAUSAL, INTERVALS, PERSISTENT,
                         DYNAMIC)),
        ), [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.static_assert(CONSUMERS == 3)
        gl.warp_specialize((
            (_fwd_consume, (smem, bars, info, Out, o_desc, Lse, strides, walk, qk_scale, softcap, 0, BLOCK_M,
                            BLOCK_N, HEAD_D, CAUSAL, INTERVALS, ACCUM, TMA_STORE, STATE_TMA, PERSISTENT, DYNAMIC,
                            SOFTCAP, SINK)),
            (_fwd_consume, (smem, bars, info, Out, o_desc, Lse, strides, walk, qk_scale, softcap, 1, BLOCK_M,
                            BLOCK_N, HEAD_D, CAUSAL, INTERVALS, ACCUM, TMA_STORE, STATE_TMA, PERSISTENT, DYNAMIC,
                            SOFTCAP, SINK)),
            (_fwd_consume, (smem, bars, info, Out, o_desc, Lse, strides, walk, qk_scale, softcap, 2, BLOCK_M,
                            BLOCK_N, HEAD_D, CAUSAL, INTERVALS, ACCUM, TMA_STORE, STATE_TMA, PERSISTENT, DYNAMIC,
                            SOFTCAP, SINK)),
            (_fwd_load, (descs, smem, bars, info, walk, HEAD_D, BLOCK_M, BLOCK_N, CAUSAL, INTERVALS, PERSISTENT,
                         DYNAMIC)),
        ), [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])


# ---------------------------------------------------------------------------------------------------
# launcher

HEAD_DIMS = (64, 128)
# (Q/K head dim, V head dim) pairs of the forward: equal ones, and V's own (MLA's 192 / 128); 192 fits
# shared memory with one Q slot and no float32 state buffer (48 + 96 KB of Q and K stages, 64 KB of V)
FWD_HEAD_DIMS = {(64, 64), (128, 128), (128, 64), (192, 128)}
BLOCK_N = 128  # 64-key tiles (3 stages) ran at 0.84-0.90x the speed of 128 (H200)
# the largest softcap * log2 e that takes the fixed shift: P <= 2**31, so that P V stays far from float32's
# range (Gemma 2's softcap 50 is 72.1)
CAP_SHIFT_MAX = 78.0
STAGES = 2  # 3 stages measured the same as 2 (within 1%) with more shared memory


@dataclass(frozen=True)
class HopperConfig:
    block_m: int  # 128 (two consumer warpgroups) or 192 (three)
    persistent: bool  # one program per SM walking the work tiles, or one program per work tile
    # (persistent programs over causal or interval-masked tiles take them from a counter as they go)


# (head_dim, causal) -> config, the fastest of the candidates timed on H200:
# three consumers need head dim 64's smaller registers; causal blocks run one program per tile (a static
# persistent walk leaves uneven sums of work: 515 against 554 TFLOP/s at hd 128, S 8K; programs taking
# tiles from a counter lost 1.5-4%)
CONFIGS = {
    (64, False): HopperConfig(192, True),
    (64, True): HopperConfig(192, False),
    (128, False): HopperConfig(128, True),
    (128, True): HopperConfig(128, False),
    # not timed: one program per tile (persistent programs' second Q slot does not fit beside 192's K)
    (192, False): HopperConfig(128, False),
    (192, True): HopperConfig(128, False),
}
# the merging forward (float32 state by TMA, 128-row tiles) over causal blocks of up to 16K keys: persistent
# programs taking tiles from a counter, whose state stores drain while the next tile runs (time over the
# plain forward's, persistent / one program per tile: 4K d 128 1.025-1.053 / 1.078-1.082, 8K 1.021-1.026 /
# 1.044, 16K GQA 1.023 / 1.028; from 32K one program per tile wins, 1.00 against 1.017-1.032 on
# an H100)
MERGE_CONFIGS = {**CONFIGS, (128, True): HopperConfig(128, True)}
MERGE_PERSISTENT_KEYS = 16384
# interval masks (windows, packed documents): persistent programs taking the tiles from a counter, each
# tile's walk (its row bounds' loads) and loads hidden behind the tile before: 1.01-1.09x one program
# per tile (H200); 128 rows (192 at d 64 spills ~220 B with the bounds in
# registers: ptxas)
INTERVAL_CONFIGS = {64: HopperConfig(128, True), 128: HopperConfig(128, True), 192: HopperConfig(128, False)}
# capped blocks: causal ones at head dim 128 on persistent programs taking tiles from a counter, 1.053-1.088x
# the uncapped forward's time against 1.080-1.120x one program per tile (bf16, softcap 30, S 8K-32K, H200)
CAPPED_CONFIGS = {**CONFIGS, (128, True): HopperConfig(128, True)}


@functools.cache
def _gluon_supported() -> bool:
    """Triton 3.6's Gluon (warp_specialize's signature changed before it)."""
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 6)


def hopper_forward_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softcap: float = 0.0) -> bool:
    """Whether `hopper_forward` takes these inputs: a CUDA sm_90 device, bf16/fp16, head dims (Q/K, V) in
    FWD_HEAD_DIMS, and `[b, s, heads, d]` strides that TMA can index as rows (16-byte aligned); any softcap."""
    if (q.shape[-1], v.shape[-1]) not in FWD_HEAD_DIMS:
        return False
    return tma_rows_apply(q, k, v, head_dims=(q.shape[-1],))


def tma_rows_apply(*tensors: torch.Tensor, head_dims: tuple = HEAD_DIMS) -> bool:
    """Whether the Hopper kernels take these `[b, s, heads, d]` tensors (the first one's dtype): a CUDA
    sm_90 device, bf16/fp16, the first one's head dim in `head_dims`, strides that TMA can index as rows
    (16-byte aligned)."""
    q = tensors[0]
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] not in head_dims:
        return False
    if not _gluon_supported():
        return False
    if device_capability(q.device.index) != (9, 0):
        return False
    return all(t.dtype == q.dtype and tma_indexable(t) for t in tensors)


def hopper_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *,
    softmax_scale: float, causal: bool, offset: int, accum: bool, config: HopperConfig | None = None,
    key_lo: torch.Tensor | None = None, key_hi: torch.Tensor | None = None, softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """Launch the Hopper forward, writing (or merging into, with `accum`) `out`/`lse`. The caller has
    checked `hopper_forward_applies`, validated the arguments, made `softmax_scale >= 0` and `offset` a
    32-bit mask offset, and `sq, sk > 0`; with `key_lo`/`key_hi` (contiguous int32 `[sq]`, see
    `attention_fwd.attention_forward`) `causal` is False; `softcap >= 0` (0: none); `sinks` (float32
    contiguous `[h]`, not with `accum`) are folded into the state written. `config` (benchmarks only)
    replaces the table's."""
    b, sq, h, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    intervals = key_lo is not None
    table = MERGE_CONFIGS if accum and sk <= MERGE_PERSISTENT_KEYS else CAPPED_CONFIGS if softcap else CONFIGS
    if config is None:
        config = INTERVAL_CONFIGS[d] if intervals else table[(d, causal)]
    block_m, block_n, persistent = config.block_m, BLOCK_N, config.persistent
    # O through TMA (non-merging 128-row tiles): 1.01-1.09x on H200 (masks, dense d 128); the 192-row (d 64)
    # tiles lost with it, 0.92-0.96x at S 8K (88 B of spills persistent)
    # (O is staged in Q's shared memory: only where they have one head dim; the state buffer does not fit
    # beside head dim 192's Q and K)
    tma_store = block_m == 128 and not accum and out.dtype == q.dtype and tma_indexable(out) and dv == d
    state_tma = block_m == 128 and accum and out.dtype == torch.float32 and tma_indexable(out) and d <= 128
    if b > 1 and (sk % block_n or ((tma_store or state_tma) and sq % block_m)):
        # the descriptors see the batch as one [b * s] matrix: a partial last key tile would read the next
        # element's first keys (masked, but a NaN or inf there would still reach P V), a partial last O
        # tile would overwrite its first rows; one launch per element lets TMA fill and clip at the end
        for i in range(b):
            hopper_forward(q[i:i + 1], k[i:i + 1], v[i:i + 1], out[i:i + 1], lse[i:i + 1], softmax_scale=softmax_scale,
                           causal=causal, offset=offset, accum=accum, config=config, key_lo=key_lo, key_hi=key_hi,
                           softcap=softcap, sinks=sinks)
        return
    gl_dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    descs = []
    # O's descriptor: over `out` for either TMA path (float32 for the state); otherwise unused, over Q
    # Q's and K's boxes: head-dim chunks of 64 where it is no power of two (192)
    chunk = d if d & (d - 1) == 0 else 64
    o_tma = tma_store or state_tma
    for t, rows, cols in ((q, 64, chunk), (k, block_n, chunk), (v, block_n, dv),
                          (out if o_tma else q, 64, dv if o_tma else chunk)):
        shape, strides = rows_view(t)
        elem = gl.float32 if t.dtype == torch.float32 else gl_dtype
        descs.append(TmaDesc(t, shape, strides, (rows, cols), smem_layout(rows, cols, elem)))
    cap_mode = softcap_mode(softcap, q.dtype, "hopper_forward")
    if cap_mode and q.dtype == torch.bfloat16 and softcap * LOG2E <= CAP_SHIFT_MAX:
        # bounded scores need no running max (`cap_shift`): its max, rescaling and their branch cost the
        # capped forward ~0.15x the uncapped time more on an H100 (bf16 only: P in fp16 would flush weights
        # far below the shift)
        cap_mode = 3
    consumers = block_m // 64
    # 2 consumers: 12 warps (the loader's warpgroup padded) x 168 registers = 240 per consumer thread, 24 for
    # the loader; 3 consumers: 16 warps x 128, 160 per worker consumer
    maxnreg, regs = (168, 240) if consumers == 2 else (128, 160)
    total = cdiv(sq, block_m) * b * h
    # persistent programs over uneven tiles take them as they go; even ones round-robin
    dynamic = persistent and (causal or intervals)
    grid = (min(total, sm_count(q.device.index)) if persistent else total,)
    launch(
        _attn_fwd_hopper_kernel, grid, *descs, out, lse,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        b, h, h // hkv, sq, sk, offset, softmax_scale * 1.4426950408889634, key_lo, key_hi,
        torch.zeros(1, dtype=torch.int32, device=q.device) if dynamic else lse,
        heads_log2(b * h, sk * (d + dv) * k.element_size()), float(softcap), lse if sinks is None else sinks,
        HEAD_D=d, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=STAGES, CAUSAL=causal, INTERVALS=intervals, ACCUM=accum,
        PERSISTENT=persistent, DYNAMIC=dynamic, TMA_STORE=tma_store, STATE_TMA=state_tma, CONSUMER_REGS=regs,
        SOFTCAP=cap_mode, SINK=sinks is not None, num_warps=4,
        maxnreg=maxnreg,
    )


def heads_log2(heads: int, kv_bytes: int) -> int:
    """log2 of the heads whose tiles go longest first together: the largest power of two that divides
    `heads`, up to HEADS_AT_ONCE, whose K/V (`kv_bytes` a head) fit in KV_AT_ONCE."""
    lg = 0
    while (2 ** (lg + 1) <= HEADS_AT_ONCE and heads % 2 ** (lg + 1) == 0
           and 2 ** (lg + 1) * kv_bytes <= KV_AT_ONCE):
        lg += 1
    return lg


@functools.cache
def smem_layout(rows: int, cols: int, dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a `[rows, cols]` TMA box of `dtype`, built once: a short call's
    launches spent about a third of their pre-launch host time building these."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], dtype)
