"""Online softmax, log_softmax and logsumexp over one dim, in Triton, with backward kernels.

Any tensor is seen as `R` rows of `N` columns: the reduced dim is moved last by a view, and the other
dims are folded into at most two (outer, inner) groups with their own strides, so `dim != -1` costs no
copy (only layouts that fold into more than two groups are copied). Row `r` = `o * I + i` starts at
`o * s_o + i * s_i`; column `n` is `n * s_n` further.

Row regimes, chosen once per call layout (a call plan, `_planned`):
- short and medium rows (`N <= TUNING["max_row_block"]`): a program holds `BLOCK_R` whole rows in
  registers: one read, one write, the exact max before a single `exp` per element; rows of contiguous
  columns that start or end off 16-byte boundaries (odd lengths), whose loads Triton narrows to what it
  can prove of the rows' alignment (one element for odd lengths), take one row per program read in
  whole 16-byte vectors, the few elements at its ends one by one (`_fwd_rows_aligned_kernel`; H200,
  bf16 16380 x 4097: 0.78x copy bandwidth cut into cooperative pieces, 0.90x);
- long rows, many of them: one program per row, two passes over the row: pass 1 keeps a running max and
  rescaled sum per lane (one read, no block-wide reduction inside the loop), pass 2 normalises and
  writes, walking the row backwards so that the chunks pass 1 read last are re-read while still in L2;
- long rows, few of them: each row is split into pieces over several programs; a stats kernel writes
  one `(max, sum)` per piece and the normalising kernel merges them (logsumexp: the piece that
  finishes last merges them, in the same launch).
- long rows on a GPU (softmax, log_softmax and their backward; `TUNING["coop_*"]`): the two-pass forms
  read each element twice from memory once the rows in flight outgrow L2 (3 bytes moved per 2 needed,
  at most 2/3 of copy bandwidth). The cooperative kernel keeps each piece of a row in registers
  instead: the pieces of a row are programs that run at the same time, each publishes its `(max, sum)`
  (or backward row sum) as one 64-bit word with a relaxed exchange (no fence, which would wait for the
  program's earlier output stores to drain), polls the row's words until all are there, merges, and
  writes from registers: one read, one write. The forward publishes the next row's word before it
  waits for this row's, so the wait is mostly hidden (H200, fp32 rows of 64K-262K columns: ~0.9x copy
  bandwidth, from 0.77x with a release counter per row and no pipelining). The grid is sized from the
  compiled kernel's occupancy (`occupancy.py`) and launched as a cooperative grid, so every program is
  resident at once (a program waits only on programs that are running); the Triton interpreter runs
  programs one after another, so there (CPU) the other paths are used, except for rows of one piece.
  bf16/fp16 rows are read and written as int32 words of two elements, so that the three row pieces a
  program carries take a register per two elements (H200, 512 x 131072 bf16: 0.73 -> 0.85x copy, with a
  register cap); rows of more than `coop_long_pieces` pieces take longer pieces ("_long" knobs: H200,
  64 x 1M fp32: 0.75 -> 0.92x copy). Rows that start or end off 16-byte boundaries (odd lengths), whose
  loads Triton narrows to the rows' alignment, take kernels whose pieces hold the row's whole 16-byte
  vectors and whose piece 0 reads and writes the few elements at the row's ends one by one
  (`_fwd_coop_aligned_kernel`, `_bwd_coop_aligned_kernel`; H200, bf16 1300 x 50257: 0.56 -> 0.78x copy);
  on sm_90 the aligned forward also asks L2 (a bulk prefetch, no registers) for the row after the one
  it loads (0.80 -> 0.84x there). bf16 softmax keeps the exps each piece computes for its statistics,
  as fp16 words in place of its input words, so that its output is one multiply per element instead
  of a second exp (`_piece_exps`; H200, x copy, eager: 1300 x 50257 0.84 -> 0.86, 512 x 131072 0.85
  -> 0.89), for 2^-11 relative error before the output's bf16 rounding.
  2-byte logsumexp of such rows runs the aligned forward without its output (MODE 2: piece 0 writes
  the lse; H200, bf16 16384 x 4097: 3.90 -> 6.45x `torch.logsumexp`).
  The forward's programs may take the rows' pieces in turn as tasks over every resident program
  rather than whole rows in flight, where that takes fewer steps (and for logsumexp, so that piece 0,
  which alone waits, is not always the same program): `_tasks_grid`.

All arithmetic is float32 whatever the input dtype (fp32/bf16/fp16), outputs are in the input dtype.
An all `-inf` row gives softmax 0, log_softmax `-inf`, logsumexp `-inf`, and no NaN anywhere, forward
or backward.
"""

from __future__ import annotations

import functools
import os
import threading

import torch
import triton
import triton.language as tl

from ringlse.kernels.host import cdiv, next_power_of_2
from ringlse.kernels.launch import FREE, BoundLaunch, _raw_stream
from ringlse.kernels.occupancy import blocks_per_sm_by_driver, blocks_per_sm_by_rules

# constexpr globals: the only kind a @triton.jit function may read
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

_SOFTMAX: int = 0
_LOG_SOFTMAX: int = 1
_LOGSUMEXP: int = 2


class _Knobs(dict):
    """A dict that counts its changes: a call plan depends on the knobs, and its key holds this count
    instead of every value (hashing ~50 values cost ~1.5 us of host time per call)."""

    version = 0

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.version += 1

    def __delitem__(self, key):
        super().__delitem__(key)
        self.version += 1

    def __ior__(self, other):
        self.update(other)
        return self

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        self.version += 1

    def clear(self):
        super().clear()
        self.version += 1

    def pop(self, *args):
        self.version += 1
        return super().pop(*args)

    def popitem(self):
        self.version += 1
        return super().popitem()

    def setdefault(self, key, default=None):
        self.version += 1
        return super().setdefault(key, default)


# Dispatch knobs, read when a call is planned (the benchmark and the tests change them; a change takes
# effect at the next call). Defaults = the winners of the tuning sweep in
# benchmarks/results/lse_toolkit-nvidia-h200.json
TUNING: _Knobs = _Knobs({
    "max_row_block": 32768,  # forward: rows up to this many columns stay in registers
    # the same for bf16/fp16: longer rows take the cooperative kernel, which reads them as pairs
    # (H200, 2048 x 32768 bf16: 0.75x copy in the row kernel, 0.85x cooperative)
    "max_row_block_16": 16384,
    "max_row_block_bwd": 16384,  # backward holds two rows (y and g), so half of that
    "tile": 4096,  # elements per program for short rows (several rows per program)
    # rows of at most this many (padded) columns: smaller tiles of 2 warps (measured on H200, graph
    # replay, 32M elements: 1M x 97 fp32 softmax 145 -> 77 us, 112K x 300 92 -> 66 us)
    "short_cols": 1024,
    "short_tile": 1024,
    "chunk": 4096,  # columns per step of the long-row loops
    "chunk_warps": 8,
    "row_warps": None,  # None: chosen from the tile size
    "split_rows": None,  # fewer rows than this split each row over programs; None: 2 x SMs
    # long rows on a GPU: cooperative pieces held in registers (0: the two-pass paths), columns per
    # program and its warps; forward and backward apart (the backward holds two inputs per piece)
    "coop_fwd": 1,
    "coop_piece_fwd": 1024,
    "coop_warps_fwd": 2,
    "coop_piece_fwd_16": 2048,  # 2-byte dtypes
    "coop_warps_fwd_16": 1,
    "coop_bwd": 1,
    "coop_piece_bwd": 4096,
    "coop_warps_bwd": 4,
    "coop_piece_bwd_16": 4096,
    "coop_warps_bwd_16": 4,
    # register caps (None: as many as the compiler takes). bf16/fp16: 168 fitted three warps per
    # scheduler where the compiler took 196 and fitted two (H200, 512 x 131072 bf16 as pairs: 0.72 -> 0.83x
    # copy in a probe; 0.85x in the recorded run, with the exponent as one FMA). Since the pieces' max
    # is taken on the packed words, 1024-column pieces capped at 96 and 2048 capped at 168 are within
    # 1% in the sweep's GPU time (1024/96 faster on bf16 2048 x 32767, 2048/168 on 1300 x 50257), and
    # successive sweeps picked either
    "coop_maxnreg_fwd": None,
    "coop_maxnreg_fwd_16": 168,
    "coop_maxnreg_bwd": None,
    "coop_maxnreg_bwd_16": None,
    # the float32 forward's plan for rows of more than `coop_long_pieces` pieces or too long for
    # `coop_min_slots` rows in flight (`_coop_launch`)
    "coop_min_slots": 2,
    # the forward's grid: every resident program taking the rows' pieces in turn, or whole rows in
    # flight (`_tasks_grid`: 0 whole rows, 1 whichever takes fewer steps, 2 tasks)
    "coop_tasks_fwd": 1,
    "coop_long_pieces": 128,
    "coop_piece_fwd_long": 4096,
    "coop_warps_fwd_long": 4,
    "coop_maxnreg_fwd_long": 128,
    "coop_max_pieces": 512,
    "coop_min_rows": 64,
    # ... or, forward only, at least this many elements (H200, 32 x 2M fp32: 0.60x copy in the split
    # launches, 0.90x cooperative)
    "coop_min_elems_fwd": 1 << 25,
    # launch them as cooperative grids: the driver then places every program of the grid at once or
    # refuses the launch. Without it a program could spin on a piece that another kernel (on another
    # stream) keeps from being scheduled while that kernel waits the same way. Costs 2-3% on H200.
    "coop_launch": 1,
    # 2-byte rows read and written as int32 words of two elements (`_fwd_coop_kernel`, PACK)
    "coop_pack": 1,
    # rows of contiguous columns off 16-byte boundaries in 16-byte vectors whatever their length and
    # start (`_fwd_coop_aligned_kernel`, `_bwd_coop_aligned_kernel`; 0: `_fwd_coop_kernel` and
    # `_bwd_coop_kernel`, whose loads narrow to the rows' alignment: one element for odd lengths)
    "coop_aligned": 1,
    # rows off the boundaries with at least this many columns take them even when short enough for the
    # row kernels, whose loads narrow the same way (H200, x the same tensor's copy: float32 16384 x 4097
    # 0.70 -> 0.92x, 4096 x 16383 0.72 -> 0.92x, but 32768 x 2049 0.90 -> 0.87x; bf16 65536 x 1025
    # 0.58 -> 0.87x, 16384 x 4097 0.43 -> 0.83x, but 131072 x 513 0.65 -> 0.53x); since
    # `aligned_rows`, only the backward (and the forward with `aligned_rows` off)
    "aligned_min_cols": 4096,
    "aligned_min_cols_16": 1024,
    # the cooperative kernels' pieces halved where a row would fill them less than this, or (2-byte
    # forward) where a row is cut into fewer pieces (`_coop_plan`)
    "coop_min_fill": 0.85,
    # (17: rows of 16 pieces of 2048 columns too, with halved pieces capped at 96 registers, 21 warps an SM;
    # H200, GPU time, x copy: bf16 2048 x 32768 0.87 -> 0.89, 2048 x 32767 0.79 -> 0.84, 2730 x 24575
    # 0.80 -> 0.84, 1600 x 20001 0.72 -> 0.74; their logsumexp of 32767 columns 1.54 -> 1.43 half copies)
    "coop_min_pieces_fwd_16": 17,
    "coop_maxnreg_fwd_16_halved": 96,  # the register cap of halved 2-byte forward pieces
    # the aligned forward (softmax, log_softmax) asks L2 for the row after the one it loads
    # (`_fwd_coop_aligned_kernel`, L2_AHEAD; sm_90 on)
    "coop_l2_ahead": 1,
    # bf16 softmax: the cooperative forward keeps each piece's exps (fp16 words) for its output, a
    # multiply per element instead of a second exp (`_piece_exps`)
    "coop_exps_16": 1,
    # 2-byte logsumexp of rows off the boundaries through the aligned forward (its MODE 2) rather than
    # element by element (H200, kernel alone, x a copy's bandwidth, eager / GPU time: bf16 16384 x 4097
    # 0.36/0.37 -> 0.59/0.66, 65536 x 1025 0.31/0.32 -> 0.63/0.73, 1300 x 50257 0.45/0.52 -> 0.61/0.68;
    # 4096 x 16383 0.49/0.57 -> 0.47/0.51). Float32 rows keep the row and chunk kernels: through the
    # public function they measured slower this way (8192 x 8191: 7.1x -> 5.3x torch.logsumexp)
    "aligned_lse": 1,
    # forward and logsumexp of rows off the boundaries short enough for registers (`max_row_block*`),
    # from `aligned_rows_min_cols` columns up: one row per program, the whole row in registers
    # (`_fwd_rows_aligned_kernel`), rather than cut into cooperative pieces (H200, softmax, x a copy's
    # bandwidth, eager: bf16 16380 x 4097 0.78 -> 0.90, 65472 x 1025 0.80 -> 0.90, 8193 x 8191
    # 0.76 -> 0.88; float32 16380 x 4097 0.90 -> 0.93; float32 logsumexp 16380 x 4097 0.70 -> 0.87 of
    # half a copy; bf16 rows of 257: 0.52 element by element, 0.39 here)
    "aligned_rows": 1,
    "aligned_rows_min_cols": 512,
    "aligned_rows_warps": None,  # None: ~32 elements a thread (`_aligned_forward`)
    # 2-byte blocks of at least this many elements: 64 elements a thread, registers capped so that an
    # SM holds three programs (H200, bf16 4096 x 16383, 8 warps: 94 registers uncapped, two programs,
    # 0.84x copy eager / 0.88x GPU time; capped at 80, 0.88x / 0.93x; 16 warps 0.84x / 0.89x)
    "aligned_rows_wide_16": 16384,
    "aligned_rows_wide_maxnreg": 80,
    # long rows in one launch, stats and normalising programs interleaved (`_fwd_lookback_kernel`,
    # `_bwd_lookback_kernel`; where the cooperative kernels do not apply): on/off, columns per program,
    # per chunk, warps, most pieces per row, bytes per group of rows. Off: since the cooperative
    # kernels take every row count >= coop_min_rows, what is left are few long rows, where the split
    # stats + normalise launches measured faster in GPU time (H200, 4x1M fp32: 13.7 against 18.4 us)
    "lookback_fwd": 0,
    "lookback_bwd": 0,
    "lb_piece": 8192,
    "lb_block": 2048,
    "lb_warps": 8,
    "lb_max_pieces": 256,
    "lb_group_bytes": 1 << 20,
})


