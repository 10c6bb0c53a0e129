"""Hopper (sm_90) dk/dv kernel of the backward in Gluon: TMA loads by a producer warp, WGMMA in two
consumer warpgroups, gradients added into the float32 accumulators as the Triton kernel does.

Same contract and numerics as `attention_bwd`'s dk/dv kernel (P recomputed from the global lse, rows whose
lse is -inf contribute 0, `dV += P^T dO`, `dK += scale * dS^T Q` with `dS = P * (dO V^T - delta)`), for
bf16/fp16, head dims 64 and 128, dense, causal or interval-masked blocks (windows, packed documents);
`attention_bwd`'s launcher routes here on sm_90.

Structure: one program owns `BLOCK_N = 128` keys of one kv head (K and V loaded once, 64 keys per
consumer warpgroup) and walks the query tiles of every query head of its GQA group that can see them;
the loader warp streams Q and dO tiles, with their rows' lse and delta, through a ring of shared-memory
slots guarded by mbarriers. Per query tile a consumer computes `S^T = K Q^T` and `dP^T = V dO^T` (both
in flight at once), then `P^T`, `dS^T` in registers and `dV += P^T dO`, `dK += dS^T Q` with P^T and
dS^T straight from registers. Interval masks: the walk over the inverse intervals (the queries that see
each key) as the Triton kernel's, query tiles seen whole by every live key unmasked, keys no query sees
reset to 0 at the end.
"""

from __future__ import annotations

import torch
import triton
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ringlse.kernels.attention_common import key_tile_query_range
from ringlse.kernels.attention_fwd_hopper import interval_walk, tma_rows_apply
from ringlse.kernels.host import rows_view, tma_indexable

BLOCK_N = 128  # keys per program (64 per consumer warpgroup)
# queries per step: 64 (at head dim 128 ptxas spills 20-104 bytes, dk, dv, S^T, dP^T, P^T and dS^T
# exceeding a consumer's 240 registers, yet 64-query steps ran 1.16-1.28x faster than 32 without
# spills, non-causal, and the same causal: H200, benchmarks/NOTES.md)
BLOCK_M = 64
STAGES = 2


