"""`@triton.jit` helpers that every softmax kernel shares: where a row starts, its columns' offsets, and
the merge of per-lane (or per-piece) `(max, sum)` statistics.

Any tensor is seen as `R` rows of `N` columns: the reduced dim is moved last by a view and the other
dims are folded into at most two (outer, inner) groups with their own strides (`layout.py`). Row `r` =
`o * I + i` starts at `o * s_o + i * s_i`; column `n` is `n * s_n` further.
"""

from __future__ import annotations

import triton
import triton.language as tl

# constexpr globals: the only kind a @triton.jit function may read
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def row_start(rows, I, s_o, s_i):
    """Element offset (int64) of the first column of each row `rows` (row = o * I + i)."""
    r = tl.cast(rows, tl.int64)  # (tl.cast: a loop index is a plain int under the interpreter)
    o = r // I
    return o * s_o + (r - o * I) * s_i


@triton.jit
def col_offsets(cols, s_n, COL64: tl.constexpr):
    # int32 offsets keep the address arithmetic cheap; COL64 when N * s_n could overflow them
    if COL64:
        return cols.to(tl.int64) * s_n
    else:
        return cols * s_n


@triton.jit
def merge_lanes(m, s):
    """Merge per-lane (or per-piece) `(m, s)` into one `(M, S)`: M the max (-inf if all are), S the sum
    of exp(x - M_safe) with M_safe = 0 for an all -inf row, so that S = 0 there and log(S) = -inf."""
    M = tl.max(m, axis=0)
    M_safe = tl.where(M == float("-inf"), 0.0, M)
    S = tl.sum(s * tl.exp2((m - M_safe) * LOG2E), axis=0)
    return M, S