# ----------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _row_start(rows, I, s_o, s_i):
    """Element offset (int64) of the first column of each row `rows` (row = o * I + i)."""
    r = tl.cast(rows, tl.int64)  # (tl.cast: a loop index is a plain int under the interpreter)
    o = r // I
    return o * s_o + (r - o * I) * s_i


@triton.jit
def _col_offsets(cols, s_n, COL64: tl.constexpr):
    # int32 offsets keep the address arithmetic cheap; COL64 when N * s_n could overflow them
    if COL64:
        return cols.to(tl.int64) * s_n
    else:
        return cols * s_n


@triton.jit
def _online_update(m, s, x):
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
def _merge_lanes(m, s):
    """Merge per-lane (or per-piece) `(m, s)` into one `(M, S)`: M the max (-inf if all are), S the sum
    of exp(x - M_safe) with M_safe = 0 for an all -inf row, so that S = 0 there and log(S) = -inf."""
    M = tl.max(m, axis=0)
    M_safe = tl.where(M == float("-inf"), 0.0, M)
    S = tl.sum(s * tl.exp2((m - M_safe) * LOG2E), axis=0)
    return M, S


@triton.jit
def _merge_partials(pm_ptr, ps_ptr, base, K, KB: tl.constexpr):
    """Merge the K per-piece `(max, sum)` stored from `base` on. `.cg`: read them from L2, never from a
    stale L1 line (other programs of the same launch may have written them)."""
    offs = tl.arange(0, KB)
    pm = tl.load(pm_ptr + base + offs, mask=offs < K, other=float("-inf"), cache_modifier=".cg")
    ps = tl.load(ps_ptr + base + offs, mask=offs < K, other=0.0, cache_modifier=".cg")
    return _merge_lanes(pm, ps)


@triton.jit
def _piece_stats(x_ptr, start, c0, c1, s_n, BLOCK_N: tl.constexpr, COL64: tl.constexpr):
    """(M, S) of columns [c0, c1) of the row at element offset `start`: one read, chunk by chunk."""
    cols = tl.arange(0, BLOCK_N)
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_N], tl.float32)
    for c in range(c0, c1, BLOCK_N):
        cc = c + cols
        x = tl.load(x_ptr + start + _col_offsets(cc, s_n, COL64), mask=cc < c1, other=float("-inf"))
        m, s = _online_update(m, s, x.to(tl.float32))
    return _merge_lanes(m, s)


@triton.jit
def _fwd_rows_kernel(
    x_ptr, y_ptr, lse_ptr, R, N, I,
    sx_o, sx_i, sx_n, sy_o, sy_i, sy_n,
    MODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, COL64: tl.constexpr,
):
    """BLOCK_R whole rows per program, held in registers: exact max, one exp per element, one write."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < R
    mask = rmask[:, None] & (cols < N)[None, :]
    xs = _row_start(rows, I, sx_o, sx_i)
    x = tl.load(x_ptr + xs[:, None] + _col_offsets(cols, sx_n, COL64)[None, :], mask=mask, other=float("-inf"))
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
        ys = _row_start(rows, I, sy_o, sy_i)
        tl.store(y_ptr + ys[:, None] + _col_offsets(cols, sy_n, COL64)[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_stats_kernel(
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
    start = _row_start(row, I, sx_o, sx_i)
    c0 = p * PIECE
    M, S = _piece_stats(x_ptr, start, c0, tl.minimum(c0 + PIECE, N), sx_n, BLOCK_N, COL64)
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
            M, S = _merge_partials(pm_ptr, ps_ptr, row * NP, NP, NP_BLOCK)
            tl.store(lse_ptr + row, tl.where(M == float("-inf"), 0.0, M) + tl.log2(S) * LN2)
            tl.atomic_xchg(cnt_ptr + row, 0)


@triton.jit
def _fwd_long_kernel(
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
    xs = _row_start(row, I, sx_o, sx_i)
    ys = _row_start(row, I, sy_o, sy_i)
    if FUSED:
        M, S = _piece_stats(x_ptr, xs, 0, N, sx_n, BLOCK_N, COL64)
    else:
        M, S = _merge_partials(pm_ptr, ps_ptr, row * NP, NP, NP_BLOCK)
    c0 = p * PIECE
    _normalise_piece(x_ptr, y_ptr, xs, ys, c0, tl.minimum(c0 + PIECE, N), sx_n, sy_n, M, S, MODE, BLOCK_N, COL64)


@triton.jit
def _normalise_piece(x_ptr, y_ptr, xs, ys, c0, c1, sx_n, sy_n, M, S,
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
        x = tl.load(x_ptr + xs + _col_offsets(cc, sx_n, COL64), mask=mask, other=float("-inf")).to(tl.float32)
        if MODE == 0:
            y = tl.exp2((x - M) * LOG2E) * inv
        else:
            y = x - lse
        tl.store(y_ptr + ys + _col_offsets(cc, sy_n, COL64), y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_rows_kernel(
    y_ptr, g_ptr, dx_ptr, R, N, I,
    sy_o, sy_i, sy_n, sg_o, sg_i, sg_n, sd_o, sd_i, sd_n,
    LOG: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, COL64: tl.constexpr,
):
    """Whole rows in registers. softmax: dx = y (g - sum(g y)); log_softmax: dx = g - exp(y) sum(g)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < R)[:, None] & (cols < N)[None, :]
    ystart = _row_start(rows, I, sy_o, sy_i)
    gstart = _row_start(rows, I, sg_o, sg_i)
    y_other = float("-inf") if LOG else 0.0  # padding that contributes exp(y) = 0 or y = 0
    y = tl.load(y_ptr + ystart[:, None] + _col_offsets(cols, sy_n, COL64)[None, :], mask=mask, other=y_other)
    g = tl.load(g_ptr + gstart[:, None] + _col_offsets(cols, sg_n, COL64)[None, :], mask=mask, other=0.0)
    y = y.to(tl.float32)
    g = g.to(tl.float32)
    if LOG:
        dx = g - tl.exp2(y * LOG2E) * tl.sum(g, axis=1)[:, None]
    else:
        dx = y * (g - tl.sum(g * y, axis=1)[:, None])
    dstart = _row_start(rows, I, sd_o, sd_i)
    tl.store(dx_ptr + dstart[:, None] + _col_offsets(cols, sd_n, COL64)[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_piece_sum(y_ptr, g_ptr, ystart, gstart, c0, c1, sy_n, sg_n, LOG: tl.constexpr,
                   BLOCK_N: tl.constexpr, COL64: tl.constexpr):
    """sum(g) (log_softmax) or sum(g * y) (softmax) over columns [c0, c1)."""
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for c in range(c0, c1, BLOCK_N):
        cc = c + cols
        mask = cc < c1
        g = tl.load(g_ptr + gstart + _col_offsets(cc, sg_n, COL64), mask=mask, other=0.0).to(tl.float32)
        if LOG:
            acc += g
        else:
            y = tl.load(y_ptr + ystart + _col_offsets(cc, sy_n, COL64), mask=mask, other=0.0).to(tl.float32)
            acc += g * y
    return tl.sum(acc, axis=0)


@triton.jit
def _bwd_partial_kernel(
    y_ptr, g_ptr, part_ptr, N, I, sy_o, sy_i, sy_n, sg_o, sg_i, sg_n, PIECE, NP,
    LOG: tl.constexpr, BLOCK_N: tl.constexpr, COL64: tl.constexpr,
):
    """Per-piece partial of the backward row sum (split rows)."""
    row = tl.program_id(0)
    p = tl.program_id(1)
    c0 = p * PIECE
    part = _bwd_piece_sum(
        y_ptr, g_ptr, _row_start(row, I, sy_o, sy_i), _row_start(row, I, sg_o, sg_i),
        c0, tl.minimum(c0 + PIECE, N), sy_n, sg_n, LOG, BLOCK_N, COL64,
    )
    tl.store(part_ptr + row * NP + p, part)


@triton.jit
def _bwd_long_kernel(
    y_ptr, g_ptr, dx_ptr, part_ptr, N, I,
    sy_o, sy_i, sy_n, sg_o, sg_i, sg_n, sd_o, sd_i, sd_n, PIECE, NP,
    LOG: tl.constexpr, FUSED: tl.constexpr, NP_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    COL64: tl.constexpr,
):
    """Backward of piece `program_id(1)` of row `program_id(0)`; the row sum is computed here (FUSED)
    or merged from the partial kernel's pieces. The write pass walks backwards, as in the forward."""
    row = tl.program_id(0)
    p = tl.program_id(1)
    ystart = _row_start(row, I, sy_o, sy_i)
    gstart = _row_start(row, I, sg_o, sg_i)
    dstart = _row_start(row, I, sd_o, sd_i)
    if FUSED:
        total = _bwd_piece_sum(y_ptr, g_ptr, ystart, gstart, 0, N, sy_n, sg_n, LOG, BLOCK_N, COL64)
    else:
        offs = tl.arange(0, NP_BLOCK)
        total = tl.sum(tl.load(part_ptr + row * NP + offs, mask=offs < NP, other=0.0), axis=0)
    c0 = p * PIECE
    _bwd_write_piece(y_ptr, g_ptr, dx_ptr, ystart, gstart, dstart, c0, tl.minimum(c0 + PIECE, N), sy_n, sg_n, sd_n,
                     total, LOG, BLOCK_N, COL64)


@triton.jit
def _bwd_write_piece(y_ptr, g_ptr, dx_ptr, ystart, gstart, dstart, c0, c1, sy_n, sg_n, sd_n, total,
                     LOG: tl.constexpr, BLOCK_N: tl.constexpr, COL64: tl.constexpr):
    """dx of columns [c0, c1) from the row sum `total`, walking backwards as the forward does."""
    n_chunks = tl.cdiv(c1 - c0, BLOCK_N)
    cols = tl.arange(0, BLOCK_N)
    y_other = float("-inf") if LOG else 0.0
    for i in range(0, n_chunks):
        cc = c0 + (n_chunks - 1 - i) * BLOCK_N + cols
        mask = cc < c1
        y = tl.load(y_ptr + ystart + _col_offsets(cc, sy_n, COL64), mask=mask, other=y_other).to(tl.float32)
        g = tl.load(g_ptr + gstart + _col_offsets(cc, sg_n, COL64), mask=mask, other=0.0).to(tl.float32)
        if LOG:
            dx = g - tl.exp2(y * LOG2E) * total
        else:
            dx = y * (g - total)
        tl.store(dx_ptr + dstart + _col_offsets(cc, sd_n, COL64), dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lookback_phase(pid, per_phase, N_GROUPS):
    """(is_stats, group, index in the phase) of program `pid` of a look-back launch.

    Phases of `per_phase` programs: stats of group 0, stats of group 1, normalise group 0, stats of
    group 2, normalise group 1, ..., normalise the last group."""
    j = pid // per_phase
    half = (j + 1) // 2
    is_stats = (j == 0) | ((j % 2 == 1) & (half < N_GROUPS))
    group = tl.where(is_stats, half, tl.where(j % 2 == 0, j // 2 - 1, N_GROUPS - 1))
    return is_stats, group, pid - j * per_phase


@triton.jit
def _count_piece(cnt_ptr, row):
    tl.debug_barrier()  # every thread's partial stores before the count (release)
    tl.atomic_add(cnt_ptr + row, 1, sem="release", scope="gpu")


@triton.jit
def _await_pieces(cnt_ptr, row, K):
    seen = tl.atomic_add(cnt_ptr + row, 0, sem="acquire", scope="gpu")
    while seen < K:
        seen = tl.atomic_add(cnt_ptr + row, 0, sem="acquire", scope="gpu")


@triton.jit
def _release_row(cnt_ptr, row, R, K):
    """The last normaliser of a row (all are past their wait) leaves its two counters at 0."""
    done = tl.atomic_add(cnt_ptr + R + row, 1, scope="gpu")
    if done == K - 1:
        tl.atomic_xchg(cnt_ptr + row, 0, scope="gpu")
        tl.atomic_xchg(cnt_ptr + R + row, 0, scope="gpu")


@triton.jit
def _fwd_lookback_kernel(
    x_ptr, y_ptr, pm_ptr, ps_ptr, cnt_ptr, R, N, I,
    sx_o, sx_i, sx_n, sy_o, sy_i, sy_n, PIECE, K, GROUP_ROWS, N_GROUPS,
    MODE: tl.constexpr, KB: tl.constexpr, BLOCK_N: tl.constexpr, COL64: tl.constexpr,
):
    """Long rows in one launch, stats and normalising programs interleaved by groups of rows.

    Programs come in phases of `GROUP_ROWS * K` (K pieces per row, see `_lookback_phase`). A stats
    program publishes its piece's `(max, sum)` and counts it on the row's counter; a normalising
    program waits for the row's K counts, merges, and re-reads its piece, which a stats program read
    shortly before, so that it is likely to come from L2. A program only ever waits on programs with
    smaller ids, which the GPU dispatched before it and which wait on nothing, so the wait always ends
    (the forward-progress argument of decoupled look-back scans); the interpreter runs programs in id
    order and never waits at all. One launch, whatever the number of rows: few long rows pay one
    launch's host time, not two.
    """
    is_stats, group, q = _lookback_phase(tl.program_id(0), GROUP_ROWS * K, N_GROUPS)
    row = group * GROUP_ROWS + q // K
    p = q % K
    if row < R:
        xs = _row_start(row, I, sx_o, sx_i)
        c0 = p * PIECE
        c1 = tl.minimum(c0 + PIECE, N)
        if is_stats:
            M, S = _piece_stats(x_ptr, xs, c0, c1, sx_n, BLOCK_N, COL64)
            tl.store(pm_ptr + row * K + p, M)
            tl.store(ps_ptr + row * K + p, S)
            _count_piece(cnt_ptr, row)
        else:
            _await_pieces(cnt_ptr, row, K)
            M, S = _merge_partials(pm_ptr, ps_ptr, row * K, K, KB)
            _normalise_piece(x_ptr, y_ptr, xs, _row_start(row, I, sy_o, sy_i), c0, c1, sx_n, sy_n, M, S,
                             MODE, BLOCK_N, COL64)
            _release_row(cnt_ptr, row, R, K)


@triton.jit
def _bwd_lookback_kernel(
    y_ptr, g_ptr, dx_ptr, part_ptr, cnt_ptr, R, N, I,
    sy_o, sy_i, sy_n, sg_o, sg_i, sg_n, sd_o, sd_i, sd_n, PIECE, K, GROUP_ROWS, N_GROUPS,
    LOG: tl.constexpr, KB: tl.constexpr, BLOCK_N: tl.constexpr, COL64: tl.constexpr,
):
    """The backward in the look-back form: stats programs publish their piece of the row sum
    (sum(g * y), or sum(g) for log_softmax), normalising programs re-read y and g and write dx."""
    is_stats, group, q = _lookback_phase(tl.program_id(0), GROUP_ROWS * K, N_GROUPS)
    row = group * GROUP_ROWS + q // K
    p = q % K
    if row < R:
        ystart = _row_start(row, I, sy_o, sy_i)
        gstart = _row_start(row, I, sg_o, sg_i)
        c0 = p * PIECE
        c1 = tl.minimum(c0 + PIECE, N)
        if is_stats:
            tl.store(part_ptr + row * K + p,
                     _bwd_piece_sum(y_ptr, g_ptr, ystart, gstart, c0, c1, sy_n, sg_n, LOG, BLOCK_N, COL64))
            _count_piece(cnt_ptr, row)
        else:
            _await_pieces(cnt_ptr, row, K)
            offs = tl.arange(0, KB)
            total = tl.sum(tl.load(part_ptr + row * K + offs, mask=offs < K, other=0.0, cache_modifier=".cg"), axis=0)
            _bwd_write_piece(y_ptr, g_ptr, dx_ptr, ystart, gstart, _row_start(row, I, sd_o, sd_i), c0, c1,
                             sy_n, sg_n, sd_n, total, LOG, BLOCK_N, COL64)
            _release_row(cnt_ptr, row, R, K)


@triton.jit
def _pack_word(a, b):
    """Two float32 values as one int64 word (a high, b low). A NaN in b becomes the positive quiet NaN,
    so that no result ever equals the unpublished word -1 (all bits set)."""
    b = tl.where(b == b, b, float("nan"))
    hi = a.to(tl.int32, bitcast=True).to(tl.int64)
    lo = b.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    return (hi << 32) | lo


@triton.jit
def _publish_word(w_ptr, word):
    """Store a piece's word for the other pieces of its row: a relaxed gpu-scope exchange whose result
    is never read, so the program does not wait for it. The word is all they read, so nothing needs
    ordering before it: a release (a fence) would first wait for this program's earlier output stores
    to drain to memory, and that wait was on every row's critical path."""
    tl.atomic_xchg(w_ptr, word, sem="relaxed", scope="gpu")


@triton.jit
def _await_words(w_ptr, base, K, KB: tl.constexpr):
    """Poll the K words of a row from `base` on (volatile loads: from L2, never a stale L1 line) until
    every piece has published its own; returns them unpacked as (a, b), padded with (-inf, 0)."""
    offs = tl.arange(0, KB)
    w = tl.load(w_ptr + base + offs, mask=offs < K, other=0, volatile=True)
    pending = w == -1
    while tl.sum(pending.to(tl.int32), axis=0) > 0:
        # only the words still missing are read again (a row of many pieces would otherwise re-read
        # all K words on every poll, from all K programs)
        w = tl.where(pending, tl.load(w_ptr + base + offs, mask=pending, other=-1, volatile=True), w)
        pending = w == -1
    a = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    b = w.to(tl.int32).to(tl.float32, bitcast=True)
    return tl.where(offs < K, a, float("-inf")), tl.where(offs < K, b, 0.0)


@triton.jit
def _unpack_pair(w, PACK: tl.constexpr):
    """An int32 word holding two 16-bit floats (bf16 when PACK == 1, fp16 when 2) as float32 (low, high)."""
    if PACK == 1:  # a bf16 is the top half of the float32 with the same value
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & -65536).to(tl.float32, bitcast=True)
    else:
        lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _pack_pair(lo, hi, PACK: tl.constexpr, ASM: tl.constexpr):
    """Two float32 tensors rounded to bf16 (PACK == 1) or fp16 (2) as int32 words (lo in the low half).

    ASM (compiled only): one `cvt` per pair, a packed conversion on the ALU. Converted one by one, each
    element took an F2F on the unit that also computes the exps (measured on H200: that unit 57% busy,
    bf16 softmax forward at 0.69x copy)."""
    if ASM:
        if PACK == 1:
            w = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:
            w = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi],
                                          dtype=tl.int32, is_pure=True, pack=1)
    else:
        if PACK == 1:
            lo16 = lo.to(tl.bfloat16).to(tl.int16, bitcast=True)
            hi16 = hi.to(tl.bfloat16).to(tl.int16, bitcast=True)
        else:
            lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True)
            hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True)
        w = (hi16.to(tl.int32) << 16) | (lo16.to(tl.int32) & 0xFFFF)
    return w


