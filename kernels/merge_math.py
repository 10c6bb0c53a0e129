"""The merge of attention states (CONVENTIONS.md §3) as Triton device functions: its one copy in the kernels.

Per row, states `(lse_i, out_i)` merge to
    m = max_i lse_i (0 where every lse is -inf),   w_i = exp(lse_i - m),   t = sum_i w_i,
    lse = m + log t (-inf where t == 0),           out = sum_i (w_i / t) out_i,
and a state of weight exactly 0 contributes exactly 0 (even if its `out` holds garbage), so rows where
every state is `-inf` come out `(0, -inf)` and no exp ever sees `-inf - -inf`.

Two orders of the same arithmetic, both built from these functions:
- online, state after state (`merge_fold`, then `merge_finish`): a running `(m, t, acc)`, `m` the
  largest lse folded in so far, `t` the sum of the weights relative to it, `acc` the weighted sum of
  the outputs, both rescaled when `m` grows, and `out = acc / t` at the end. Two exps per state. The
  forward's epilogue (`attention_fwd`: the running accumulator folded into the block's own
  online-softmax state) and `merge_parts` (one part after the other, one tile live at a time).
- max first, for a kernel that holds every state's lse before it touches an output (`merge`, all
  loads in flight at once): `shift = merge_shift(max)`, `w_i = merge_weight(lse_i, shift)`,
  `t = sum w_i`, `(lse, t_safe) = merge_lse(shift, t)`, `out = sum merge_term(w_i / t_safe, out_i)`.
  One exp per state; the weights are divided once per row, not the outputs once per element.
Every function works in the base its caller picks (`BASE2`: exp2/log2 for kernels whose scores are in
base 2, exp/log otherwise); a caller converts lse values at its boundary (loads and stores), never here.
All are small and inline into the caller; none loads or stores.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _exp(x, BASE2: tl.constexpr):
    if BASE2:
        return tl.math.exp2(x)
    else:
        return tl.exp(x)


@triton.jit
def _log(x, BASE2: tl.constexpr):
    if BASE2:
        return tl.math.log2(x)
    else:
        return tl.log(x)


@triton.jit
def merge_shift(m):
    """What to subtract before exponentiating: the max lse `m`, or 0 where it is -inf (every weight
    then comes out exp(-inf) = 0 rather than NaN)."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def merge_weight(lse, shift, BASE2: tl.constexpr):
    """The weight `exp(lse - shift)` of a state (0 for an lse of -inf)."""
    return _exp(lse - shift, BASE2)


@triton.jit
def merge_term(w, o):
    """`w * o` for weights `w` `[R]` and outputs `o` `[R, D]`, exactly 0 where `w` is 0 (never 0 * nan)."""
    return tl.where(w[:, None] > 0, w[:, None] * o, 0.0)


@triton.jit
def merge_fold(m, t, acc, lse, o, BASE2: tl.constexpr):
    """Fold the state `(lse, o)` into the running `(m, t, acc)`; an empty running state is
    `(-inf, 0, 0)`. Two exps per row."""
    m_new = tl.maximum(m, lse)
    shift = merge_shift(m_new)
    alpha = merge_weight(m, shift, BASE2)
    w = merge_weight(lse, shift, BASE2)
    return m_new, t * alpha + w, acc * alpha[:, None] + merge_term(w, o)


@triton.jit
def merge_lse(m, t, BASE2: tl.constexpr):
    """`(lse, t_safe)` for the max `m` (or its `merge_shift`: they differ only where `t == 0`) and the
    weight sum `t`: lse `-inf` where `t == 0`, and the divisor of the outputs (`t`, or 1 where it is 0,
    so that nothing is ever 0/0)."""
    nonempty = t > 0
    t_safe = tl.where(nonempty, t, 1.0)
    lse = tl.where(nonempty, m + _log(t_safe, BASE2), float("-inf"))
    return lse, t_safe


@triton.jit
def merge_finish(m, t, acc, BASE2: tl.constexpr):
    """`(lse, out)` of the running state `(m, t, acc)`: `(-inf, 0)` where nothing was folded in."""
    lse, t_safe = merge_lse(m, t, BASE2)
    # one reciprocal per row, then products: `acc / t` compiles to a reciprocal per element
    # (`div.full.f32`, on the quarter-rate MUFU unit: ~0.5 us of a 128 x 128 tile's epilogue)
    return lse, acc * (1.0 / t_safe)[:, None]