@gl._core.builtin
def _tma_add(desc, coord, value, _semantic=None):
    """Add a register tile into global memory through TMA (`cp.reduce.async.bulk.tensor` add): Triton's
    `tt.descriptor_reduce`, which Gluon's TMA lowering stages through shared memory, but Gluon 3.6 does not
    wrap for Hopper. Each element gets one float32 add (deterministic); a load, add and store may fuse
    the scale into its add, so the two can differ in the last bit."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_descriptor_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, value.handle, coord)


@gluon.jit
def _key_tile(walk, BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr, INTERVALS: gl.constexpr):
    """This program's keys and query walk: `(off_b, off_hk, n0, m_lo, full_lo, full_hi, n_steps)`, `n_steps`
    query tiles of `BM` from `m_lo` per query head, masked outside `[full_lo, full_hi)`."""
    HKV, GROUP, SQ, SK, OFFSET, QueryLo, QueryHi = walk
    pid_bh = gl.program_id(1)
    n0 = gl.program_id(0) * BN
    if INTERVALS:
        m_lo, full_lo, full_hi, m_hi = interval_walk(QueryLo, QueryHi, n0, SK, SQ, BN, BM)
        n_steps = gl.cdiv(m_hi - m_lo, BM)
    else:
        m_lo, full_lo = key_tile_query_range(n0, SQ, SK, OFFSET, BM, BN, CAUSAL)
        n_steps = gl.cdiv(SQ - m_lo, BM)
        full_hi = m_lo + n_steps * BM
    return pid_bh // HKV, pid_bh % HKV, n0, m_lo, full_lo, full_hi, n_steps


@gluon.jit
def _dkdv_load(descs, smem, bars, walk, HEAD_D: gl.constexpr, CAUSAL: gl.constexpr, INTERVALS: gl.constexpr,
               ROW_TMA: gl.constexpr):
    """The loader warp: this program's K and V once, then Q and dO tile by tile into the ring (with
    ROW_TMA, each tile's lse and delta rows with them)."""
    q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc = descs
    q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem = smem
    kv_ready, q_ready, q_empty, do_ready, do_empty = bars
    HKV, GROUP, SQ, SK, OFFSET, QueryLo, QueryHi = walk
    STAGES_: gl.constexpr = q_smem.type.shape[0]
    CONSUMERS: gl.constexpr = k_smem.type.shape[0]
    ROWS: gl.constexpr = k_smem.type.shape[1]
    BM: gl.constexpr = q_smem.type.shape[1]
    BN: gl.constexpr = CONSUMERS * ROWS
    off_b, off_hk, n0, m_lo, full_lo, full_hi, n_steps = _key_tile(walk, BM, BN, CAUSAL, INTERVALS)
    mbarrier.expect(kv_ready, CONSUMERS * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for c in gl.static_range(CONSUMERS):
        tma.async_copy_global_to_shared(k_desc, [off_b * SK + n0 + c * ROWS, off_hk * HEAD_D], kv_ready,
                                        k_smem.index(c))
        tma.async_copy_global_to_shared(v_desc, [off_b * SK + n0 + c * ROWS, off_hk * HEAD_D], kv_ready,
                                        v_smem.index(c))
    ROW_BYTES: gl.constexpr = lse_desc.block_type.nbytes if ROW_TMA else 0
    it = 0
    for g in range(GROUP):
        col = (off_hk * GROUP + g) * HEAD_D
        lse_row = off_b * (HKV * GROUP) + off_hk * GROUP + g  # of the [B * H, SQ] view
        for i in range(n_steps):
            s = it % STAGES_
            # a fresh mbarrier counts as having completed phase 1: the first waits on "empty" return at once
            ph = ((it // STAGES_) & 1) ^ 1
            row = off_b * SQ + m_lo + i * BM
            mbarrier.wait(q_empty.index(s), ph)
            mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + ROW_BYTES)
            tma.async_copy_global_to_shared(q_desc, [row, col], q_ready.index(s), q_smem.index(s))
            if ROW_TMA:
                tma.async_copy_global_to_shared(lse_desc, [lse_row, m_lo + i * BM], q_ready.index(s),
                                                lse_smem.index(s))
            mbarrier.wait(do_empty.index(s), ph)
            mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes + ROW_BYTES)
            tma.async_copy_global_to_shared(do_desc, [row, col], do_ready.index(s), do_smem.index(s))
            if ROW_TMA:
                tma.async_copy_global_to_shared(delta_desc, [lse_row, m_lo + i * BM], do_ready.index(s),
                                                delta_smem.index(s))
            it += 1


@gluon.jit
def _dkdv_consume(smem, bars, Lse, Delta, DK, DV, strides, walk, qk_scale, dk_scale,
                  WG: gl.constexpr, HEAD_D: gl.constexpr, CAUSAL: gl.constexpr, INTERVALS: gl.constexpr,
                  REDUCE: gl.constexpr, ROW_TMA: gl.constexpr):
    """A consumer warpgroup: dk/dv of its 64 keys over every query tile, added into DK/DV (pointers, or
    with REDUCE descriptors over `[B * SK, HKV * HEAD_D]` that TMA adds into). Each tile's lse and delta
    rows come from the loader's slots (ROW_TMA) or are loaded here."""
    q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem = smem
    kv_ready, q_ready, q_empty, do_ready, do_empty = bars
    stride_lb, stride_lh, stride_ls, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh = strides
    HKV, GROUP, SQ, SK, OFFSET, QueryLo, QueryHi = walk
    STAGES_: gl.constexpr = q_smem.type.shape[0]
    CONSUMERS: gl.constexpr = k_smem.type.shape[0]
    ROWS: gl.constexpr = k_smem.type.shape[1]
    BM: gl.constexpr = q_smem.type.shape[1]
    BN: gl.constexpr = CONSUMERS * ROWS
    dtype: gl.constexpr = q_smem.dtype
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BM, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)

    off_b, off_hk, n0, m_lo, full_lo, full_hi, n_steps = _key_tile(walk, BM, BN, CAUSAL, INTERVALS)
    k_rows = k_smem.index(WG)
    v_rows = v_smem.index(WG)
    offs_n = n0 + WG * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, st_layout))
    if INTERVALS:
        # the queries that see each of this warpgroup's keys (keys past SK: none)
        n_ok = offs_n < SK
        col_lo = gl.maximum(gl.load(QueryLo + offs_n, mask=n_ok, other=0), 0)
        col_hi = gl.minimum(gl.load(QueryHi + offs_n, mask=n_ok, other=0), SQ)
    offs_m0 = gl.arange(0, BM, col_layout)
    st_zero = gl.zeros([ROWS, BM], gl.float32, st_layout)
    dk = gl.zeros([ROWS, HEAD_D], gl.float32, kv_layout)
    dv = gl.zeros([ROWS, HEAD_D], gl.float32, kv_layout)

    mbarrier.wait(kv_ready, 0)
    it = 0
    for g in range(GROUP):
        off_h = off_hk * GROUP + g
        lse_base = Lse + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh
        delta_base = Delta + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh
        for i in range(n_steps):
            start_m = m_lo + i * BM
            offs_m = start_m + offs_m0
            s = it % STAGES_
            ph = (it // STAGES_) & 1
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
            dpt = warpgroup_mma(v_rows, do_buf.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            if ROW_TMA:
                delta = delta_smem.index(s).reshape([BM]).load(col_layout)
            # P^T while dP^T is still on the tensor cores
            st, _, _ = warpgroup_mma_wait(1, deps=[st, k_rows, q_buf])
            pt = gl.exp2(st * qk_scale - lse2[None, :])
            if CAUSAL:
                if start_m < full_lo:
                    pt = gl.where(offs_n[:, None] <= offs_m[None, :] + OFFSET, pt, 0.0)
            if INTERVALS:
                if (start_m < full_lo) | (start_m + BM > full_hi):
                    pt = gl.where((offs_m[None, :] >= col_lo[:, None]) & (offs_m[None, :] < col_hi[:, None]), pt, 0.0)
            # dV += P^T dO goes to the tensor cores before dP^T is waited for (groups retire in order)
            dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), do_buf, dv, is_async=True)
            dpt, _, _ = warpgroup_mma_wait(1, deps=[dpt, v_rows, do_buf])
            dst = pt * (dpt - delta[None, :])
            dk = warpgroup_mma(gl.convert_layout(dst.to(dtype), op_layout), q_buf, dk, is_async=True)
            dv, dk, _, _ = warpgroup_mma_wait(0, deps=[dv, dk, q_buf, do_buf])
            mbarrier.arrive(q_empty.index(s), count=1)
            mbarrier.arrive(do_empty.index(s), count=1)
            it += 1

    if INTERVALS:
        # keys no query of this block sees: exactly 0, whatever the unmasked tiles made of them
        live = gl.convert_layout(col_lo < col_hi, gl.SliceLayout(1, kv_layout))
        dk = gl.where(live[:, None], dk, 0.0)
        dv = gl.where(live[:, None], dv, 0.0)
    # dS was computed for scores already scaled; the chain rule through S = scale * q k^T adds it here
    if REDUCE:
        r = off_b * SK + n0 + WG * ROWS
        _tma_add(DK, [r, off_hk * HEAD_D], dk * dk_scale)
        _tma_add(DV, [r, off_hk * HEAD_D], dv)
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
    q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, Lse, Delta, DK, DV,
    stride_lb, stride_lh, stride_ls, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    HKV, GROUP, SQ, SK, OFFSET, qk_scale, dk_scale, QueryLo, QueryHi,
    HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    CAUSAL: gl.constexpr, INTERVALS: gl.constexpr, REDUCE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    ROW_TMA: gl.constexpr,
):
    """Grid `(cdiv(SK, BLOCK_N), B * HKV)`; descriptors over `[B * S, heads * HEAD_D]` views (K/V boxes
    of 64 rows, Q/dO boxes of BLOCK_M). Delta shares Lse's strides; DK/DV are float32 accumulators. With
    INTERVALS (then not CAUSAL), key `j` is seen by the queries `[QueryLo[j], QueryHi[j])` (int32 `[SK]`);
    otherwise QueryLo/QueryHi are None. With ROW_TMA, `lse_desc`/`delta_desc` index Lse/Delta as
    `[B * H, SQ]` rows (boxes of `[1, BLOCK_M]`); else they are unused."""
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

    descs = (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc)
    smem = (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem)
    bars = (kv_ready, q_ready, q_empty, do_ready, do_empty)
    strides = (stride_lb, stride_lh, stride_ls, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh)
    walk = (HKV, GROUP, SQ, SK, OFFSET, QueryLo, QueryHi)
    gl.static_assert(CONSUMERS == 2)
    gl.warp_specialize((
        (_dkdv_consume, (smem, bars, Lse, Delta, DK, DV, strides, walk, qk_scale, dk_scale, 0, HEAD_D, CAUSAL,
                         INTERVALS, REDUCE, ROW_TMA)),
        (_dkdv_consume, (smem, bars, Lse, Delta, DK, DV, strides, walk, qk_scale, dk_scale, 1, HEAD_D, CAUSAL,
                         INTERVALS, REDUCE, ROW_TMA)),
        (_dkdv_load, (descs, smem, bars, walk, HEAD_D, CAUSAL, INTERVALS, ROW_TMA)),
    ), [4, 1], [CONSUMER_REGS, 24])


