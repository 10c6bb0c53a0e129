"""Single-device attention over any block op: `block_attention` (one block at global positions),
`attention` (bottom-right causal), `chunked_attention` (keys in chunks merged by lse, bounded memory)
and `varlen_attention` (flash-attn's packed layout). Each is a plan of block calls under the autograd
skeleton of `ringlse.blocks.contract`; masks follow CONVENTIONS.md §4 and §10 (`ringlse.masks`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import torch

from ringlse import library
from ringlse.blocks import get_block_op
from ringlse.blocks.contract import BlockCall, BlockOp, GradInputs, GradTarget, Masks, StateRows, planned_attention
from ringlse.checks import check_flag, check_qkv, check_scale, lse_dtype
from ringlse.masks import BlockKind, Rule, Span, block_kind, check_docs, check_window, planned_intervals
from ringlse.merge import PartSum


class _CallPlan:
    """Block calls over one q, k, v: a lone call covering everything returns its state as it is;
    several fill float32 accumulators (`StateRows`: the first call over some rows writes them, later
    ones merge in place, into views of them). Gradients are collected as the op's accumulation says
    (`ringlse.blocks.accumulate`): kernels that return theirs (cuDNN, FlashAttention) give parts
    summed in one pass, so no float32 accumulator is zeroed, read and rewritten per call."""

    def __init__(self, op: BlockOp, scale: float, calls: list[BlockCall]):
        self.op, self.scale, self.calls = op, scale, calls

    def forward(self, q, k, v):
        sq = q.shape[1]
        if len(self.calls) == 1 and self.calls[0][:4] == (0, sq, 0, k.shape[1]):
            return self.op.forward(q, k, v, **self.calls[0].args(self.scale).kwargs())
        state = StateRows(q.shape, lse_dtype(q.dtype), q.device)
        for c in self.calls:
            state.add(self.op, q[:, c.q0:c.q1], k[:, c.k0:c.k1], v[:, c.k0:c.k1], c.q0, c.q1,
                      **c.args(self.scale).kwargs())
        return state.result()

    def backward(self, dout, q, k, v, out, lse, delta, lse_grad):
        acc = lse_dtype(q.dtype)
        dq, dk, dv = (PartSum(t.shape, acc, t.device) for t in (q, k, v))
        g = GradInputs(dout, q, out, lse, delta, lse_grad)
        for c in self.calls:
            self.op.accumulation.add_grads(self.op, g, c, (k, v), c.args(self.scale), GradTarget(dq, c.q0, c.q1),
                                           GradTarget(dk, c.k0, c.k1), GradTarget(dv, c.k0, c.k1))
        return dq.result(q.dtype), dk.result(k.dtype), dv.result(v.dtype)


def _plain_calls(q0: int, q1: int, k0: int, k1: int, causal: bool, q_start: int, k_start: int) -> list[BlockCall]:
    """The block rows `[q0, q1)` x `[k0, k1)` at global `q_start`, `k_start` under plain causal (or no)
    masking: nothing, or one call (causal only where the boundary crosses it)."""
    kind = block_kind(q1 - q0, k1 - k0, q_start, k_start, causal)
    if kind is BlockKind.EMPTY:
        return []
    partial = kind is BlockKind.PARTIAL
    return [BlockCall(q0, q1, k0, k1, partial, q_start if partial else 0, k_start if partial else 0)]


def _block_calls(op: BlockOp, rule: Rule, q0: int, q1: int, k0: int, k1: int, q_start: int, k_start: int,
                 what: str) -> Iterator[BlockCall]:
    """Calls covering rows `[q0, q1)` (global positions from `q_start`) x keys `[k0, k1)` (from
    `k_start`) under `rule`: plain calls where it is plain, else intervals for ops that take them,
    else one plain call per document for ops that do not (windows then raise)."""
    if rule.plain:
        yield from _plain_calls(q0, q1, k0, k1, rule.causal, q_start, k_start)
        return
    if op.caps.masks is Masks.INTERVALS:
        iv = planned_intervals(rule, Span(q_start, q1 - q0), Span(k_start, k1 - k0))
        kind = iv.kind()
        if kind is BlockKind.FULL:
            yield BlockCall(q0, q1, k0, k1, False, 0, 0)
        elif kind is BlockKind.PARTIAL:
            yield BlockCall(q0, q1, k0, k1, False, 0, 0, iv)
        return
    windowed = rule.window != (-1, -1)
    if windowed and op.caps.masks is not Masks.WINDOW:
        raise ValueError(f"{what}: window_size needs a backend that takes windows; the {op.name!r} block op does not")
    segments = [(q0, q1, k0, k1)]
    if rule.docs is not None:  # each document alone is a block of its own
        segments = [(max(q0, q0 + a - q_start), min(q1, q0 + b - q_start), max(k0, k0 + a - k_start),
                     min(k1, k0 + b - k_start)) for a, b in zip(rule.docs, rule.docs[1:])]
    for qa, qb, ka, kb in segments:
        if qa >= qb or ka >= kb:
            continue
        qs, ks = q_start + qa - q0, k_start + ka - k0
        if not windowed:
            yield from _plain_calls(qa, qb, ka, kb, rule.causal, qs, ks)
            continue
        # a window as a rule: cut to the rows that see keys and the keys they see (`fa4_window_pieces`)
        iv = planned_intervals(Rule(rule.causal, rule.window), Span(qs, qb - qa), Span(ks, kb - ka))
        box, kind = iv.box(), iv.kind()
        if box is None:
            continue
        if kind is BlockKind.FULL:
            yield BlockCall(qa, qb, ka, kb, False, 0, 0)
            continue
        r0, r1, c0, c1 = box
        yield BlockCall(qa + r0, qa + r1, ka + c0, ka + c1, rule.causal, qs + r0, ks + c0, window=rule.window)


def _attend(q, k, v, *, causal, softmax_scale, q_start, k_start, window_size, cu_seqlens, chunk_size, backend,
            what):
    """`(out, lse)` over key chunks of `chunk_size` (None: one chunk), after every check; `q_start=None`
    aligns the ends of q and k (bottom-right). Document boundaries index keys and queries alike (both
    from position 0). Under torch.compile, one `ringlse::attend` op (`ringlse.library`) runs it."""
    if isinstance(backend, str) and torch.compiler.is_compiling():
        return library.attend_op(q, k, v, causal=causal, softmax_scale=softmax_scale, q_start=q_start,
                                 k_start=k_start, window_size=window_size, cu_seqlens=cu_seqlens,
                                 chunk_size=chunk_size, backend=backend, what=what)
    return planned_attention(q, k, v, attend_plan(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                                  q_start=q_start, k_start=k_start, window_size=window_size,
                                                  cu_seqlens=cu_seqlens, chunk_size=chunk_size, backend=backend,
                                                  what=what))


def attend_plan(q, k, v, *, causal, softmax_scale, q_start, k_start, window_size, cu_seqlens, chunk_size, backend,
                what) -> _CallPlan:
    """The plan of `_attend`'s call (arguments as there), after every check."""
    check_qkv(q, k, v, what)
    check_flag(causal, "causal", what)
    if q_start is None:
        q_start = k_start + k.shape[1] - q.shape[1]
    for name, value in (("q_start", q_start), ("k_start", k_start)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{what}: {name} must be an int, got {type(value).__name__}")
    window = check_window(window_size, what)
    end = max(q_start + q.shape[1], k_start + k.shape[1])
    docs = check_docs(cu_seqlens, end, what)
    scale = check_scale(softmax_scale, q.shape[-1], what)
    # windows need intervals or an op taking them as a rule (fa4); documents alone are cut into plain
    # calls for ops without intervals, except that `auto` takes an op with intervals for both (one
    # launch per block, not per document)
    windowed = window != (-1, -1)
    op = get_block_op(backend, q.device, q.dtype, masked=backend == "auto" and (windowed or docs is not None),
                      head_dim=q.shape[-1], window=windowed)
    rule = Rule(causal, window, docs)
    sq, sk = q.shape[1], k.shape[1]
    step = max(sk if chunk_size is None else chunk_size, 1)
    calls = [c for k0 in range(0, sk, step)
             for c in _block_calls(op, rule, 0, sq, k0, min(sk, k0 + step), q_start, k_start + k0, what)]
    return _CallPlan(op, scale, calls)


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    q_start: int = 0,
    k_start: int = 0,
    window_size: tuple[int, int] = (-1, -1),
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    backend: str | BlockOp = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block of queries to one block of keys at global positions, with its lse.

    Args:
        q: `[batch, seqlen_q, nheads, headdim]`; k, v: `[batch, seqlen_k, nheads_kv, headdim]`.
        causal: key at global position `t` visible to the query at `p` only if `t <= p`, with
            `p = q_start + i`, `t = k_start + j` (CONVENTIONS.md §4).
        softmax_scale: defaults to `headdim ** -0.5`.
        q_start, k_start: global positions of the first query and key.
        window_size: `(left, right)`: the query at `p` sees keys in `[p - left, p + right]`; -1 is
            unbounded (CONVENTIONS.md §10).
        cu_seqlens: document boundaries `[0, e1, ..., S]` over global positions, `S` the end of the
            later of the two blocks; a query sees keys of its own document only. The same for every
            batch row.
        backend: `auto` (`triton` on CUDA where it computes the dtype, else `sdpa`, else `torch`),
            `triton`, `sdpa`, `flash`, `torch`, or a `BlockOp`. Windows need `torch` (or a backend
            that takes intervals); documents work everywhere (cut into per-document calls where the
            backend takes no intervals).

    Returns:
        `(out, lse)`: `out` like `q`; `lse` `[batch, nheads, seqlen_q]` float32 (float64 for float64),
        `-inf` with `out = 0` on rows that see no key. Both are differentiable, so blocks merged with
        `merge_attn_states` backpropagate exactly.

    Raises:
        ValueError / TypeError: malformed inputs or options, or a backend that cannot run the call.
    """
    return _attend(q, k, v, causal=causal, softmax_scale=softmax_scale, q_start=q_start, k_start=k_start,
                   window_size=window_size, cu_seqlens=cu_seqlens, chunk_size=None, backend=backend,
                   what="block_attention")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str | BlockOp = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Single-device softmax attention; causal masks and windows align bottom-right when
    `seqlen_q != seqlen_k` (query `i` at position `seqlen_k - seqlen_q + i`, key `j` at `j`).

    Args:
        q: `[batch, seqlen_q, nheads, headdim]`; k, v: `[batch, seqlen_k, nheads_kv, headdim]`.
        causal, softmax_scale, window_size, backend: as in `block_attention`.
        cu_seqlens: document boundaries over key positions `[0, ..., seqlen_k]`.
        return_lse: also return lse `[batch, nheads, seqlen_q]`.

    Returns:
        `out` like `q`, or `(out, lse)`.
    """
    check_flag(return_lse, "return_lse", "attention")
    out, lse = _attend(q, k, v, causal=causal, softmax_scale=softmax_scale, q_start=None, k_start=0,
                       window_size=window_size, cu_seqlens=cu_seqlens, chunk_size=None, backend=backend,
                       what="attention")
    return (out, lse) if return_lse else out


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    chunk_size: int,
    window_size: tuple[int, int] = (-1, -1),
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str | BlockOp = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over K/V chunks of `chunk_size` keys, merged exactly by lse: memory for scores
    stays `O(seqlen_q * chunk_size)` however long the keys, forward and backward.

    Args:
        q: `[batch, seqlen_q, nheads, headdim]`; k, v: `[batch, seqlen_k, nheads_kv, headdim]`.
        causal, window_size, cu_seqlens: as in `ringlse.attention` (bottom-right); chunks the mask
            empties are skipped.
        softmax_scale: defaults to `headdim ** -0.5`.
        chunk_size: keys per chunk (>= 1).
        return_lse: also return lse `[batch, nheads, seqlen_q]`.
        backend: block op, as in `ringlse.block_attention`.

    Returns:
        `out` like `q` (or `(out, lse)`), differentiable in q, k, v.
    """
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunked_attention: chunk_size must be a positive int, got {chunk_size!r}")
    check_flag(return_lse, "return_lse", "chunked_attention")
    out, lse = _attend(q, k, v, causal=causal, softmax_scale=softmax_scale, q_start=None, k_start=0,
                       window_size=window_size, cu_seqlens=cu_seqlens, chunk_size=chunk_size, backend=backend,
                       what="chunked_attention")
    return (out, lse) if return_lse else out


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: Sequence[int] | torch.Tensor,
    cu_seqlens_k: Sequence[int] | torch.Tensor,
    *,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: str | BlockOp = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """flash-attn's varlen attention (`flash_attn_varlen_func`'s layout and semantics), on any backend.

    Document `i` of q (rows `[cu_seqlens_q[i], cu_seqlens_q[i+1])`) attends document `i` of k only;
    causal masks and windows align bottom-right within each pair (query `r` of a document of `lq`
    queries sits at position `lk - lq + r` of its `lk` keys).

    Args:
        q: `[total_q, nheads, headdim]`; k, v: `[total_k, nheads_kv, headdim]`.
        cu_seqlens_q, cu_seqlens_k: document boundaries, as many documents in both.
        causal, window_size, softmax_scale, backend: as in `ringlse.block_attention`.
        return_lse: also return lse `[nheads, total_q]` (float32; float64 for float64 inputs).

    Returns:
        `out` `[total_q, nheads, headdim]` like `q`, or `(out, lse)`; differentiable.
    """
    what = "varlen_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{what}: {name} must be [total, nheads, headdim], got {getattr(t, 'shape', t)}")
    check_flag(causal, "causal", what)
    check_flag(return_lse, "return_lse", what)
    qb, kb = check_docs(cu_seqlens_q, q.shape[0], what), check_docs(cu_seqlens_k, k.shape[0], what)
    if len(qb) != len(kb):
        raise ValueError(f"{what}: cu_seqlens_q has {len(qb) - 1} documents, cu_seqlens_k {len(kb) - 1}")
    window = check_window(window_size, what)
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    check_qkv(q4, k4, v4, what)
    scale = check_scale(softmax_scale, q.shape[-1], what)
    op = get_block_op(backend, q.device, q.dtype, masked=backend == "auto" and window != (-1, -1),
                      head_dim=q.shape[-1], window=window != (-1, -1))
    rule = Rule(causal, window)
    calls = []
    for (qa, qe), (ka, ke) in zip(zip(qb, qb[1:]), zip(kb, kb[1:])):
        # positions: keys at their row index, queries aligned to end with their document's keys
        q_start = ka + (ke - ka) - (qe - qa)
        calls += _block_calls(op, rule, qa, qe, ka, ke, q_start, ka, what)
    out, lse = planned_attention(q4, k4, v4, _CallPlan(op, scale, calls))
    return (out[0], lse[0]) if return_lse else out[0]