@triton.jit
def _max_bf16x2(a, b):
    return tl.inline_asm_elementwise("max.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _max_f16x2(a, b):
    return tl.inline_asm_elementwise("max.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _piece_max_sum(v, PACK: tl.constexpr, ASM: tl.constexpr = False):
    """(max, sum of exp(x - max)) over a piece held as loaded: elements, or words of two (PACK).

    ASM (compiled only, PACK): the max over the words as they are, two 16-bit values per instruction
    (a 16-bit float widens to float32 exactly and in order, so the max is the same), one instruction
    per word where the float32 max took two."""
    if PACK:
        # exp2(x * log2 e - m * log2 e): one FMA per element. Its error, ~|m| * 1e-7 relative, is far
        # below a 16-bit output's rounding (4e-3 for bf16)
        lo, hi = _unpack_pair(v, PACK)
        if ASM:
            if PACK == 1:
                mw = tl.reduce(v, 0, _max_bf16x2)
            else:
                mw = tl.reduce(v, 0, _max_f16x2)
            mlo, mhi = _unpack_pair(mw, PACK)
            m = tl.maximum(mlo, mhi)
        else:
            m = tl.maximum(tl.max(lo, axis=0), tl.max(hi, axis=0))
        mc = tl.where(m == float("-inf"), 0.0, m) * LOG2E
        s = tl.sum(tl.exp2(lo * LOG2E - mc) + tl.exp2(hi * LOG2E - mc), axis=0)
    else:
        x = v.to(tl.float32)
        m = tl.max(x, axis=0)
        s = tl.sum(tl.exp2((x - tl.where(m == float("-inf"), 0.0, m)) * LOG2E), axis=0)
    return m, s


@triton.jit
def _unpack_f16_pair(w, ASM: tl.constexpr):
    """An int32 word of two fp16 as float32 (low, high); ASM (compiled only): a `cvt` per half."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }", "=r,=r,r", [w],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    return _unpack_pair(w, 2)


@triton.jit
def _piece_exps(v, ASM: tl.constexpr):
    """`_piece_max_sum` of a piece of bf16 words, and the piece's exps kept for its output (EXPS):
    (max, sum, exps, shift). The exps are `exp(x - max) * 2^15` as fp16 words of two (a register per
    two, as the words they replace), shift = max * log2(e) - 15 (0 - 15 for an all -inf piece).

    Why: the output is then one multiply per element (`_output_of_exps`), where it took a second
    exp (one FMA and one MUFU.EX2, on the unit that is a quarter of the FMA pipe's width). The 2^15
    keeps exps down to 2^-29 normal in fp16 (2^-11 relative; below, 2^-40 absolute): with the bf16
    rounding of the output (2^-9 relative), within 0.63 ulp of the exact value for every output
    above 2^-29 of its piece's largest."""
    lo, hi = _unpack_pair(v, 1)
    if ASM:
        mlo, mhi = _unpack_pair(tl.reduce(v, 0, _max_bf16x2), 1)
        m = tl.maximum(mlo, mhi)
    else:
        m = tl.maximum(tl.max(lo, axis=0), tl.max(hi, axis=0))
    shift = tl.where(m == float("-inf"), 0.0, m) * LOG2E - 15.0
    elo = tl.exp2(lo * LOG2E - shift)
    ehi = tl.exp2(hi * LOG2E - shift)
    s = tl.sum(elo + ehi, axis=0) * (1.0 / 32768.0)
    return m, s, _pack_pair(elo, ehi, 2, ASM), shift


@triton.jit
def _output_of_exps(e, shift, M, S, ASM: tl.constexpr):
    """softmax of a piece from its exps (`_piece_exps`) given its row's max M and sum S, as bf16 words:
    `exp(x - M) / S = e * 2^(shift - M log2 e) / S`, 0 for an all -inf row (S = 0)."""
    M_safe = tl.where(M == float("-inf"), 0.0, M)
    c = tl.where(S > 0.0, tl.exp2(shift - M_safe * LOG2E - tl.log2(tl.where(S > 0.0, S, 1.0))), 0.0)
    lo, hi = _unpack_f16_pair(e, ASM)
    return _pack_pair(lo * c, hi * c, 1, ASM)


@triton.jit
def _normalised(x, M_safe, S, MODE: tl.constexpr):
    """softmax (MODE 0) or log_softmax of float32 x given its row's max (0 for an all -inf row) and sum."""
    if MODE == 0:
        return tl.where(S > 0.0, tl.exp2((x - M_safe) * LOG2E - tl.log2(tl.where(S > 0.0, S, 1.0))), 0.0)
    else:
        return x - tl.where(S > 0.0, M_safe + tl.log2(S) * LN2, 0.0)


@triton.jit
def _piece_output(x, pm, ps, MODE: tl.constexpr, PACK: tl.constexpr, ASM: tl.constexpr, out_ty: tl.constexpr):
    """softmax (MODE 0) or log_softmax of a piece held as loaded (elements, or words of two: PACK),
    given its row's per-piece words (pm, ps); the values to store (words when PACK, else `out_ty`)."""
    M, S = _merge_lanes(pm, ps)
    return _output_of(x, M, S, MODE, PACK, ASM, out_ty)


@triton.jit
def _output_of(x, M, S, MODE: tl.constexpr, PACK: tl.constexpr, ASM: tl.constexpr, out_ty: tl.constexpr):
    """`_piece_output` given the row's max M and sum S (`_merge_lanes`)."""
    M_safe = tl.where(M == float("-inf"), 0.0, M)
    # from x, not from the piece's exps: only x is carried to the next step (one register array
    # fewer than keeping e; a second exp per element is cheap next to the memory traffic)
    if PACK:
        lo, hi = _unpack_pair(x, PACK)
        if MODE == 0:
            # one FMA and one exp per element, as in `_piece_max_sum`; an all -inf row (S = 0)
            # gives exp2(-inf) = 0 without a select
            off = M_safe * LOG2E + tl.log2(tl.where(S > 0.0, S, 1.0))
            y = _pack_pair(tl.exp2(lo * LOG2E - off), tl.exp2(hi * LOG2E - off), PACK, ASM)
        else:
            y = _pack_pair(_normalised(lo, M_safe, S, MODE), _normalised(hi, M_safe, S, MODE), PACK, ASM)
    else:
        y = _normalised(x.to(tl.float32), M_safe, S, MODE).to(out_ty)
    return y


@triton.jit
def _piece_pointers(x_ptr, y_ptr, PACK: tl.constexpr):
    """(x, y, pad): the pointers a cooperative forward loads and stores through (int32 words of two
    elements when PACK) and the value that pads a piece past the row's end (-inf, or two of them)."""
    if PACK:
        pad = -8323200 if PACK == 1 else -67044352  # two -inf: 0xFF80FF80 (bf16), 0xFC00FC00 (fp16)
        return x_ptr.to(tl.pointer_type(tl.int32)), y_ptr.to(tl.pointer_type(tl.int32)), pad
    else:
        return x_ptr, y_ptr, float("-inf")


@triton.jit
def _reset_words(c_ptr, n_clear):
    """Set words [0, n_clear) of `c_ptr` to -1 (unpublished), shared out over the grid's programs: the
    words the previous cooperative launch on this stream left published (`_coop_words`)."""
    offs = tl.arange(0, 64)
    for start in range(tl.program_id(0) * 64, n_clear, tl.num_programs(0) * 64):
        tl.store(c_ptr + start + offs, tl.full([64], -1, tl.int64), mask=start + offs < n_clear)


@triton.jit
def _next_task(row, k, K, step_rows, step_k, TASKS: tl.constexpr):
    """The task (row, piece) a program takes after task (row, k): tasks are numbered t = row * K + k and
    program p of P takes t = p, p + P, p + 2P, ...; step_rows, step_k = divmod(P, K), so no division is
    made per step. Not TASKS: P is a multiple of K (step_k = 0), and a program keeps its piece (the
    compiler then keeps the piece's columns out of the loop: compiled for sm_90, bf16 pieces of 1024
    words, 809 instructions a step where the general form takes 824)."""
    if TASKS:
        k = k + step_k
        wrap = k >= K
        return row + step_rows + wrap.to(tl.int32), tl.where(wrap, k - K, k)
    else:
        return row + step_rows, k


@triton.jit
def _task_loop(pid, row, R, K, P, step_rows, TASKS: tl.constexpr):
    """(first, last, stride) of a program's loop over its tasks (`_next_task`): task numbers, or, not
    TASKS, its rows (the first is `row`)."""
    if TASKS:
        return pid, R * K, P
    else:
        return row, R, step_rows


@triton.jit
def _piece_cols(k, N, PIECE: tl.constexpr, EVEN: tl.constexpr):
    """(columns, mask) of piece k of a row of N columns (EVEN: N % PIECE == 0, no column mask: a mask per
    element held registers the pieces need)."""
    cols = k * PIECE + tl.arange(0, PIECE)
    if EVEN:
        return cols, tl.full([PIECE], 1, tl.int1)
    else:
        return cols, cols < N


@triton.jit
def _load_piece(xp, row, k, R, N, I, s_o, s_i, s_n, pad, PIECE: tl.constexpr, COL64: tl.constexpr,
                EVEN: tl.constexpr):
    """Piece k of row `row`, which may be past the last, R - 1: its values are then never used. EVEN (no
    column mask): such a row reads row R - 1 instead, with no mask, so that no `other` is written into
    the registers before the load (compiled for sm_90, bf16 pieces of 1024 words: a move per word and
    row, 1 of 28 instructions per word)."""
    cols, cmask = _piece_cols(k, N, PIECE, EVEN)
    offs = _col_offsets(cols, s_n, COL64)
    if EVEN:
        return tl.load(xp + _row_start(tl.minimum(row, R - 1), I, s_o, s_i) + offs)
    else:
        return tl.load(xp + _row_start(row, I, s_o, s_i) + offs, mask=cmask & (row < R), other=pad)


@triton.jit
def _fwd_coop_kernel(
    x_ptr, y_ptr, w_ptr, c_ptr, n_clear, R, N, I,
    sx_o, sx_i, sx_n, sy_o, sy_i, sy_n, K,
    MODE: tl.constexpr, PIECE: tl.constexpr, KB: tl.constexpr, COL64: tl.constexpr, PACK: tl.constexpr,
    ASM: tl.constexpr, EVEN: tl.constexpr, TASKS: tl.constexpr, EXPS: tl.constexpr = False,
):
    """The grid's P programs take the R * K tasks (piece k of row r: task t = r * K + k) in turn, program
    p tasks p, p + P, ... (`_next_task`): one read, one write. TASKS: P need not be a multiple of K, so
    every resident program works (H200, bf16 512 x 131072 softmax, 64 pieces a row: 24 rows in flight
    took 22 steps, the last a third full, where 1584 programs take 21; x copy, GPU time 0.87 -> 0.88,
    eager 0.845 -> 0.85; float32 1300 x 50257, 50 pieces: 0.875 -> 0.907 eager). Else P is a whole
    number of rows in flight, program `slot * K + k` holding piece k of rows slot, slot + P / K, ...
    (`_tasks_grid` chooses).

    Each piece publishes its `(max, sum)` as one word (`_publish_word`), pipelined by one task: a
    program publishes task t + P before it waits for task t's row, so the row's other pieces have a
    whole step to publish theirs, and the task after that is already requested. No deadlock: a row's
    K <= P tasks lie in at most two consecutive steps, so before the programs wait in step j they have
    published every task of steps j and j + 1 (the first two without waiting: every program of the
    grid is resident, `_coop_grid`).

    PACK (1: bf16, 2: fp16): x and y are read and written as int32 words of two elements, so N, PIECE
    and the strides count words. The three row pieces a program carries (this task, the next, the one
    in flight) then take one register per two elements; loaded as 16-bit elements, each took a whole
    register, and the register file, not memory, bounded the bytes in flight. ASM: packed conversions
    (`_pack_pair`), compiled only. EVEN: N is a multiple of PIECE (no column mask). EXPS (bf16 softmax):
    a piece's words become its exps once published (`_piece_exps`), and its output a multiply of them.

    `w_ptr`: the launch's `[R, K]` words, all -1 at the start; `c_ptr`: the previous launch's, of which
    it resets the first `n_clear` (`_coop_words`)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    step_rows = P // K
    step_k = P - step_rows * K
    row = pid // K
    k = pid - row * K
    xp, yp, pad = _piece_pointers(x_ptr, y_ptr, PACK)
    x = _load_piece(xp, row, k, R, N, I, sx_o, sx_i, sx_n, pad, PIECE, COL64, EVEN)
    row1, k1 = _next_task(row, k, K, step_rows, step_k, TASKS)
    x_next = _load_piece(xp, row1, k1, R, N, I, sx_o, sx_i, sx_n, pad, PIECE, COL64, EVEN)
    _reset_words(c_ptr, n_clear)  # (while the first loads are in flight)
    # (`shift` and `shift1` exist only with EXPS: elsewhere the loop compiles as it did without it)
    if EXPS:
        m, s, x, shift = _piece_exps(x, ASM)
    else:
        m, s = _piece_max_sum(x, PACK, ASM)
    _publish_word(w_ptr + row * K + k, _pack_word(m, s))
    first, last, stride = _task_loop(pid, row, R, K, P, step_rows, TASKS)
    for it in range(first, last, stride):
        if not TASKS:  # (the row from the loop's counter: nothing else carried from step to step)
            row, row1 = it, it + step_rows
        x1 = x_next
        if EXPS:
            shift1 = 0.0
        row2, k2 = _next_task(row1, k1, K, step_rows, step_k, TASKS)
        x_next = _load_piece(xp, row2, k2, R, N, I, sx_o, sx_i, sx_n, pad, PIECE, COL64, EVEN)
        if row1 < R:
            if EXPS:
                m1, s1, x1, shift1 = _piece_exps(x1, ASM)
            else:
                m1, s1 = _piece_max_sum(x1, PACK, ASM)
            _publish_word(w_ptr + row1 * K + k1, _pack_word(m1, s1))
        pm, ps = _await_words(w_ptr, row * K, K, KB)
        if EXPS:
            M, S = _merge_lanes(pm, ps)
            y = _output_of_exps(x, shift, M, S, ASM)
        else:
            y = _piece_output(x, pm, ps, MODE, PACK, ASM, y_ptr.dtype.element_ty)
        cols, cmask = _piece_cols(k, N, PIECE, EVEN)
        tl.store(yp + _row_start(row, I, sy_o, sy_i) + _col_offsets(cols, sy_n, COL64), y, mask=cmask)
        x = x1
        if EXPS:
            shift = shift1
        row, k, row1, k1 = row1, k1, row2, k2


@triton.jit
def _row_cuts(s, N, VE: tl.constexpr):
    """The row's elements [s, s + N) cut at 16-byte boundaries (every VE elements): the first boundary
    at or after s, a, and the last at or before s + N, b; whole vectors [a, b) where a <= b, else (a
    row that starts and ends inside one vector) none. The head [s, min(a, s + N)) and the tail
    [max(b, a), s + N) are shorter than a vector."""
    a = (s + VE - 1) // VE * VE
    return a, (s + N) // VE * VE


@triton.jit
def _body(s, N, k, ok, PIECE: tl.constexpr, VE: tl.constexpr, UV: tl.constexpr):
    """(first unit, mask) of piece k of the row at element s (`ok` False: nothing): pieces start on the
    row's first 16-byte boundary, plus k pieces, and hold units (elements, or words of two), UV to a
    vector of VE elements; the mask takes the row's whole vectors (it is the same over each vector, so
    the loads and stores keep their 16-byte width), which fill K pieces of `(N // VE) * UV` units."""
    per: tl.constexpr = VE // UV
    a, b = _row_cuts(s, N, VE)
    p0 = tl.multiple_of(a // per + k * PIECE, UV)
    vec = (tl.arange(0, PIECE) // UV) * UV
    return p0, (vec < (b // per - p0).to(tl.int32)) & ok


@triton.jit
def _ends(s, N, k, ok, VE: tl.constexpr):
    """(element offsets, mask) of the row's head and tail (`_row_cuts`), at most VE - 1 elements each,
    read and written one by one; piece 0 holds them (`ok` False: nothing)."""
    a, b = _row_cuts(s, N, VE)
    head_end = tl.minimum(a, s + N)
    j = tl.arange(0, 2 * VE)
    head = j < VE
    e = tl.where(head, s + j, tl.maximum(b, head_end) + j - VE)
    return e, tl.where(head, e < head_end, e < s + N) & (k == 0) & ok


@triton.jit
def _load_row_piece(p_ptr, up, s, N, k, ok, pad, other, PIECE: tl.constexpr, VE: tl.constexpr, UV: tl.constexpr):
    """Piece k of the row at element s of `p_ptr` (`ok` False: nothing): its whole vectors as loaded
    through `up` (units, UV to a vector; `pad` elsewhere) and, for piece 0, the row's head and tail
    elements in float32 (`other` elsewhere)."""
    p0, body = _body(s, N, k, ok, PIECE, VE, UV)
    e, ends = _ends(s, N, k, ok, VE)
    v = tl.load(up + p0 + tl.arange(0, PIECE), mask=body, other=pad)
    return v, tl.load(p_ptr + e, mask=ends, other=other).to(tl.float32)


@triton.jit
def _store_row_piece(p_ptr, up, s, N, k, v, ve, PIECE: tl.constexpr, VE: tl.constexpr, UV: tl.constexpr):
    """Store what `_load_row_piece` loads: piece k's whole vectors `v` through `up`, and for piece 0 the
    row's head and tail elements `ve` (both already in the stored dtype)."""
    p0, body = _body(s, N, k, True, PIECE, VE, UV)
    tl.store(up + p0 + tl.arange(0, PIECE), v, mask=body)
    e, ends = _ends(s, N, k, True, VE)
    tl.store(p_ptr + e, ve, mask=ends)


@triton.jit
def _prefetch_to_l2(base, nbytes):
    """Ask the SM's bulk copy unit to bring `nbytes` (a multiple of 16) from the 16-byte aligned `base`
    into L2 (sm_90 on; thread 0 alone asks): no register is written and the program does not wait."""
    one = tl.zeros([1], tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [base + one, nbytes + one], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _merge_two(m1, s1, m2, s2):
    """Two `(max, sum of exp(x - max))` pairs as one (an all -inf side has max -inf and sum 0)."""
    M = tl.maximum(m1, m2)
    M_safe = tl.where(M == float("-inf"), 0.0, M)
    return M, s1 * tl.exp2((m1 - M_safe) * LOG2E) + s2 * tl.exp2((m2 - M_safe) * LOG2E)


@triton.jit
def _publish_stats(w_ptr, i, k, m, s, xe):
    """Publish word i: a piece's `(max, sum)` merged, for piece 0 only, with its row's end elements xe."""
    if k == 0:
        me, se = _piece_max_sum(xe, 0)
        m, s = _merge_two(m, s, me, se)
    _publish_word(w_ptr + i, _pack_word(m, s))


@triton.jit
def _publish_piece(w_ptr, i, k, x, xe, PACK: tl.constexpr, ASM: tl.constexpr):
    """Publish word i: the `(max, sum)` of piece k's vectors x and, piece 0 only, the row's end elements
    xe (the other pieces skip their reductions: H200, bf16 2730 x 24575 softmax 0.82 -> 0.83x copy)."""
    m, s = _piece_max_sum(x, PACK, ASM)
    _publish_stats(w_ptr, i, k, m, s, xe)


@triton.jit
def _publish_piece_exps(w_ptr, i, k, x, xe, ASM: tl.constexpr):
    """`_publish_piece` of bf16 words, returning the piece's exps and their shift (`_piece_exps`)."""
    m, s, e, shift = _piece_exps(x, ASM)
    _publish_stats(w_ptr, i, k, m, s, xe)
    return e, shift


@triton.jit
def _fwd_coop_aligned_kernel(
    x_ptr, y_ptr, w_ptr, c_ptr, n_clear, R, SPAN, I, sx_o, sx_i, sy_o, sy_i, N, K,
    MODE: tl.constexpr, PIECE: tl.constexpr, KB: tl.constexpr, PACK: tl.constexpr, ASM: tl.constexpr,
    VE: tl.constexpr, L2_AHEAD: tl.constexpr, TASKS: tl.constexpr, EXPS: tl.constexpr = False,
):
    """`_fwd_coop_kernel` (its tasks, words and pipelining) for rows of contiguous columns, read and written
    in 16-byte vectors whatever their length and start: piece k of a row starts at the row's first 16-byte
    boundary, plus k pieces (`_body`), so its loads and stores keep their full width on every row, and the
    pieces hold only whole vectors of the row; the elements before the row's first boundary and after its
    last (fewer than a vector at each end) are read and written one by one by piece 0 (`_ends`). Needs both
    base pointers 16-byte aligned and the rows of y as far from 16-byte boundaries as those of x (the
    launcher checks). Rows start anywhere: odd lengths and odd row strides too, 2-byte rows as words of two
    elements (PACK) included.

    The ends apart, rather than whole vectors padded element by element where they hold the rows
    beside: the padding took registers over the whole piece (compiled for sm_90: bf16 pieces of 1024
    words on one warp 255 registers uncapped, 184 in `_fwd_coop_kernel`).

    SPAN: the units (elements, or words when PACK) of a row's whole vectors at most, from which the
    launcher cut K pieces of PIECE units; N: the row's elements; VE: elements per 16 bytes. MODE 2
    (logsumexp): y is the float32 lse, one per row, which piece 0 writes; the other pieces only
    publish their words and never wait.

    L2_AHEAD (sm_90 on): each program also asks L2 for its piece of the task after the one it loads,
    `_prefetch_to_l2`, so that the loads of the next step find it there. H200, x a copy's bandwidth,
    eager: bf16 1300 x 50257 softmax 0.80 -> 0.84, 512 x 131071 0.79 -> 0.82, 1024 x 65537 0.80 ->
    0.83; the kernel for rows on the boundaries (`_fwd_coop_kernel`) lost 0-1% with it, prefetching two
    rows ahead lost everywhere (bf16 512 x 131072 0.85 -> 0.81), and one `prefetch.global.L2` per line
    instead of the bulk copy lost too (0.85 -> 0.81), as did logsumexp (MODE 2: 0.65 -> 0.63)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    step_rows = P // K
    step_k = P - step_rows * K
    row = pid // K
    k = pid - row * K
    xp, yp, pad = _piece_pointers(x_ptr, y_ptr, PACK)
    x, xe = _load_row_piece(x_ptr, xp, _row_start(row, I, sx_o, sx_i), N, k, True, pad, float("-inf"), PIECE, VE, 4)
    row1, k1 = _next_task(row, k, K, step_rows, step_k, TASKS)
    x_next, xe_next = _load_row_piece(x_ptr, xp, _row_start(row1, I, sx_o, sx_i), N, k1, row1 < R, pad,
                                      float("-inf"), PIECE, VE, 4)
    _reset_words(c_ptr, n_clear)  # (while the first loads are in flight)
    # (`shift` and `shift1` exist only with EXPS: elsewhere the loop compiles as it did without it)
    if EXPS:
        x, shift = _publish_piece_exps(w_ptr, row * K + k, k, x, xe, ASM)
    else:
        _publish_piece(w_ptr, row * K + k, k, x, xe, PACK, ASM)
    first, last, stride = _task_loop(pid, row, R, K, P, step_rows, TASKS)
    for it in range(first, last, stride):
        if not TASKS:
            row, row1 = it, it + step_rows
        x1, xe1 = x_next, xe_next
        if EXPS:
            shift1 = 0.0
        row2, k2 = _next_task(row1, k1, K, step_rows, step_k, TASKS)
        x_next, xe_next = _load_row_piece(x_ptr, xp, _row_start(row2, I, sx_o, sx_i), N, k2, row2 < R, pad,
                                          float("-inf"), PIECE, VE, 4)
        if L2_AHEAD:
            row3, k3 = _next_task(row2, k2, K, step_rows, step_k, TASKS)
            if row3 < R:
                s_a = _row_start(row3, I, sx_o, sx_i)
                p0, _ = _body(s_a, N, k3, True, PIECE, VE, 4)
                span = tl.minimum(_row_cuts(s_a, N, VE)[1] // (VE // 4) - p0, PIECE)  # units of 4 bytes
                if span > 0:
                    _prefetch_to_l2(xp + p0, (span * 4).to(tl.int32))
        if row1 < R:
            if EXPS:
                x1, shift1 = _publish_piece_exps(w_ptr, row1 * K + k1, k1, x1, xe1, ASM)
            else:
                _publish_piece(w_ptr, row1 * K + k1, k1, x1, xe1, PACK, ASM)
        if MODE != 2 or k == 0:
            pm, ps = _await_words(w_ptr, row * K, K, KB)
            M, S = _merge_lanes(pm, ps)
            if MODE == 2:  # logsumexp: y is the float32 lse, one per row, written by piece 0
                tl.store(y_ptr + row, tl.where(M == float("-inf"), 0.0, M) + tl.log2(S) * LN2)
            else:
                out_ty = y_ptr.dtype.element_ty
                ys = _row_start(row, I, sy_o, sy_i)
                p0, body = _body(ys, N, k, True, PIECE, VE, 4)
                if EXPS:
                    y = _output_of_exps(x, shift, M, S, ASM)
                else:
                    y = _output_of(x, M, S, MODE, PACK, ASM, out_ty)
                tl.store(yp + p0 + tl.arange(0, PIECE), y, mask=body)
                if k == 0:  # the row's end elements (`_store_row_piece`, the other pieces skip them)
                    e, ends = _ends(ys, N, k, True, VE)
                    tl.store(y_ptr + e, _output_of(xe, M, S, MODE, 0, ASM, out_ty), mask=ends)
        x, xe = x1, xe1
        if EXPS:
            shift = shift1
        row, k, row1, k1 = row1, k1, row2, k2


@triton.jit
def _fwd_rows_aligned_kernel(
    x_ptr, y_ptr, I, sx_o, sx_i, sy_o, sy_i, N,
    MODE: tl.constexpr, BLOCK: tl.constexpr, VE: tl.constexpr,
):
    """`_fwd_rows_kernel` for rows of contiguous columns off 16-byte boundaries, one row per program:
    the row's whole 16-byte vectors (BLOCK elements from its first boundary, `_body`) loaded and stored
    at full width, its head and tail elements one by one (`_ends`), as `_fwd_coop_aligned_kernel` reads
    them, but with the whole row in this program's registers: no word to publish or wait for, the
    exact max before one exp per element (the cooperative form, which keeps only x, takes two).
    Needs what the aligned cooperative kernels need (`_aligned_rows`). MODE 2 (logsumexp): y is the
    float32 lse, one per row."""
    row = tl.program_id(0)
    x, xe = _load_row_piece(x_ptr, x_ptr, _row_start(row, I, sx_o, sx_i), N, 0, True, float("-inf"),
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
        _store_row_piece(y_ptr, y_ptr, _row_start(row, I, sy_o, sy_i), N, 0, y.to(ty), ye.to(ty), BLOCK, VE, VE)


@triton.jit
def _bwd_coop_kernel(
    y_ptr, g_ptr, dx_ptr, w_ptr, c_ptr, n_clear, R, N, I,
    sy_o, sy_i, sy_n, sg_o, sg_i, sg_n, sd_o, sd_i, sd_n, K,
    LOG: tl.constexpr, PIECE: tl.constexpr, KB: tl.constexpr, COL64: tl.constexpr, EVEN: tl.constexpr,
):
    """The backward in the same cooperative form: pieces of y and g stay in registers while the row
    sum (sum(g * y), or sum(g) for log_softmax) is merged from the pieces' words (`_publish_word`).
    Not pipelined: its two inputs per piece already keep enough bytes in flight (measured on H200:
    0.93-0.96x copy for fp32 rows of 64K-131K columns). Words and EVEN as in `_fwd_coop_kernel`; the
    grid is a whole number of rows in flight, program `slot * K + k` holding piece k of rows slot,
    slot + SLOTS, ... (unpipelined, a row straddling two steps would wait a whole step for its rest)."""
    pid = tl.program_id(0)
    SLOTS = tl.num_programs(0) // K
    slot = pid // K
    k = pid - slot * K
    cols = k * PIECE + tl.arange(0, PIECE)
    if EVEN:
        cmask = tl.full([PIECE], 1, tl.int1)
    else:
        cmask = cols < N
    _reset_words(c_ptr, n_clear)
    y_other = float("-inf") if LOG else 0.0
    for row in range(slot, R, SLOTS):
        ystart = _row_start(row, I, sy_o, sy_i)
        gstart = _row_start(row, I, sg_o, sg_i)
        y = tl.load(y_ptr + ystart + _col_offsets(cols, sy_n, COL64), mask=cmask, other=y_other).to(tl.float32)
        g = tl.load(g_ptr + gstart + _col_offsets(cols, sg_n, COL64), mask=cmask, other=0.0).to(tl.float32)
        if LOG:
            part = tl.sum(g, axis=0)
        else:
            part = tl.sum(g * y, axis=0)
        _publish_word(w_ptr + row * K + k, _pack_word(tl.full([], 0.0, tl.float32), part))
        _, parts = _await_words(w_ptr, row * K, K, KB)
        total = tl.sum(parts, axis=0)
        if LOG:
            dx = g - tl.exp2(y * LOG2E) * total
        else:
            dx = y * (g - total)
        dstart = _row_start(row, I, sd_o, sd_i)
        tl.store(dx_ptr + dstart + _col_offsets(cols, sd_n, COL64), dx.to(dx_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _bwd_coop_aligned_kernel(
    y_ptr, g_ptr, dx_ptr, w_ptr, c_ptr, n_clear, R, SPAN, I, sy_o, sy_i, sg_o, sg_i, sd_o, sd_i, N, K,
    LOG: tl.constexpr, PIECE: tl.constexpr, KB: tl.constexpr, VE: tl.constexpr,
):
    """`_bwd_coop_kernel` for rows of contiguous columns off 16-byte boundaries, in 16-byte vectors and
    the row's ends apart, as `_fwd_coop_aligned_kernel` (element by element, those rows read at a
    fraction of the bandwidth: H200, bf16 1300 x 50257 log_softmax backward 0.86x PyTorch's). Needs
    the rows of y, g and dx at the same offsets from 16-byte boundaries (the launcher checks)."""
    pid = tl.program_id(0)
    SLOTS = tl.num_programs(0) // K
    slot = pid // K
    k = pid - slot * K
    _reset_words(c_ptr, n_clear)
    y_other = float("-inf") if LOG else 0.0
    for row in range(slot, R, SLOTS):
        # (the backward's pieces are elements: units of one element, VE to a vector)
        y, ye = _load_row_piece(y_ptr, y_ptr, _row_start(row, I, sy_o, sy_i), N, k, True, y_other, y_other,
                                PIECE, VE, VE)
        g, ge = _load_row_piece(g_ptr, g_ptr, _row_start(row, I, sg_o, sg_i), N, k, True, 0.0, 0.0, PIECE, VE, VE)
        y, g = y.to(tl.float32), g.to(tl.float32)
        if LOG:
            part = tl.sum(g, axis=0) + tl.sum(ge, axis=0)
        else:
            part = tl.sum(g * y, axis=0) + tl.sum(ge * ye, axis=0)
        _publish_word(w_ptr + row * K + k, _pack_word(tl.full([], 0.0, tl.float32), part))
        _, parts = _await_words(w_ptr, row * K, K, KB)
        total = tl.sum(parts, axis=0)
        if LOG:
            dx = g - tl.exp2(y * LOG2E) * total
            dxe = ge - tl.exp2(ye * LOG2E) * total
        else:
            dx = y * (g - total)
            dxe = ye * (ge - total)
        out_ty = dx_ptr.dtype.element_ty
        _store_row_piece(dx_ptr, dx_ptr, _row_start(row, I, sd_o, sd_i), N, k, dx.to(out_ty), dxe.to(out_ty),
                         PIECE, VE, VE)


@triton.jit
def _lse_bwd_kernel(
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
    xs = _row_start(rows, I, sx_o, sx_i)
    x = tl.load(x_ptr + xs[:, None] + _col_offsets(cols, sx_n, COL64)[None, :], mask=mask, other=float("-inf"))
    dx = g[:, None] * tl.exp2((x.to(tl.float32) - lse[:, None]) * LOG2E)
    ds = _row_start(rows, I, sd_o, sd_i)
    tl.store(dx_ptr + ds[:, None] + _col_offsets(cols, sd_n, COL64)[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(x: torch.Tensor, what: str) -> None:
    if x.dtype not in _DTYPES:
        raise TypeError(f"{what}: the Triton kernels take float32/float16/bfloat16, got {x.dtype}")


@functools.cache
def _num_sms(device: torch.device) -> int:
    # cached: reading the device properties costs more host time than a small softmax's kernels
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: any small number exercises the same paths


@functools.cache
def _bulk_prefetch(device: torch.device) -> bool:
    """Whether kernels on `device` can ask for bulk prefetches into L2 (`_prefetch_to_l2`: sm_90 on)."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (9, 0)


class _WordPool:
    """Two int64 word buffers, used by turns. A cooperative launch takes the buffer whose words are all
    -1 and resets the words that the launch before it (on the other buffer) left published; so no
    launch needs a fill of its own (a kernel, and on H200 ~2.5 us of GPU time between the L2 flush and
    the kernel in a `do_bench` call)."""

    def __init__(self, device: torch.device, n: int):
        self.bufs = torch.full((2, n), -1, dtype=torch.int64, device=device).unbind(0)
        self.dirty = [0, 0]  # words left published in each buffer
        self.turn = 0

    def launched(self, n: int) -> None:
        self.dirty[self.turn], self.dirty[1 - self.turn] = n, 0
        self.turn = 1 - self.turn


class _Workspace:
    """Scratch memory that the launches of one (device, stream, thread) reuse call after call: row
    counters (every kernel that counts on them leaves them at 0), float32 partial buffers, and the
    cooperative kernels' word buffers.

    Why: an allocation per call costs host time (`torch.empty` of a 3-D buffer and its `unbind`: ~6 us
    on the H200 host), a fill costs a launch, and host time is what small inputs pay for. Kernels on one
    stream run in order, so a kernel never shares scratch with a kernel in flight. One per thread too:
    two threads on one stream interleave their launches (a call's stats kernel and the kernel that
    reads its partials could be split by another call's), and the word buffers' turns are host state.
    Buffers replaced or dropped are freed to the caching allocator, which hands them out again on
    this stream only after the kernels queued before on it."""

    def __init__(self):
        self.counters: torch.Tensor | None = None
        self.partials: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}
        self.words: _WordPool | None = None


_WORKSPACES: dict[tuple[int, int, int], _Workspace] = {}


def _workspace(device: torch.device) -> _Workspace | None:
    """The workspace of the current stream and thread on `device`; None under graph capture (a graph
    replays its launches with the buffers of its capture: they must be its own) and on CPU (the
    interpreter), where the scratch is fresh each call."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    key = (device.index, _raw_stream(device.index), threading.get_ident())
    ws = _WORKSPACES.get(key)
    if ws is None:
        if len(_WORKSPACES) >= 64:  # (threads come and go; their ids are reused)
            _WORKSPACES.clear()
        ws = _WORKSPACES[key] = _Workspace()
    return ws


def _row_counters(ws: _Workspace | None, device: torch.device, R: int) -> torch.Tensor:
    """At least `R` int32 counters that are 0 now; the kernel that uses them leaves them 0 again."""
    if ws is None:
        return torch.zeros(R, dtype=torch.int32, device=device)
    if ws.counters is None or ws.counters.numel() < R:
        ws.counters = torch.zeros(max(R, 1024), dtype=torch.int32, device=device)
    return ws.counters


def _partials(ws: _Workspace | None, device: torch.device, n: int, R: int, K: int) -> tuple[torch.Tensor, ...]:
    """`n` float32 `[R, K]` buffers (contents undefined) for a call's kernels to pass partial results."""
    if ws is None:
        return torch.empty((n, R, K), dtype=torch.float32, device=device).unbind(0)
    bufs = ws.partials.get((n, R, K))
    if bufs is None:
        if len(ws.partials) >= 16:
            ws.partials.clear()
        bufs = ws.partials[(n, R, K)] = torch.empty((n, R, K), dtype=torch.float32, device=device).unbind(0)
    return bufs


def _fold_rows(t: torch.Tensor) -> tuple[int, int, int, int, int] | None:
    """`t` `[..., N]` as rows: `(O, I, s_o, s_i, s_n)` such that row `r = o * I + i` (row-major order
    of the leading dims) starts at element `o * s_o + i * s_i`; None if the leading dims do not fold into
    two strided groups (then the caller copies)."""
    shape, strides = t.shape, t.stride()
    if len(shape) <= 2:  # the common case without the loop below (same result: a size-1 dim is dropped)
        if len(shape) == 1 or shape[0] == 1:
            return 1, 1, 0, 0, strides[-1]
        return shape[0], 1, strides[0], 0, strides[1]
    groups: list[list[int]] = []
    for size, stride in zip(shape[:-1], strides[:-1]):
        if size == 1:
            continue
        if groups and groups[-1][1] == stride * size:
            groups[-1] = [groups[-1][0] * size, stride]
        else:
            groups.append([size, stride])
    if len(groups) > 2:
        return None
    while len(groups) < 2:
        groups.append([1, 0])  # pad on the inside: I = 1 is specialised away by Triton
    (o, s_o), (i, s_i) = groups
    return o, i, s_o, s_i, strides[-1]


def _dim_last(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`t.movedim(dim, -1)` for `dim >= 0`, skipping the view (~2 us of host time) when it is already last."""
    return t if dim == t.dim() - 1 else t.movedim(dim, -1)


def _input_rows(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, tuple[int, int, int, int, int], bool]:
    """Plan time: `t` with `dim` (>= 0) moved last (a view where its dims fold, else a copy), its row
    folding, and whether it was copied (`_input_view` does the same per call)."""
    tm = _dim_last(t, dim)
    lay = _fold_rows(tm)
    if lay is not None:
        return tm, lay, False
    tm = tm.contiguous()
    return tm, _fold_rows(tm), True


def _input_view(t: torch.Tensor, dim: int, copy: bool) -> torch.Tensor:
    """Per call: the row view `_input_rows` planned for tensors of `t`'s layout."""
    tm = _dim_last(t, dim)
    return tm.contiguous() if copy else tm


def _output_rows(
    out: torch.Tensor | None, like: torch.Tensor, dim: int, shape: torch.Size, dtype: torch.dtype, what: str
) -> tuple[torch.Tensor, tuple[int, int, int, int, int], bool, bool]:
    """Plan time: row view of the output and its folding, then `direct` (the caller's `out` is written
    in place: its layout folds) and `dense` (a fresh buffer keeps the memory order of the row view
    `like`: its layout folds), which `_output_view` takes per call. A fresh buffer is written where
    `out` does not fold, and copied into it at the end."""
    if out is not None:
        if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != like.device:
            raise ValueError(f"{what}: out must be {tuple(shape)} {dtype} on {like.device}, got {tuple(out.shape)} "
                             f"{out.dtype} on {out.device}")
        om = _dim_last(out, dim)
        lay = _fold_rows(om)
        if lay is not None:
            return om, lay, True, True
    ym = torch.empty_like(like, dtype=dtype)
    lay = _fold_rows(ym)
    if lay is not None:
        return ym, lay, False, True
    ym = torch.empty(like.shape, dtype=dtype, device=like.device)
    return ym, _fold_rows(ym), False, False


def _output_view(out: torch.Tensor | None, like: torch.Tensor, dim: int, dtype: torch.dtype, direct: bool,
                 dense: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per call: the output rows `_output_rows` planned, and the `out` to copy them into at the end
    (`_finish`; None: written in place or no `out`)."""
    if direct:
        return _dim_last(out, dim), None
    if dense:
        return torch.empty_like(like, dtype=dtype), out
    return torch.empty(like.shape, dtype=dtype, device=like.device), out


def _finish(ym: torch.Tensor, dim: int, target: torch.Tensor | None) -> torch.Tensor:
    y = ym if dim == ym.dim() - 1 else ym.movedim(-1, dim)
    return y if target is None else target.copy_(y)


def _col64(n: int, *strides: int) -> bool:
    return max((1, *map(abs, strides))) * n >= 2**31


def _row_warps(tile: int) -> int:
    if TUNING["row_warps"] is not None:
        return int(TUNING["row_warps"])
    return max(2, min(32, tile // 512))


def _short_tile(R: int, N: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_N) for rows held whole in registers."""
    block_n = next_power_of_2(N)
    tile = int(TUNING["short_tile"] if block_n <= int(TUNING["short_cols"]) else TUNING["tile"])
    block_r = max(1, min(tile // block_n, next_power_of_2(R)))
    return block_r, block_n


def _split(R: int, N: int, device: torch.device) -> tuple[int, int, int]:
    """(pieces per row, piece length, chunk) for rows too long for registers."""
    chunk = int(TUNING["chunk"])
    sms = _num_sms(device)
    split_rows = TUNING["split_rows"] if TUNING["split_rows"] is not None else 2 * sms
    n_chunks = cdiv(N, chunk)
    pieces = 1
    if R < split_rows:
        pieces = max(1, min(n_chunks, cdiv(4 * sms, R), 4096))
    piece = cdiv(n_chunks, pieces) * chunk
    return cdiv(N, piece), piece, chunk


def _coop_plan(R: int, N: int, device: torch.device, which: str, itemsize: int = 4,
               tier: str = "") -> tuple[int, int, int, int | None] | None:
    """(pieces per row K, piece length, warps, register cap or None) for the cooperative `which`
    ("fwd"/"bwd") kernel on elements of `itemsize` bytes, from the knobs of `tier` ("" or "_long"), or
    None where it does not apply (CPU / the interpreter, knob off, too few rows, no such tier)."""
    if device.type != "cuda" or not TUNING[f"coop_{which}"] or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    # measured (lse_toolkit-nvidia-h200.json, variants): too few rows to keep every program busy spend
    # longer waiting on the row's other pieces than they save in memory traffic
    if R < int(TUNING["coop_min_rows"]) and not (which == "fwd" and R * N >= int(TUNING["coop_min_elems_fwd"])):
        return None
    name = f"{which}{'_16' if itemsize <= 2 else ''}{tier}"
    if f"coop_piece_{name}" not in TUNING:
        return None
    piece, warps = int(TUNING[f"coop_piece_{name}"]), int(TUNING[f"coop_warps_{name}"])
    # a row of more pieces than `coop_max_pieces` takes longer pieces (more warps, up to 8, then more
    # columns per thread): every program polls the words of all K pieces of its row
    grow = next_power_of_2(cdiv(cdiv(N, piece), int(TUNING["coop_max_pieces"])))
    piece, warps = piece * grow, max(warps, min(8, warps * grow))
    if piece > 64 * 32 * warps:  # more than 64 columns per thread would spill registers
        return None
    # a row that leaves its last piece mostly empty holds registers the GPU could keep bytes in flight
    # with: pieces half as long (on half the warps), where that fills them better (H200, float32
    # 16384 x 4097 while the aligned pieces also held the row's head, 4101 columns: 5 pieces of 1024,
    # 80% full, 0.85x copy; 9 of 512, 89% full, 0.90x)
    fill = lambda p: N / (cdiv(N, p) * p)  # noqa: E731
    halve = fill(piece) < float(TUNING["coop_min_fill"]) and fill(piece // 2) > fill(piece)
    # and the 2-byte forward on rows of few pieces (H200, bf16 rows off the boundaries, x the same
    # tensor's copy: 8192 x 8191, 4 pieces: 0.79 -> 0.84x; 4096 x 16383, 8: 0.79 -> 0.83x; 32767
    # columns, 16, lost at first (0.84 -> 0.79x) and gained once the halved pieces took a register cap
    # of their own: `coop_maxnreg_*_halved`)
    few = f"coop_min_pieces_{which}_16"
    # (a row of one piece never waits on another: 32768 x 2049, 1 piece, 0.87x; 2 pieces 0.85x)
    halve = halve or (itemsize <= 2 and few in TUNING and 1 < cdiv(N, piece) < int(TUNING[few]))
    nreg = TUNING.get(f"coop_maxnreg_{name}")
    if not tier and grow == 1 and halve:
        piece, warps = piece // 2, max(1, warps // 2)
        nreg = TUNING.get(f"coop_maxnreg_{name}_halved", nreg)
    return cdiv(N, piece), piece, warps, int(nreg) if nreg else None


_RESIDENT: dict[tuple, int] = {}


def _resident_programs(kernel, args: tuple, consts: dict, warps: int, device: torch.device) -> int:
    """How many programs of the compiled `kernel` the whole GPU holds at once (the driver's count, else
    its allocation rules: `occupancy.py`), so that a cooperative grid never waits on a program that
    cannot start."""
    # the specialisation key of the integer arguments: == 1, divisible by 16, or neither
    spec = tuple((a == 1, a % 16 == 0) for a in args if isinstance(a, int))
    dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
    key = (kernel.fn.__name__, tuple(sorted(consts.items())), spec, dtypes, warps, device.index)
    if key not in _RESIDENT:
        with torch.cuda.device(device):
            compiled = kernel.warmup(*args, grid=(1,), num_warps=warps, **consts)
            compiled._init_handles()
            shared = compiled.metadata.shared
            per_sm = blocks_per_sm_by_driver(compiled.function, warps, shared)
        if per_sm is None:
            props = torch.cuda.get_device_properties(device)
            per_sm = blocks_per_sm_by_rules(
                compiled.n_regs, warps, shared, regs_per_sm=getattr(props, "regs_per_multiprocessor", 65536),
                threads_per_sm=getattr(props, "max_threads_per_multi_processor", 2048),
                smem_per_sm=getattr(props, "shared_memory_per_multiprocessor", 228 * 1024),
            )
        _RESIDENT[key] = per_sm * _num_sms(device)
    return _RESIDENT[key]


def _coop_grid(kernel, args: tuple, consts: dict, warps: int, R: int, K: int, device: torch.device) -> int | None:
    """Programs of a cooperative launch of the R * K tasks of K pieces per row: as many as the whole GPU
    holds at once, at most one a task, or None if one row's K programs cannot all be resident."""
    resident = _resident_programs(kernel, args, consts, warps, device)
    return min(R * K, resident) if resident >= K else None


def _tasks_grid(kernel, args: tuple, c: dict, warps: int, R: int, K: int, device: torch.device) -> bool:
    """Whether the cooperative forward takes its tasks in turn over every resident program (TASKS), or
    runs whole rows in flight (`_fwd_coop_kernel`), by the knob `coop_tasks_fwd`: 0 never, 2 always, 1
    where that takes fewer steps, and for logsumexp, whose piece 0 alone waits and so falls behind the
    others when it is always the same program (H200, kernel alone, x copy, eager / GPU time: bf16 1300 x
    50257 0.65/0.76 -> 0.70/0.86). Where the steps are as many, whole rows keep a piece's columns out of
    the loop (bf16 2730 x 24575, 24 steps either way: 0.83 as rows, 0.82 as tasks)."""
    knob = int(TUNING["coop_tasks_fwd"])
    if knob != 1:
        return knob == 2
    if c.get("MODE") == _LOGSUMEXP:
        return True
    rows = (_coop_grid(kernel, args, dict(c, TASKS=False), warps, R, K, device) or 0) // K
    tasks = _coop_grid(kernel, args, dict(c, TASKS=True), warps, R, K, device) or 0
    return tasks >= K and (rows == 0 or cdiv(R * K, tasks) < cdiv(R, rows))


def _coop_choose(kernel, which: str, tensors: tuple, R: int, N: int, I: int, strides: tuple, consts: dict,
                 per: int) -> tuple | None:
    """(programs, K, warps, launch options, `_COOP_CAP` key) of the plan `_coop_launch` takes, or None
    where no plan applies. The forward's programs may take the tasks in turn whatever
    their number (`_tasks_grid`); the backward's are a whole number of rows in flight.

    The knobs' plan is taken unless it cuts rows into more than `coop_long_pieces` pieces or leaves
    fewer than `coop_min_slots` rows in flight, and a "_long" plan (longer pieces, fewer registers per
    thread) exists that does better: rows of a million float32 columns fit only one at a time in the
    registers of 1024-column pieces, and most of the GPU then idles (H200, 64 x 1M: 0.75x copy
    bandwidth, 0.92x with 4096-column pieces capped at 128 registers, two rows in flight); and every
    program polls and merges the words of all K pieces of its row."""
    device = tensors[0].device
    chosen = None
    for tier in ("", "_long"):
        plan = _coop_plan(R, N * per, device, which, tensors[0].element_size(), tier)
        if plan is None:
            continue
        K, piece, warps, nreg = plan
        c = dict(consts, PIECE=piece // per, KB=next_power_of_2(K))
        if "EVEN" in kernel.arg_names:
            c["EVEN"] = N % (piece // per) == 0
        # fewer registers per thread: more programs per SM, more bytes in flight. The 2-byte caps were
        # measured on rows read as pairs; element by element (odd lengths) the compiler needs more
        if nreg and (per > 1 or tensors[0].element_size() > 2):
            c["maxnreg"] = nreg
        if TUNING["coop_launch"]:
            c["launch_cooperative_grid"] = True
        words = torch.empty(64, dtype=torch.int64, device=device)  # (only its dtype and alignment count here)
        args = (*tensors, words, words, 3, R, N, I, *strides, K)  # (3: a placeholder for n_clear)
        if "TASKS" in kernel.arg_names:
            c["TASKS"] = _tasks_grid(kernel, args, c, warps, R, K, device)
        programs = _coop_grid(kernel, args, c, warps, R, K, device) or 0
        if not c.get("TASKS"):
            programs = programs // K * K
        cap_key = (kernel.fn.__name__, K, warps, tuple(sorted(c.items())), device.index)
        programs = min(programs, _COOP_CAP.get(cap_key, programs))
        if chosen is None or programs // K > chosen[0] // chosen[1] or (programs >= K and K < chosen[1]):
            chosen = (programs, K, warps, c, cap_key)
        if programs // K >= min(R, int(TUNING["coop_min_slots"])) and K <= int(TUNING["coop_long_pieces"]):
            break
    return chosen


class _Replan(Exception):
    """A call plan's cooperative launch was refused down to fewer programs than one row's pieces
    (`_coop_launch`): the call is planned again, and `_COOP_CAP` then steers it to another path."""


def _coop_launch(kernel, tensors: tuple, R: int, N: int, I: int, strides: tuple, chosen: tuple,
                 bound: dict[int, BoundLaunch]) -> bool:
    """Launch a cooperative kernel over `tensors` with the plan `_coop_choose` chose, with an int64
    `[R, K]` word per piece; False if the driver refused every grid down to one row's programs (it ran
    nothing then). N and the strides count the kernel's items (`per` elements each). `bound`: the
    plan's launches by their number of programs, kept from call to call."""
    programs, K, warps, c, cap_key = chosen
    programs = min(programs, _COOP_CAP.get(cap_key, programs))
    device = tensors[0].device
    words, other, n_other, pool = _coop_words(_workspace(device), device, R * K)
    while programs >= K:
        go = bound.get(programs)
        if go is None:
            go = bound[programs] = BoundLaunch(kernel, (programs,), *[FREE] * (len(tensors) + 3), R, N, I,
                                               *strides, K, num_warps=warps, **c)
        try:
            go(*tensors, words, other, n_other)
        except RuntimeError as e:
            # the driver places fewer programs at once than `_resident_programs` counted (seen on
            # H200 while that count ignored the per-sub-partition register files: `occupancy.py`):
            # half the programs, remembered for the next call (a refused launch is not a sticky
            # CUDA error, and it ran nothing: the words are as they were)
            if "cooperative launch" not in str(e):
                raise
            programs = programs // 2 if c.get("TASKS") else programs // K // 2 * K
            _COOP_CAP[cap_key] = programs
            continue
        if pool is not None:
            pool.launched(R * K)
        return True
    return False


def _coop_step(kernel, which: str, tensors: tuple, R: int, N: int, I: int, strides: tuple, consts: dict,
               per: int = 1):
    """Plan time: a step `step(*tensors)` that runs the cooperative `kernel` (`which` = "fwd"/"bwd")
    over tensors of the layouts of `tensors`, or None where no cooperative plan applies (the caller
    takes another path). `per` > 1: the kernel loads items of `per` elements, and N and the strides
    count items."""
    chosen = _coop_choose(kernel, which, tensors, R, N, I, strides, consts, per)
    if chosen is None or min(chosen[0], _COOP_CAP.get(chosen[4], chosen[0])) < chosen[1]:
        return None

    bound: dict[int, BoundLaunch] = {}

    def step(*ts: torch.Tensor) -> None:
        if not _coop_launch(kernel, ts, R, N, I, strides, chosen, bound):
            raise _Replan

    return step


def _coop_words(ws: _Workspace | None, device: torch.device, n: int
                ) -> tuple[torch.Tensor, torch.Tensor, int, _WordPool | None]:
    """(words, other, n_other, pool) for a cooperative launch of `n` words: `words` all -1, `other`
    with its first `n_other` words for the launch to reset, and the pool to tell once launched (None:
    nothing to tell; fresh words where there is no workspace)."""
    if ws is None:
        words = torch.full((n,), -1, dtype=torch.int64, device=device)
        return words, words, 0, None
    pool = ws.words
    if pool is None or pool.bufs[0].numel() < n:
        pool = ws.words = _WordPool(device, max(cdiv(n, 64) * 64, 4096))  # (16-byte aligned halves)
    return pool.bufs[pool.turn], pool.bufs[1 - pool.turn], pool.dirty[1 - pool.turn], pool


# programs that the driver accepted after refusing more, per kernel specialisation
_COOP_CAP: dict[tuple, int] = {}


def _aligned_rows(ts: tuple[torch.Tensor, ...], N: int, strides: tuple[tuple[int, int, int], ...], short: bool,
                  which: str) -> bool:
    """Whether the rows of `ts` (with their (outer, inner, column) strides) take the aligned kernels of
    `which` ("fwd": `_fwd_rows_aligned_kernel` for rows `short` enough for registers, else
    `_fwd_coop_aligned_kernel`; "bwd": `_bwd_coop_aligned_kernel`): they start or end off 16-byte
    boundaries, and their columns are contiguous, their base pointers 16-byte aligned and the rows of
    every tensor at the offsets from the boundaries of the first's. Rows `short` enough for the row
    kernels take them only from `aligned_rows_min_cols` (forward) or `aligned_min_cols` columns up."""
    if which == "fwd" and TUNING["aligned_rows"]:
        min_cols = int(TUNING["aligned_rows_min_cols"])
    else:
        min_cols = int(TUNING["aligned_min_cols_16" if ts[0].element_size() <= 2 else "aligned_min_cols"])
    # (the cheap test first: short rows are launch-bound, every us of host time shows)
    if (short and N < min_cols) or not TUNING["coop_aligned"] or any(st[2] != 1 for st in strides):
        return False
    if any(t.data_ptr() % 16 for t in ts):
        return False
    vec = 16 // ts[0].element_size()  # elements in 16 bytes
    if any((a - b) % vec for st in strides[1:] for a, b in zip(st[:2], strides[0][:2])):
        return False
    # every row on a boundary: `_fwd_coop_kernel` loads as wide, with less arithmetic (H200, 2048 x
    # 32768 bf16: 0.87x copy bandwidth there, 0.57x in the first aligned kernel)
    return not (strides[0][0] % vec == 0 and strides[0][1] % vec == 0 and N % vec == 0)


def _exps(mode: int, pack: int) -> bool:
    """Whether the cooperative forward keeps a piece's exps for its output (EXPS, `_piece_exps`): bf16
    softmax, knob `coop_exps_16`."""
    return mode == _SOFTMAX and pack == 1 and bool(TUNING["coop_exps_16"])


def _aligned_forward_step(xm: torch.Tensor, y: torch.Tensor, R: int, N: int, I: int, strides: tuple, mode: int,
                          short: bool):
    """Plan time: a step `step(xm, y)` of the aligned forward over rows `_aligned_rows` accepted, or
    None (take another path): rows `short` enough for registers one per program
    (`_fwd_rows_aligned_kernel`, knob `aligned_rows`), else `_fwd_coop_aligned_kernel` (`_coop_step`),
    2-byte rows as words of two. y is the output rows (strides (sx_o, sx_i, sy_o, sy_i)), or for
    logsumexp (MODE 2) the float32 lse."""
    ve = 16 // xm.element_size()  # elements per 16-byte vector
    if short and TUNING["aligned_rows"]:
        block = max(ve, next_power_of_2(N // ve * ve))  # (a row's whole vectors span at most this)
        # ~32 elements a thread: fewer warps than the row kernels take (H200, bf16 16380 x 4097, x a
        # copy's bandwidth, eager: 4 warps 0.90, 16 warps 0.67; float32 2048 x 32767: 32 warps 0.91)
        warps, cap = TUNING["aligned_rows_warps"] or max(2, min(32, block // 1024)), {}
        if xm.is_cuda and ve == 8 and block >= int(TUNING["aligned_rows_wide_16"]) and not TUNING["aligned_rows_warps"]:
            warps, cap = block // 2048, dict(maxnreg=int(TUNING["aligned_rows_wide_maxnreg"]))
        return BoundLaunch(_fwd_rows_aligned_kernel, (R,), FREE, FREE, I, *strides, N, MODE=mode, BLOCK=block,
                           VE=ve, num_warps=int(warps), **cap)
    words = {torch.bfloat16: 1, torch.float16: 2}.get(xm.dtype, 0)
    return _coop_step(
        # SPAN: the units of a row's whole vectors, at most (4 per vector; a row inside one: a piece)
        _fwd_coop_aligned_kernel, "fwd", (xm, y), R, max(1, N * xm.element_size() // 16 * 4), I, (*strides, N),
        dict(MODE=mode, PACK=words, ASM=os.environ.get("TRITON_INTERPRET") != "1", VE=ve,
             L2_AHEAD=bool(TUNING["coop_l2_ahead"]) and mode != _LOGSUMEXP and _bulk_prefetch(xm.device),
             EXPS=_exps(mode, words)),
        per=2 if words else 1,
    )


def _pair_pack(xm: torch.Tensor, ym: torch.Tensor, N: int, row_strides: tuple, col_strides: tuple) -> int:
    """PACK for the cooperative forward: 1 (bf16) or 2 (fp16) where x and y can be read and written as
    int32 words of two elements (contiguous rows of even length, even row strides, 4-byte aligned),
    else 0."""
    if not TUNING["coop_pack"] or xm.dtype not in (torch.bfloat16, torch.float16) or N % 2:
        return 0
    if any(s != 1 for s in col_strides) or any(s % 2 for s in row_strides):
        return 0
    if xm.data_ptr() % 4 or ym.data_ptr() % 4:
        return 0
    return 1 if xm.dtype == torch.bfloat16 else 2


def _lookback_step(kernel, which: str, tensors: tuple, n_partials: int, R: int, N: int, I: int,
                   strides: tuple, consts: dict):
    """Plan time: a step `step(*tensors)` that runs a look-back kernel (`which` = "fwd"/"bwd") with
    `n_partials` float32 `[R, K]` partial buffers, or None if the knob is off (take another path)."""
    if not TUNING[f"lookback_{which}"]:
        return None
    block = int(TUNING["lb_block"])
    piece = cdiv(max(int(TUNING["lb_piece"]), cdiv(N, int(TUNING["lb_max_pieces"]))), block) * block
    K = cdiv(N, piece)
    group_rows = max(1, min(R, int(TUNING["lb_group_bytes"]) // (N * tensors[0].element_size())))
    n_groups = cdiv(R, group_rows)
    consts = dict(consts, KB=next_power_of_2(K), BLOCK_N=block)
    warps = int(TUNING["lb_warps"])

    go = BoundLaunch(kernel, (2 * n_groups * group_rows * K,), *[FREE] * (len(tensors) + n_partials + 1), R, N, I,
                     *strides, piece, K, group_rows, n_groups, num_warps=warps, **consts)

    def step(*ts: torch.Tensor) -> None:
        device = ts[0].device
        ws = _workspace(device)
        go(*ts, *_partials(ws, device, n_partials, R, K), _row_counters(ws, device, 2 * R))

    return step


# ----------------------------------------------------------------------------------------------------
# Call plans
# ----------------------------------------------------------------------------------------------------
# Why: on inputs of a few MB a launcher's host time is the whole cost of a call (H200, 8 x 131072
# float32 softmax: 55-90 us of Python per call for 7 us of GPU time; benchmarks/NOTES.md). All that a
# call decides (its rows' folding, the path, kernels, grids, warps and constexprs) depends only on the
# layouts of its tensors (shape, strides, dtype, device, 16-byte alignment), its flags and the knobs.
# So it is decided once per such key, and the plan kept is a closure that does only the per-call work:
# views, allocations, workspace and launches. A plan holds no tensor: each call passes its own.

_PLAN_LIMIT = 1024  # plans kept; the cache starts over past this
_CALL_PLANS: dict[tuple, object] = {}


def _layout(t: torch.Tensor | None) -> tuple | None:
    """What a plan may depend on of a tensor (None for no tensor)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def _planned(key: tuple, build, *args):
    """`plan(*args)` for the plan of `key`, built as `build(*args)` on first use; built again after
    one of its cooperative launches was refused outright (`_Replan`: the next plan avoids that grid)."""
    while True:
        plan = _CALL_PLANS.get(key)
        if plan is None:
            if len(_CALL_PLANS) >= _PLAN_LIMIT:
                _CALL_PLANS.clear()
            plan = _CALL_PLANS[key] = build(*args)
        try:
            return plan(*args)
        except _Replan:
            _CALL_PLANS.pop(key, None)


def _forward_step(xm: torch.Tensor, ym: torch.Tensor, R: int, N: int, I: int, strides: tuple, mode: int):
    """Plan time: the forward's step `step(xm, ym)` over rows of these layouts (`strides`: x's
    (outer, inner, column), then y's); the first path that applies, fastest first."""
    sx_o, sx_i, sx_n, sy_o, sy_i, sy_n = strides
    col64 = _col64(N, sx_n, sy_n)
    short = N <= int(TUNING["max_row_block_16" if xm.element_size() <= 2 else "max_row_block"])
    if _aligned_rows((xm, ym), N, ((sx_o, sx_i, sx_n), (sy_o, sy_i, sy_n)), short, "fwd") and (
        step := _aligned_forward_step(xm, ym, R, N, I, (sx_o, sx_i, sy_o, sy_i), mode, short)
    ):
        return step
    if short:
        block_r, block_n = _short_tile(R, N)
        grid, warps = (cdiv(R, block_r),), _row_warps(block_r * block_n)
        go = BoundLaunch(
            _fwd_rows_kernel, grid, FREE, FREE, FREE, R, N, I, sx_o, sx_i, sx_n, sy_o, sy_i, sy_n,
            MODE=mode, BLOCK_R=block_r, BLOCK_N=block_n, COL64=col64, num_warps=warps,
        )
        return lambda xm, ym: go(xm, ym, xm)  # (no lse: any pointer)
    if (pack := _pair_pack(xm, ym, N, (sx_o, sx_i, sy_o, sy_i), (sx_n, sy_n))) and (step := _coop_step(
        _fwd_coop_kernel, "fwd", (xm, ym), R, N // 2, I, (sx_o // 2, sx_i // 2, 1, sy_o // 2, sy_i // 2, 1),
        dict(MODE=mode, COL64=col64, PACK=pack, ASM=os.environ.get("TRITON_INTERPRET") != "1",
             EXPS=_exps(mode, pack)), per=2,
    )):
        return step
    if step := _coop_step(_fwd_coop_kernel, "fwd", (xm, ym), R, N, I, strides,
                          dict(MODE=mode, COL64=col64, PACK=0, ASM=False)):
        return step
    if step := _lookback_step(_fwd_lookback_kernel, "fwd", (xm, ym), 2, R, N, I, strides, dict(MODE=mode, COL64=col64)):
        return step
    n_pieces, piece, chunk = _split(R, N, xm.device)
    warps = int(TUNING["chunk_warps"])

    stats = BoundLaunch(
        _fwd_stats_kernel, (R, n_pieces), FREE, FREE, FREE, FREE, FREE, N, I, sx_o, sx_i, sx_n, piece, n_pieces,
        OUT=0, NP_BLOCK=1, BLOCK_N=chunk, COL64=col64, num_warps=warps,
    )
    normalise = BoundLaunch(
        _fwd_long_kernel, (R, n_pieces), FREE, FREE, FREE, FREE, N, I, sx_o, sx_i, sx_n, sy_o, sy_i, sy_n, piece,
        n_pieces, MODE=mode, FUSED=n_pieces == 1, NP_BLOCK=next_power_of_2(n_pieces), BLOCK_N=chunk,
        COL64=col64, num_warps=warps,
    )

    def split(xm: torch.Tensor, ym: torch.Tensor) -> None:
        pm = ps = xm  # unused placeholders when fused
        if n_pieces > 1:
            pm, ps = _partials(_workspace(xm.device), xm.device, 2, R, n_pieces)
            stats(xm, pm, ps, pm, pm)
        normalise(xm, ym, pm, ps)

    return split


def _forward_plan(x: torch.Tensor, out: torch.Tensor | None, dim: int, log: bool):
    """Plan time: `plan(x, out, dim, log) -> y` for `softmax_forward` on tensors of these layouts."""
    xm, (O, I, sx_o, sx_i, sx_n), copy = _input_rows(x, dim)
    ym, (_, _, sy_o, sy_i, sy_n), direct, dense = _output_rows(out, xm, dim, x.shape, x.dtype, "softmax")
    N, R = xm.shape[-1], O * I
    strides = (sx_o, sx_i, sx_n, sy_o, sy_i, sy_n)
    step = _forward_step(xm, ym, R, N, I, strides, _LOG_SOFTMAX if log else _SOFTMAX) if R and N else None

    def plan(x: torch.Tensor, out: torch.Tensor | None, dim: int, log: bool) -> torch.Tensor:
        xm = _input_view(x, dim, copy)
        ym, target = _output_view(out, xm, dim, x.dtype, direct, dense)
        if step is not None:
            step(xm, ym)
        return _finish(ym, dim, target)

    return plan


def softmax_forward(
    x: torch.Tensor, dim: int = -1, *, log: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax (or log_softmax) of `x` over `dim`, no autograd.

    Args:
        x: any shape, float32/float16/bfloat16, on a CUDA device (or CPU under TRITON_INTERPRET=1).
        dim: the reduced dim.
        log: log_softmax instead of softmax.
        out: optional output, shape and dtype of `x` (tests pass a NaN-poisoned one).

    Returns:
        `y`, shape and dtype of `x`; all -inf rows give 0 (softmax) or -inf (log_softmax).
    """
    _check(x, "softmax")
    if x.dim() == 0:
        return softmax_forward(x.reshape(1), 0, log=log, out=None if out is None else out.reshape(1)).reshape(())
    dim = dim % x.dim()
    key = ("softmax", _layout(x), _layout(out), dim, log, TUNING.version)
    return _planned(key, _forward_plan, x, out, dim, log)


def _logsumexp_step(xm: torch.Tensor, R: int, N: int, I: int, strides: tuple):
    """Plan time: logsumexp's step `step(xm, lse)` over rows of this layout (`strides`: (outer,
    inner, column)); the first path that applies, fastest first."""
    sx_o, sx_i, sx_n = strides
    col64 = _col64(N, sx_n)
    # rows off 16-byte boundaries in whole vectors, as the forward reads them (its MODE 2): rows as short
    # as the forward's row kernels take one per program, 2-byte rows of any length in the cooperative pieces
    fits = N <= int(TUNING["max_row_block_16" if xm.element_size() <= 2 else "max_row_block"])
    if ((fits and TUNING["aligned_rows"] or xm.element_size() == 2 and TUNING["aligned_lse"])
            and _aligned_rows((xm,), N, (strides,), fits, "fwd")
            # (a stand-in for the lse: MODE 2 writes float32, one per row, whose strides it knows)
            and (step := _aligned_forward_step(xm, xm.new_empty(1, dtype=torch.float32), R, N, I,
                                               (sx_o, sx_i, 0, 0), _LOGSUMEXP, fits))):
        return step
    if N <= int(TUNING["max_row_block"]):
        block_r, block_n = _short_tile(R, N)
        grid, warps = (cdiv(R, block_r),), _row_warps(block_r * block_n)
        go = BoundLaunch(
            _fwd_rows_kernel, grid, FREE, FREE, FREE, R, N, I, sx_o, sx_i, sx_n, 0, 0, 0,
            MODE=_LOGSUMEXP, BLOCK_R=block_r, BLOCK_N=block_n, COL64=col64, num_warps=warps,
        )
        return lambda xm, lse: go(xm, xm, lse)  # (no y: any pointer)
    n_pieces, piece, chunk = _split(R, N, xm.device)
    warps = int(TUNING["chunk_warps"])

    # one launch either way: a row of one piece writes its lse; a split row's last piece merges
    stats = BoundLaunch(
        _fwd_stats_kernel, (R, n_pieces), FREE, FREE, FREE, FREE, FREE, N, I, sx_o, sx_i, sx_n, piece, n_pieces,
        OUT=2 if n_pieces > 1 else 1, NP_BLOCK=next_power_of_2(n_pieces), BLOCK_N=chunk, COL64=col64,
        num_warps=warps,
    )

    def split(xm: torch.Tensor, lse: torch.Tensor) -> None:
        if n_pieces > 1:
            ws = _workspace(xm.device)
            pm, ps = _partials(ws, xm.device, 2, R, n_pieces)
            stats(xm, pm, ps, lse, _row_counters(ws, xm.device, R))
        else:
            stats(xm, lse, lse, lse, lse)  # (partials and counters unused: any pointer)

    return split


def _logsumexp_plan(x: torch.Tensor, out: torch.Tensor | None, dim: int):
    """Plan time: `plan(x, out, dim) -> lse` for `logsumexp_forward` on tensors of these layouts."""
    xm, (O, I, sx_o, sx_i, sx_n), copy = _input_rows(x, dim)
    N, R = xm.shape[-1], O * I
    shape = xm.shape[:-1]
    if out is not None and (tuple(out.shape) != tuple(shape) or out.dtype != torch.float32
                            or not out.is_contiguous() or out.device != x.device):
        raise ValueError(f"logsumexp: out must be contiguous float32 {tuple(shape)} on {x.device}")
    step = _logsumexp_step(xm, R, N, I, (sx_o, sx_i, sx_n)) if R and N else None

    def plan(x: torch.Tensor, out: torch.Tensor | None, dim: int) -> torch.Tensor:
        xm = _input_view(x, dim, copy)
        lse = torch.empty(shape, dtype=torch.float32, device=xm.device) if out is None else out
        if step is not None:
            step(xm, lse)
        elif R:  # rows of no element
            lse.fill_(float("-inf"))
        return lse

    return plan


def logsumexp_forward(x: torch.Tensor, dim: int = -1, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """log(sum(exp(x))) over `dim` in float32, no autograd.

    Args:
        x: any shape (at least 1-D), float32/float16/bfloat16.
        dim: the reduced dim.
        out: optional float32 output of `x.shape` without `dim`.

    Returns:
        float32 lse, shape of `x` without `dim`; `-inf` for all -inf (or empty) rows.
    """
    _check(x, "logsumexp")
    if x.dim() == 0:
        x = x.reshape(1)
    dim = dim % x.dim()
    key = ("logsumexp", _layout(x), _layout(out), dim, TUNING.version)
    return _planned(key, _logsumexp_plan, x, out, dim)


def _backward_step(ym: torch.Tensor, gm: torch.Tensor, dm: torch.Tensor, R: int, N: int, I: int,
                   strides: tuple, log: bool):
    """Plan time: the softmax backward's step `step(ym, gm, dm)` over rows of these layouts (`strides`:
    (outer, inner, column) of y, g and dx); the first path that applies, fastest first."""
    sy_o, sy_i, sy_n, sg_o, sg_i, sg_n, sd_o, sd_i, sd_n = strides
    col64 = _col64(N, sy_n, sg_n, sd_n)
    short = N <= int(TUNING["max_row_block_bwd"])
    ve = 16 // ym.element_size()  # elements per 16-byte vector
    if _aligned_rows((ym, gm, dm), N, (strides[:3], strides[3:6], strides[6:]), short, "bwd") and (step := _coop_step(
        # SPAN: the elements of a row's whole vectors, at most
        _bwd_coop_aligned_kernel, "bwd", (ym, gm, dm), R, max(1, N // ve * ve), I,
        (sy_o, sy_i, sg_o, sg_i, sd_o, sd_i, N), dict(LOG=log, VE=ve),
    )):
        return step
    if short:
        block_r, block_n = _short_tile(R, N)
        grid, warps = (cdiv(R, block_r),), _row_warps(block_r * block_n)
        return BoundLaunch(
            _bwd_rows_kernel, grid, FREE, FREE, FREE, R, N, I, *strides, LOG=log, BLOCK_R=block_r, BLOCK_N=block_n,
            COL64=col64, num_warps=warps,
        )
    if step := _coop_step(_bwd_coop_kernel, "bwd", (ym, gm, dm), R, N, I, strides, dict(LOG=log, COL64=col64)):
        return step
    if step := _lookback_step(_bwd_lookback_kernel, "bwd", (ym, gm, dm), 1, R, N, I, strides, dict(LOG=log, COL64=col64)):
        return step
    n_pieces, piece, chunk = _split(R, N, ym.device)
    warps = int(TUNING["chunk_warps"])

    sums = BoundLaunch(
        _bwd_partial_kernel, (R, n_pieces), FREE, FREE, FREE, N, I, *strides[:6], piece, n_pieces,
        LOG=log, BLOCK_N=chunk, COL64=col64, num_warps=warps,
    )
    write = BoundLaunch(
        _bwd_long_kernel, (R, n_pieces), FREE, FREE, FREE, FREE, N, I, *strides, piece, n_pieces, LOG=log,
        FUSED=n_pieces == 1, NP_BLOCK=next_power_of_2(n_pieces), BLOCK_N=chunk, COL64=col64, num_warps=warps,
    )

    def split(ym: torch.Tensor, gm: torch.Tensor, dm: torch.Tensor) -> None:
        part = ym  # (unused when fused)
        if n_pieces > 1:
            (part,) = _partials(_workspace(ym.device), ym.device, 1, R, n_pieces)
            sums(ym, gm, part)
        write(ym, gm, dm, part)

    return split


def _backward_plan(y: torch.Tensor, g: torch.Tensor, out: torch.Tensor | None, dim: int, log: bool):
    """Plan time: `plan(y, g, out, dim, log) -> dx` for `softmax_backward` on tensors of these layouts."""
    ym, (O, I, sy_o, sy_i, sy_n), copy_y = _input_rows(y, dim)
    gm, (_, _, sg_o, sg_i, sg_n), copy_g = _input_rows(g.to(y.dtype), dim)
    dm, (_, _, sd_o, sd_i, sd_n), direct, dense = _output_rows(out, ym, dim, y.shape, y.dtype, "softmax_backward")
    N, R = ym.shape[-1], O * I
    strides = (sy_o, sy_i, sy_n, sg_o, sg_i, sg_n, sd_o, sd_i, sd_n)
    step = _backward_step(ym, gm, dm, R, N, I, strides, log) if R and N else None

    def plan(y: torch.Tensor, g: torch.Tensor, out: torch.Tensor | None, dim: int, log: bool) -> torch.Tensor:
        ym = _input_view(y, dim, copy_y)
        dm, target = _output_view(out, ym, dim, y.dtype, direct, dense)
        if step is not None:
            step(ym, _input_view(g.to(y.dtype), dim, copy_g), dm)
        return _finish(dm, dim, target)

    return plan


def softmax_backward(
    y: torch.Tensor, g: torch.Tensor, dim: int = -1, *, log: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Gradient of softmax (log_softmax) from its output `y` and the output gradient `g`.

    softmax: `dx = y * (g - sum(g * y))`; log_softmax: `dx = g - exp(y) * sum(g)` (sums over `dim`).

    Args:
        y: the forward output, any shape, float32/float16/bfloat16.
        g: gradient of `y`, same shape (any strides, e.g. expanded).
        dim: the reduced dim.
        log: `y` is a log_softmax.
        out: optional output, shape and dtype of `y`.

    Returns:
        `dx`, shape and dtype of `y`.
    """
    _check(y, "softmax_backward")
    if y.dim() == 0:  # a one-element row: softmax is the constant 1 (log_softmax 0), its gradient 0
        return torch.zeros_like(y)
    dim = dim % y.dim()
    key = ("softmax_backward", _layout(y), _layout(g), _layout(out), dim, log, TUNING.version)
    return _planned(key, _backward_plan, y, g, out, dim, log)


def _logsumexp_backward_plan(x: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, out: torch.Tensor | None, dim: int):
    """Plan time: `plan(x, lse, g, out, dim) -> dx` for `logsumexp_backward` on tensors of the layouts
    of x and out (lse and g, whatever their layouts, become contiguous vectors per call)."""
    xm, (O, I, sx_o, sx_i, sx_n), copy = _input_rows(x, dim)
    dm, (_, _, sd_o, sd_i, sd_n), direct, dense = _output_rows(out, xm, dim, x.shape, x.dtype, "logsumexp_backward")
    N, R = xm.shape[-1], O * I
    block_n = min(next_power_of_2(N), 2048)
    block_r = max(1, min(int(TUNING["tile"]) // block_n, next_power_of_2(R)))
    n_col_tiles = cdiv(N, block_n)
    grid, warps, col64 = (cdiv(R, block_r) * n_col_tiles,), _row_warps(block_r * block_n), _col64(N, sx_n, sd_n)
    go = BoundLaunch(
        _lse_bwd_kernel, grid, FREE, FREE, FREE, FREE, R, N, I, sx_o, sx_i, sx_n, sd_o, sd_i, sd_n, n_col_tiles,
        BLOCK_R=block_r, BLOCK_N=block_n, COL64=col64, num_warps=warps,
    )

    def plan(x: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, out: torch.Tensor | None, dim: int) -> torch.Tensor:
        xm = _input_view(x, dim, copy)
        dm, target = _output_view(out, xm, dim, x.dtype, direct, dense)
        if R and N:
            go(xm, lse.reshape(R).to(torch.float32).contiguous(), g.reshape(R).contiguous(), dm)
        return _finish(dm, dim, target)

    return plan


def logsumexp_backward(
    x: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, dim: int = -1, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Gradient of logsumexp: `dx = g * exp(x - lse)`, 0 on rows whose lse is -inf.

    Args:
        x: the forward input, any shape, float32/float16/bfloat16.
        lse: float32 logsumexp of `x` over `dim`, shape of `x` without `dim`.
        g: gradient of the output, shape of `lse` (any dtype, any strides).
        dim: the reduced dim.
        out: optional output, shape and dtype of `x`.

    Returns:
        `dx`, shape and dtype of `x`.
    """
    _check(x, "logsumexp_backward")
    if x.dim() == 0:
        return logsumexp_backward(x.reshape(1), lse.reshape(()), g.reshape(()), 0).reshape(())
    dim = dim % x.dim()
    key = ("logsumexp_backward", _layout(x), _layout(out), dim, TUNING.version)
    return _planned(key, _logsumexp_backward_plan, x, lse, g, out, dim)


# ----------------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------------


class _SoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
        y = softmax_forward(x, dim, log=log)
        ctx.save_for_backward(y)
        ctx.dim, ctx.log = dim, log
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (y,) = ctx.saved_tensors
        return softmax_backward(y, g, ctx.dim, log=ctx.log), None, None


class _LogsumexpFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, keepdim: bool) -> torch.Tensor:
        lse = logsumexp_forward(x, dim)
        ctx.save_for_backward(x, lse)
        ctx.dim = dim
        out = lse if x.dtype == torch.float32 else lse.to(x.dtype)
        return out.unsqueeze(dim) if keepdim and x.dim() > 0 else out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, lse = ctx.saved_tensors
        return logsumexp_backward(x, lse, g, ctx.dim), None, None


# ----------------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------------


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax over `dim` with autograd (Triton forward and backward).

    Args:
        x: any shape, float32/float16/bfloat16 (float32 arithmetic).
        dim: the reduced dim.

    Returns:
        shape and dtype of `x`; an all -inf row gives zeros.
    """
    return _SoftmaxFn.apply(x, dim, False)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log_softmax over `dim` with autograd; an all -inf row stays -inf. Shapes as `softmax`."""
    return _SoftmaxFn.apply(x, dim, True)


def logsumexp(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """log(sum(exp(x))) over `dim` with autograd.

    Args:
        x: any shape, float32/float16/bfloat16.
        dim: the reduced dim.
        keepdim: keep `dim` with size 1.

    Returns:
        dtype of `x` (computed in float32), shape of `x` without `dim` (or with size 1); -inf for an
        all -inf row, whose gradient is 0.
    """
    return _LogsumexpFn.apply(x, dim, keepdim)