# ---------------------------------------------------------------------------------------------------
# launcher


def hopper_dkdv_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> bool:
    """Whether `hopper_dkdv` takes these inputs (see `attention_fwd_hopper.tma_rows_apply`)."""
    return tma_rows_apply(q, k, v, dout)


def hopper_dkdv(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
    delta: torch.Tensor, dk_acc: torch.Tensor, dv_acc: torch.Tensor, *,
    qk_scale: float, dk_scale: float, causal: bool, offset: int, block_m: int | None = None,
    query_lo: torch.Tensor | None = None, query_hi: torch.Tensor | None = None,
) -> None:
    """Add this block's dk/dv into the float32 accumulators. The caller has checked `hopper_dkdv_applies`
    and the arguments (`delta` with `lse`'s strides, `qk_scale >= 0`, a 32-bit `offset`, `sq, sk > 0`;
    with `query_lo`/`query_hi`, contiguous int32 `[sk]` (see `attention_bwd.attention_backward`), `causal`
    is False). `block_m` (benchmarks only) replaces the table's.

    Accumulators that TMA can index take the tiles through TMA reduce-adds, others a load, add and store:
    the reduce-add left the programs' ends to the copy engine, 4-13% faster on windows and packed documents
    and the same on dense blocks (H100, benchmarks/NOTES.md); one add per element, deterministic like the
    other (they differ in the last bit where the load-add-store fuses `dk * scale` into its add)."""
    b, sq, h, d = q.shape
    reduce = tma_indexable(dk_acc) and tma_indexable(dv_acc)
    bm = BLOCK_M if block_m is None else block_m
    sk, hkv = k.shape[1], k.shape[2]
    if b > 1 and (sq % bm or (reduce and sk % BLOCK_N)):
        # the descriptors see the batch as one [b * s] matrix: a partial last query tile would read the next
        # element's first rows of Q and dO (P is 0 there, but a NaN or inf would still reach dK and dV
        # through the products), and a partial last key tile's TMA add would reach the next element's dk/dv;
        # one launch per element lets TMA fill (and clip) the tile's tail instead
        for i in range(b):
            hopper_dkdv(dout[i:i + 1], q[i:i + 1], k[i:i + 1], v[i:i + 1], lse[i:i + 1], delta[i:i + 1],
                        dk_acc[i:i + 1], dv_acc[i:i + 1], qk_scale=qk_scale, dk_scale=dk_scale, causal=causal,
                        offset=offset, block_m=block_m, query_lo=query_lo, query_hi=query_hi)
        return
    gl_dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    descs = []
    for t, rows in ((q, bm), (dout, bm), (k, 64), (v, 64)):
        shape, strides = rows_view(t)
        layout = gl.NVMMASharedLayout.get_default_for([rows, d], gl_dtype)
        descs.append(TensorDescriptor(t, shape, strides, [rows, d], layout))
    # lse and delta rows through TMA with Q and dO, where TMA can index them as [b * h, sq] rows: loaded by
    # each consumer at each step, their latency sat before P (benchmarks/NOTES.md)
    row_tma = (lse.is_contiguous() and delta.stride() == lse.stride() and sq % 4 == 0
               and lse.data_ptr() % 16 == 0 and delta.data_ptr() % 16 == 0)
    row_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    for t in (lse, delta):
        if row_tma:
            descs.append(TensorDescriptor(t, [b * h, sq], [sq, 1], [1, bm], row_layout))
        else:  # unused: any descriptor of the kernel's box
            descs.append(TensorDescriptor(lse.new_empty(4, bm), [4, bm], [bm, 1], [1, bm], row_layout))
    accs = [dk_acc, dv_acc]
    if reduce:
        layout = gl.NVMMASharedLayout.get_default_for([64, d], gl.float32)
        accs = [TensorDescriptor(t, *rows_view(t), [64, d], layout) for t in accs]
    grid = (triton.cdiv(sk, BLOCK_N), b * hkv)
    _attn_bwd_dkdv_hopper_kernel[grid](
        *descs, lse, delta, *accs,
        lse.stride(0), lse.stride(1), lse.stride(2),
        dk_acc.stride(0), dk_acc.stride(1), dk_acc.stride(2), dv_acc.stride(0), dv_acc.stride(1), dv_acc.stride(2),
        hkv, h // hkv, sq, sk, offset, qk_scale, dk_scale, query_lo, query_hi,
        HEAD_D=d, BLOCK_M=bm, BLOCK_N=BLOCK_N, STAGES=STAGES, CAUSAL=causal, INTERVALS=query_lo is not None,
        REDUCE=reduce, CONSUMER_REGS=240, ROW_TMA=row_tma,
        num_warps=4, maxnreg=168,
    )
