"""Fused merge of attention states `(out, lse)` (CONVENTIONS.md §3) in one pass over memory.

Merging is memory-bound: per row it does a handful of exps over `headdim` values it only reads once.
The eager PyTorch merge makes several passes (stack, amax, exp, sum, log, scale, add) and reaches about
a fifth of the device copy bandwidth; this kernel reads every input once and writes every output
once, so it can approach the copy rate.

Layout: a state is `out` `[B, S, H, D]` (any float dtype, last dim contiguous, other strides free, so
`buf[:, half:]` views of a ring buffer work) with `lse` `[B, H, S]` float32 (any strides: a tokens-first
`[B, S, H]` lse comes as its transpose, so the engines' layouts cost no copy). Programs walk rows
`r = s * H + h` of one batch entry, so that for the usual `[B, S, H, D]` layout a tile of rows is one
contiguous stretch of memory.

Three kernels, each one launch. `_merge_states_kernel` takes up to four states through a slot each
(any mix of dtypes and strides). `_merge_stacked_kernel` takes any number of states of one dtype and
strides that lie at one distance from each other (a stacked tensor's states, whatever dim they are
stacked along: FlashInfer's `[T, N, H, D]`, FA4's `[N, T, H, D]`). `_merge_tuple_kernel` takes up to 16
states anywhere (tuples of pointers and strides); more chain launches through a float32 intermediate. `BASE2`: every lse in and out is in base 2, and the math runs in base 2 (exp2/log2): the same
weights, with no conversion pass. The stacked and tuple kernels load every state before any math where
the states' tiles fit a thread's registers (`PRELOAD`, small tiles: short inputs), else in two passes.

Math per row: `ringlse.kernels.merge_math` (CONVENTIONS.md §3), max first: every state's lse is loaded
before any math, so the max comes first, then one exp per state and the weights divided by their sum
before they touch the outputs. Subtracting the max keeps lse values of +-1e4 finite.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ringlse.kernels.host import cdiv, next_power_of_2, sm_count
from ringlse.kernels.launch import launch
from ringlse.kernels.merge_math import merge_finish, merge_lse, merge_shift, merge_term, merge_weight

# states the four-slot kernel merges in one launch
MAX_STATES_PER_LAUNCH = 4
# states of a sequence (not equally spaced) the tuple kernel merges in one launch; merge_states chains
# launches for more
MAX_TUPLE_STATES = 16  # 32 spill registers on sm_90 (ptxas -v)
# values of one thread's tiles, over every state, up to which the stacked and tuple kernels load them all first:
# one-row tiles gain (one token, 16 states: 0.86 -> 0.92x the copy's bandwidth), two-row tiles of 16 states
# lose (1K tokens: 0.85 -> 0.76x; docs/decisions.md)
PRELOAD_VALUES = 64


@triton.jit
def _load_lse(L, b, hh, s, sb, sh, ss, row_ok):
    return tl.load(L + b * sb + hh * sh + s * ss, mask=row_ok, other=float("-inf")).to(tl.float32)


@triton.jit
def _load_out(O, b, hh, s, sb, ss, sh, cols, mask):
    """A tile of one state's out, in its own dtype."""
    row_off = b * sb + s * ss + hh * sh
    return tl.load(O + row_off[:, None] + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _row_tile(n_heads, n_rows, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's tile of rows `r = s * H + h` of batch entry `b`: `(b, s, hh, cols, row_ok, mask)`."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    # int64 offsets: a [1, 128K, 32, 128] state already has 2^29 elements per tensor
    s = (rows // n_heads).to(tl.int64)
    hh = (rows % n_heads).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    if BLOCK_D == D:
        mask = row_ok[:, None]  # uniform along d, so loads stay vectorised
    else:
        mask = row_ok[:, None] & (cols < D)[None, :]
    return b, s, hh, cols, row_ok, mask


@triton.jit
def _store_state(OUT, LSE_OUT, acc, lse, b, s, hh, cols, row_ok, mask,
                 out_sb, out_ss, out_sh, lo_sb, lo_sh, lo_ss, IN_PLACE: tl.constexpr):
    """Write a tile's merged `out` (in OUT's dtype) and `lse`."""
    if IN_PLACE:
        # an output aliases an input: lse values are replicated across threads, so without this
        # barrier a fast warp could overwrite an lse that a slower warp has not loaded yet
        tl.debug_barrier()
    out_off = b * out_sb + s * out_ss + hh * out_sh
    tl.store(OUT + out_off[:, None] + cols[None, :], acc.to(OUT.dtype.element_ty), mask=mask)
    tl.store(LSE_OUT + b * lo_sb + hh * lo_sh + s * lo_ss, lse, mask=row_ok)


@triton.jit
def _merge_loaded(lses, outs, N: tl.constexpr, BASE2: tl.constexpr):
    """`(lse, out)` of N states already loaded (tuples of `[R]` lses and `[R, D]` outputs), max first."""
    m = lses[0]
    for i in tl.static_range(1, N):
        m = tl.maximum(m, lses[i])
    shift = merge_shift(m)
    t = merge_weight(lses[0], shift, BASE2)
    acc = merge_term(t, outs[0].to(tl.float32))
    for i in tl.static_range(1, N):
        w = merge_weight(lses[i], shift, BASE2)
        t += w
        acc = acc + merge_term(w, outs[i].to(tl.float32))
    return merge_finish(shift, t, acc, BASE2)


@triton.jit
def _merge_states_kernel(
    O0, O1, O2, O3,
    L0, L1, L2, L3,
    OUT, LSE_OUT,
    n_heads, n_rows,
    o0_sb, o0_ss, o0_sh, o1_sb, o1_ss, o1_sh, o2_sb, o2_ss, o2_sh, o3_sb, o3_ss, o3_sh,
    l0_sb, l0_sh, l0_ss, l1_sb, l1_sh, l1_ss, l2_sb, l2_sh, l2_ss, l3_sb, l3_sh, l3_ss,
    out_sb, out_ss, out_sh, lo_sb, lo_sh, lo_ss,
    N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IN_PLACE: tl.constexpr,
    BASE2: tl.constexpr,
):
    b, s, hh, cols, row_ok, mask = _row_tile(n_heads, n_rows, D, BLOCK_R, BLOCK_D)

    # issue every load before any math so that all of them are in flight together
    l0 = _load_lse(L0, b, hh, s, l0_sb, l0_sh, l0_ss, row_ok)
    o0 = _load_out(O0, b, hh, s, o0_sb, o0_ss, o0_sh, cols, mask).to(tl.float32)
    if N > 1:
        l1 = _load_lse(L1, b, hh, s, l1_sb, l1_sh, l1_ss, row_ok)
        o1 = _load_out(O1, b, hh, s, o1_sb, o1_ss, o1_sh, cols, mask).to(tl.float32)
    if N > 2:
        l2 = _load_lse(L2, b, hh, s, l2_sb, l2_sh, l2_ss, row_ok)
        o2 = _load_out(O2, b, hh, s, o2_sb, o2_ss, o2_sh, cols, mask).to(tl.float32)
    if N > 3:
        l3 = _load_lse(L3, b, hh, s, l3_sb, l3_sh, l3_ss, row_ok)
        o3 = _load_out(O3, b, hh, s, o3_sb, o3_ss, o3_sh, cols, mask).to(tl.float32)

    m = l0
    if N > 1:
        m = tl.maximum(m, l1)
    if N > 2:
        m = tl.maximum(m, l2)
    if N > 3:
        m = tl.maximum(m, l3)
    shift = merge_shift(m)
    w0 = merge_weight(l0, shift, BASE2)
    t = w0
    if N > 1:
        w1 = merge_weight(l1, shift, BASE2)
        t = t + w1
    if N > 2:
        w2 = merge_weight(l2, shift, BASE2)
        t = t + w2
    if N > 3:
        w3 = merge_weight(l3, shift, BASE2)
        t = t + w3
    lse, t_safe = merge_lse(shift, t, BASE2)

    acc = merge_term(w0 / t_safe, o0)
    if N > 1:
        acc = acc + merge_term(w1 / t_safe, o1)
    if N > 2:
        acc = acc + merge_term(w2 / t_safe, o2)
    if N > 3:
        acc = acc + merge_term(w3 / t_safe, o3)

    _store_state(OUT, LSE_OUT, acc, lse, b, s, hh, cols, row_ok, mask,
                 out_sb, out_ss, out_sh, lo_sb, lo_sh, lo_ss, IN_PLACE)


@triton.jit
def _merge_stacked_kernel(
    O, L, OUT, LSE_OUT,
    n_heads, n_rows,
    o_sn, o_sb, o_ss, o_sh,
    l_sn, l_sb, l_sh, l_ss,
    out_sb, out_ss, out_sh, lo_sb, lo_sh, lo_ss,
    N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IN_PLACE: tl.constexpr,
    BASE2: tl.constexpr,
    PRELOAD: tl.constexpr,
):
    """N states at one stride from each other (`o_sn`, `l_sn` elements): a stacked tensor's states,
    whatever dim they are stacked along. Max first: every lse of the tile is loaded for the max, then
    each state's lse again (a cache hit) with its output, so that no load waits on another state's math
    and no weight has to be picked out of a tile (a cross-lane reduction per state, docs/decisions.md)."""
    b, s, hh, cols, row_ok, mask = _row_tile(n_heads, n_rows, D, BLOCK_R, BLOCK_D)
    l_ptr = L + b * l_sb + hh * l_sh + s * l_ss
    o_ptr = O + (b * o_sb + s * o_ss + hh * o_sh)[:, None] + cols[None, :]
    if PRELOAD:
        lses = ()
        outs = ()
        for i in tl.static_range(N):
            lses = lses + (tl.load(l_ptr, mask=row_ok, other=float("-inf")),)
            outs = outs + (tl.load(o_ptr, mask=mask, other=0.0),)
            l_ptr += l_sn  # pointer steps: no int32 product of a large stride
            o_ptr += o_sn
        lse, acc = _merge_loaded(lses, outs, N, BASE2)
    else:
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        for i in tl.static_range(N):
            m = tl.maximum(m, tl.load(l_ptr, mask=row_ok, other=float("-inf")))
            l_ptr += l_sn
        shift = merge_shift(m)
        l_ptr = L + b * l_sb + hh * l_sh + s * l_ss
        t = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for i in tl.static_range(N):
            w = merge_weight(tl.load(l_ptr, mask=row_ok, other=float("-inf")), shift, BASE2)
            o = tl.load(o_ptr, mask=mask, other=0.0).to(tl.float32)
            t += w
            acc = acc + merge_term(w, o)
            l_ptr += l_sn
            o_ptr += o_sn
        lse, acc = merge_finish(shift, t, acc, BASE2)
    _store_state(OUT, LSE_OUT, acc, lse, b, s, hh, cols, row_ok, mask,
                 out_sb, out_ss, out_sh, lo_sb, lo_sh, lo_ss, IN_PLACE)


@triton.jit
def _tuple_lse(LS, L_SB, L_SH, L_SS, i: tl.constexpr, b, hh, s, row_ok, l_row, SAME_STRIDES: tl.constexpr):
    """State i's lse tile: at the offsets every state shares (SAME_STRIDES: one stride set, one offset
    computed for all), else at its own strides."""
    if SAME_STRIDES:
        lse = tl.load(LS[i] + l_row, mask=row_ok, other=float("-inf")).to(tl.float32)
    else:
        lse = _load_lse(LS[i], b, hh, s, L_SB[i], L_SH[i], L_SS[i], row_ok)
    return lse


@triton.jit
def _tuple_out(OS, O_SB, O_SS, O_SH, i: tl.constexpr, b, hh, s, cols, mask, o_row, SAME_STRIDES: tl.constexpr):
    """State i's out tile, as `_tuple_lse`."""
    if SAME_STRIDES:
        out = tl.load(OS[i] + o_row, mask=mask, other=0.0)
    else:
        out = _load_out(OS[i], b, hh, s, O_SB[i], O_SS[i], O_SH[i], cols, mask)
    return out


@triton.jit
def _merge_tuple_kernel(
    OS, LS, OUT, LSE_OUT,
    n_heads, n_rows,
    O_SB, O_SS, O_SH, L_SB, L_SH, L_SS,
    out_sb, out_ss, out_sh, lo_sb, lo_sh, lo_ss,
    N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IN_PLACE: tl.constexpr,
    BASE2: tl.constexpr,
    PRELOAD: tl.constexpr,
    SAME_STRIDES: tl.constexpr,
):
    """N states anywhere (tuples of tensors `OS`, `LS` and of their strides: one set each with
    SAME_STRIDES): the states of a sequence of separately allocated tensors, more than the four-slot
    kernel takes. Max first, as the stacked kernel: every lse for the max, then each lse again (a cache
    hit) with its output, one exp per state."""
    b, s, hh, cols, row_ok, mask = _row_tile(n_heads, n_rows, D, BLOCK_R, BLOCK_D)
    # (with one stride set, the offsets of a state's rows are computed once for all N: a one-token merge's
    # time is mostly this address arithmetic and the loads' latency)
    o_row = (b * O_SB[0] + s * O_SS[0] + hh * O_SH[0])[:, None] + cols[None, :]
    l_row = b * L_SB[0] + hh * L_SH[0] + s * L_SS[0]
    if PRELOAD:
        lses = ()
        outs = ()
        for i in tl.static_range(N):
            lses = lses + (_tuple_lse(LS, L_SB, L_SH, L_SS, i, b, hh, s, row_ok, l_row, SAME_STRIDES),)
            outs = outs + (_tuple_out(OS, O_SB, O_SS, O_SH, i, b, hh, s, cols, mask, o_row, SAME_STRIDES),)
        lse, acc = _merge_loaded(lses, outs, N, BASE2)
    else:
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        for i in tl.static_range(N):
            m = tl.maximum(m, _tuple_lse(LS, L_SB, L_SH, L_SS, i, b, hh, s, row_ok, l_row, SAME_STRIDES))
        shift = merge_shift(m)
        t = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for i in tl.static_range(N):
            w = merge_weight(_tuple_lse(LS, L_SB, L_SH, L_SS, i, b, hh, s, row_ok, l_row, SAME_STRIDES), shift, BASE2)
            o = _tuple_out(OS, O_SB, O_SS, O_SH, i, b, hh, s, cols, mask, o_row, SAME_STRIDES).to(tl.float32)
            t += w
            acc = acc + merge_term(w, o)
        lse, acc = merge_finish(shift, t, acc, BASE2)
    _store_state(OUT, LSE_OUT, acc, lse, b, s, hh, cols, row_ok, mask,
                 out_sb, out_ss, out_sh, lo_sb, lo_sh, lo_ss, IN_PLACE)


KERNEL_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _flat_out(x: torch.Tensor) -> torch.Tensor:
    """`[..., S, H, D]` -> a `[B, S, H, D]` view (leading dims collapsed without copying)."""
    *_, s, h, d = x.shape
    return x.view(-1, s, h, d)


def _flat_lse(x: torch.Tensor) -> torch.Tensor:
    *_, h, s = x.shape
    return x.view(-1, h, s)


def _state_strides(x: torch.Tensor, dims: int) -> tuple[int, int, int]:
    """The strides of `x` (an out, `dims` 3, or an lse, 2) as `_flat_out`/`_flat_lse` would give them, made
    without a view where there are no leading dims (a decode step's merge pays ~1 us of host time a view):
    a missing batch dim's stride is never used (the batch index is 0), so any value does."""
    st = x.stride()
    if len(st) == dims:
        return (0, *st[:2])
    if len(st) == dims + 1:
        return st[:3]
    flat = _flat_out(x) if dims == 3 else _flat_lse(x)
    return flat.stride()[:3]


def default_config(head_dim: int, n_states: int) -> tuple[int, int]:
    """`(block_rows, num_warps)` used when the caller gives none.

    About 4K elements per state per program keeps enough bytes in flight per SM for a streaming kernel
    without spilling registers (each program holds one fp32 tile per state).
    """
    block_d = next_power_of_2(head_dim)
    target = 4096 if n_states <= 2 else 2048
    block_rows = max(1, target // block_d)
    return block_rows, (8 if block_rows * block_d >= 4096 else 4)


def stacked_config(head_dim: int, n_states: int) -> tuple[int, int]:
    """`(block_rows, num_warps)` of the stacked and tuple kernels: about 2K elements per tile (the
    accumulator and the state being added live at once; the unrolled loads of later states keep bytes in
    flight), 1K beyond 8 states (16 states at 16 rows of d 128: 0.86x the copy's bandwidth, 8 rows 1.00x)."""
    block_d = next_power_of_2(head_dim)
    return max(1, (2048 if n_states <= 8 else 1024) // block_d), 4


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def state_stride(ts: Sequence[torch.Tensor]) -> int | None:
    """The distance in elements between consecutive tensors of `ts` when they are equally spaced views of
    one storage with the same shape, strides and dtype (the states of a stacked tensor, unbound along
    any dim), else None."""
    t0 = ts[0]
    if len(ts) < 2:
        return 0
    size = t0.element_size()
    step, rem = divmod(ts[1].data_ptr() - t0.data_ptr(), size)
    if rem:
        return None
    for i, t in enumerate(ts):
        if (t.dtype != t0.dtype or t.shape != t0.shape or t.stride() != t0.stride()
                or not _shares_memory(t, t0) or t.data_ptr() - t0.data_ptr() != i * step * size):
            return None
    return step


class _Grid:
    """What both launchers share: the destination as `[B, S, H, D]` / `[B, H, S]` views, the grid and
    the launch configuration (None when there is nothing to do)."""

    def __init__(self, out, lse, config, n, block_rows, num_warps, srcs):
        self.out4, self.lse4 = _flat_out(out), _flat_lse(lse)
        batch, seqlen, self.nheads, self.head_dim = self.out4.shape
        self.n_rows = seqlen * self.nheads
        self.empty = batch == 0 or self.n_rows == 0 or self.head_dim == 0
        default_rows, default_warps = config(self.head_dim, n)
        if block_rows is None and out.is_cuda and not self.empty:
            # few rows (decoding, short prefills): smaller tiles, so that more SMs each keep loads in
            # flight, down to a row per program; beyond two states, down to 64 programs per SM, which 64- and
            # 1K-token merges ran faster at (two states gained nothing; docs/decisions.md)
            ctas = (2 if n <= 2 else 64) * sm_count(out.device.index)
            while default_rows > 1 and cdiv(self.n_rows, default_rows) * batch < ctas:
                default_rows //= 2
            tile = default_rows * next_power_of_2(self.head_dim)
            default_warps = max(1, min(default_warps, tile // 256))
        self.block_rows = default_rows if block_rows is None else block_rows
        self.num_warps = default_warps if num_warps is None else num_warps
        self.grid = (cdiv(self.n_rows, self.block_rows), batch)
        held = {src.untyped_storage().data_ptr() for src in srcs}
        self.in_place = any(dst.untyped_storage().data_ptr() in held for dst in (out, lse))

    def dst_args(self) -> list:
        o, l = self.out4, self.lse4
        return [o.stride(0), o.stride(1), o.stride(2), l.stride(0), l.stride(1), l.stride(2)]

    def constants(self, n: int, base2: bool) -> dict:
        return dict(N=n, D=self.head_dim, BLOCK_R=self.block_rows, BLOCK_D=next_power_of_2(self.head_dim),
                    IN_PLACE=self.in_place, BASE2=base2, num_warps=self.num_warps)

    def preload(self, n: int) -> bool:
        """Whether every state's tile fits in registers at once (the kernels then load them all before any
        math: one memory round trip, not one for the lses and one for the outputs)."""
        per_thread = self.block_rows * next_power_of_2(self.head_dim) // (32 * self.num_warps)
        return per_thread * n <= PRELOAD_VALUES


def _launch(
    outs: Sequence[torch.Tensor],
    lses: Sequence[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    block_rows: int | None,
    num_warps: int | None,
    base2: bool = False,
) -> None:
    n = len(outs)
    g = _Grid(out, lse, default_config, n, block_rows, num_warps, (*outs, *lses))
    if g.empty:
        return
    # unused slots repeat state 0; the kernel never touches them (N is a compile-time constant)
    o_args = [*outs, *[outs[0]] * (MAX_STATES_PER_LAUNCH - n)]
    l_args = [*lses, *[lses[0]] * (MAX_STATES_PER_LAUNCH - n)]
    o_strides = [st for x in o_args for st in _state_strides(x, 3)]
    l_strides = [st for x in l_args for st in _state_strides(x, 2)]
    launch(_merge_states_kernel, g.grid, *o_args, *l_args, g.out4, g.lse4, g.nheads, g.n_rows, *o_strides,
           *l_strides, *g.dst_args(), **g.constants(n, base2))


def _launch_stacked(
    n: int,
    out0: torch.Tensor,
    lse0: torch.Tensor,
    o_sn: int,
    l_sn: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    block_rows: int | None,
    num_warps: int | None,
    base2: bool,
) -> None:
    """N states: `out0`/`lse0` (state 0) and each next one `o_sn`/`l_sn` elements further."""
    g = _Grid(out, lse, stacked_config, n, block_rows, num_warps, (out0, lse0))
    if g.empty:
        return
    launch(_merge_stacked_kernel, g.grid, out0, lse0, g.out4, g.lse4, g.nheads, g.n_rows,
           o_sn, *_state_strides(out0, 3), l_sn, *_state_strides(lse0, 2),
           *g.dst_args(), **g.constants(n, base2), PRELOAD=g.preload(n))


def _launch_tuple(
    outs: Sequence[torch.Tensor],
    lses: Sequence[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    block_rows: int | None,
    num_warps: int | None,
    base2: bool,
) -> None:
    n = len(outs)
    g = _Grid(out, lse, stacked_config, n, block_rows, num_warps, (*outs, *lses))
    if g.empty:
        return
    o_st = [_state_strides(x, 3) for x in outs]
    l_st = [_state_strides(x, 2) for x in lses]
    same = o_st.count(o_st[0]) == n and l_st.count(l_st[0]) == n
    if same:  # (the usual sequence: states of one shape and layout)
        o_st, l_st = o_st[:1], l_st[:1]
    _merge_tuple_kernel[g.grid](
        tuple(outs), tuple(lses), g.out4, g.lse4, g.nheads, g.n_rows, *zip(*o_st), *zip(*l_st),
        *g.dst_args(), **g.constants(n, base2), PRELOAD=g.preload(n), SAME_STRIDES=same,
    )


def check_kernel_inputs(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], out: torch.Tensor, lse: torch.Tensor
) -> str | None:
    """Why `merge_states` cannot take these tensors, or None when it can."""
    shape = tuple(out.shape)
    if len(shape) < 3:
        return f"out must be [..., seqlen, nheads, headdim], got {shape}"
    lse_shape = (*shape[:-3], shape[-2], shape[-3])
    for i, (o, l) in enumerate(zip(outs, lses)):
        if tuple(o.shape) != shape or tuple(l.shape) != lse_shape:
            return f"state {i} has shapes {tuple(o.shape)}, {tuple(l.shape)}; expected {shape}, {lse_shape}"
        if o.dtype not in KERNEL_OUT_DTYPES or l.dtype != torch.float32:
            return f"state {i}: out {o.dtype} / lse {l.dtype} (need fp16/bf16/fp32 out and fp32 lse)"
    if out.dtype not in KERNEL_OUT_DTYPES or lse.dtype != torch.float32:
        return f"output out {out.dtype} / lse {lse.dtype} (need fp16/bf16/fp32 out and fp32 lse)"
    if tuple(lse.shape) != lse_shape:
        return f"output lse has shape {tuple(lse.shape)}, expected {lse_shape}"
    devices = {t.device for t in (*outs, *lses, out, lse)}
    if len(devices) != 1:
        return f"tensors on several devices: {sorted(map(str, devices))}"
    for t in (*outs, out):
        if t.numel() and t.stride(-1) != 1:
            return "the head dim of every out must be contiguous (stride 1)"
    if len(shape) > 4:  # (one leading dim or none: nothing to collapse)
        for t in (*outs, out):
            try:
                _flat_out(t)
            except RuntimeError:
                return "the leading dims of an out cannot be viewed as one batch dim"
        for t in (*lses, lse):
            try:
                _flat_lse(t)
            except RuntimeError:
                return "the leading dims of an lse cannot be viewed as one batch dim"
    return None


def merge_states(
    outs: Sequence[torch.Tensor],
    lses: Sequence[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    base2: bool = False,
    stacked: bool | None = None,
    block_rows: int | None = None,
    num_warps: int | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N attention states into `(out, lse)`, reading each input once and writing each output once.

    Args:
        outs: N >= 1 tensors `[..., S, H, D]`, fp16/bf16/fp32, head dim contiguous (other strides free).
        lses: N tensors `[..., H, S]` float32 (any strides: a tokens-first `[..., S, H]` lse is passed
            as its transpose).
        out: destination `[..., S, H, D]`, fp16/bf16/fp32; may be `outs[0]` itself (in-place update).
        lse: destination `[..., H, S]` float32 (any strides); may be `lses[0]` itself.
        base2: every lse, given and written, is in base 2 (the math runs in base 2: exp2/log2).
        stacked: which kernel: the four-slot one (False: beyond four states, the tuple kernel), the
            stacked one (True: needs the states equally spaced in memory, `state_stride`), or None:
            four-slot up to four states, beyond that stacked when the states are equally spaced, else
            the tuple kernel (up to `MAX_TUPLE_STATES`; more chain launches).
        block_rows, num_warps: launch configuration (defaults from `default_config`/`stacked_config`).
        check: run `check_kernel_inputs` (callers that just did may skip it).

    Returns:
        `(out, lse)`, the destinations, holding `lse = logsumexp_i lse_i` and
        `out = sum_i exp(lse_i - lse) * out_i` (`(0, -inf)` where every state is `-inf`).

    More than `MAX_TUPLE_STATES` states that are not equally spaced take several launches through a
    float32 intermediate state.
    """
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"merge_states: need as many lses as outs (>= 1), got {len(outs)} and {len(lses)}")
    reason = check_kernel_inputs(outs, lses, out, lse) if check else None
    if reason is not None:
        raise ValueError(f"merge_states: {reason}")
    outs, lses = list(outs), list(lses)
    k = MAX_STATES_PER_LAUNCH
    if stacked is not False and (stacked or len(outs) > k):
        o_sn = state_stride(outs)
        l_sn = state_stride(lses) if o_sn is not None else None
        if o_sn is not None and l_sn is not None:
            _launch_stacked(len(outs), outs[0], lses[0], o_sn, l_sn, out, lse, block_rows, num_warps, base2)
            return out, lse
        if stacked:
            raise ValueError("merge_states(stacked=True): the states are not equally spaced views of one tensor")
    if len(outs) <= k:
        _launch(outs, lses, out, lse, block_rows, num_warps, base2)
        return out, lse
    if len(outs) <= MAX_TUPLE_STATES:
        _launch_tuple(outs, lses, out, lse, block_rows, num_warps, base2)
        return out, lse
    # chain: merge the first four into a float32 state, then fold the rest in three at a time
    acc_out = torch.empty(out.shape, dtype=torch.float32, device=out.device)
    acc_lse = torch.empty(lse.shape, dtype=torch.float32, device=lse.device)
    _launch(outs[:k], lses[:k], acc_out, acc_lse, block_rows, num_warps, base2)
    i = k
    while len(outs) - i > k - 1:
        _launch([acc_out, *outs[i : i + k - 1]], [acc_lse, *lses[i : i + k - 1]], acc_out, acc_lse, block_rows, num_warps, base2)
        i += k - 1
    _launch([acc_out, *outs[i:]], [acc_lse, *lses[i:]], out, lse, block_rows, num_warps, base2)
    return out, lse


def merge_stacked(
    out0: torch.Tensor,
    lse0: torch.Tensor,
    n: int,
    out_step: int,
    lse_step: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    base2: bool = False,
    block_rows: int | None = None,
    num_warps: int | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_states` of N states given by the first one and the distance to the next (a stacked tensor's,
    `out_step = stacked.stride(dim)`), checked once rather than per state (the host time of a call of a
    few tokens matters: decoding).

    Args:
        out0: state 0's out `[..., S, H, D]`; lse0: its lse `[..., H, S]` (any strides).
        n: how many states; out_step, lse_step: elements from one state's out/lse to the next's.
        out, lse, base2, block_rows, num_warps, check: as in `merge_states`.
    """
    reason = check_kernel_inputs([out0], [lse0], out, lse) if check else None
    if reason is not None:
        raise ValueError(f"merge_stacked: {reason}")
    if n <= MAX_STATES_PER_LAUNCH:
        o_shape, o_st, o_at = out0.shape, out0.stride(), out0.storage_offset()
        l_shape, l_st, l_at = lse0.shape, lse0.stride(), lse0.storage_offset()
        outs = [out0.as_strided(o_shape, o_st, o_at + i * out_step) for i in range(n)]
        lses = [lse0.as_strided(l_shape, l_st, l_at + i * lse_step) for i in range(n)]
        _launch(outs, lses, out, lse, block_rows, num_warps, base2)
    else:
        _launch_stacked(n, out0, lse0, out_step, lse_step, out, lse, block_rows, num_warps, base2)
    return out, lse


def update_state_(
    out: torch.Tensor,
    lse: torch.Tensor,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
    *,
    base2: bool = False,
    block_rows: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge one block state into the running state `(out, lse)` in place (see `merge_states`).

    Args:
        out: running state `[..., S, H, D]` (float32 as a rule), updated in place.
        lse: its lse `[..., H, S]` float32 (any strides), updated in place.
        block_out: `[..., S, H, D]` fp16/bf16/fp32; block_lse: `[..., H, S]` float32.
        base2: both lses in base 2.

    Returns:
        `(out, lse)`.
    """
    return merge_states(
        [out, block_out], [lse, block_lse], out, lse, base2=base2, stacked=False, block_rows=block_rows, num_warps=num_warps
    )
