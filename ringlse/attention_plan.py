"""Plans of block calls for single-device attention (CONVENTIONS.md §4, §10): which block-op calls
cover one `attention` / `block_attention` / `chunked_attention` / `varlen_attention` call, and how they
run forward and backward (`_CallPlan`). Built from the tensors and an `AttentionSpec`, after every check;
run by `ringlse.ops`."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ringlse.blocks import get_block_op
from ringlse.blocks.contract import BlockCall, BlockOp, GradInputs, GradTarget, Masks, StateRows
from ringlse.checks import check_qkv, check_scale, lse_dtype
from ringlse.masks import BlockKind, Rule, Span, block_kind, check_docs, planned_intervals
from ringlse.merge import PartSum
from ringlse.specs import AttentionSpec, backend_from_name


class _CallPlan:
    """Block calls over one q, k, v: a lone call covering everything returns its state as it is;
    several fill float32 accumulators (`StateRows`: the first call over some rows writes them, later
    ones merge in place, into views of them). Gradients are collected as the op's accumulation says
    (`ringlse.blocks.accumulate`): kernels that return theirs (cuDNN, FlashAttention) give parts
    summed in one pass, so no float32 accumulator is zeroed, read and rewritten per call."""

    def __init__(self, op: BlockOp, scale: float, calls: list[BlockCall], softcap: float = 0.0):
        self.op, self.scale, self.calls, self.softcap = op, scale, calls, softcap

    def forward(self, q, k, v):
        sq = q.shape[1]
        if len(self.calls) == 1 and self.calls[0][:4] == (0, sq, 0, k.shape[1]):
            return self.op.forward(q, k, v, **self.calls[0].args(self.scale, self.softcap).kwargs())
        state = StateRows((*q.shape[:3], v.shape[-1]), lse_dtype(q.dtype), q.device)
        for c in self.calls:
            state.add(self.op, q[:, c.q0:c.q1], k[:, c.k0:c.k1], v[:, c.k0:c.k1], c.q0, c.q1,
                      **c.args(self.scale, self.softcap).kwargs())
        return state.result()

    def backward(self, dout, q, k, v, out, lse, delta, lse_grad):
        acc = lse_dtype(q.dtype)
        dq, dk, dv = (PartSum(t.shape, acc, t.device) for t in (q, k, v))
        g = GradInputs(dout, q, out, lse, delta, lse_grad)
        for c in self.calls:
            self.op.accumulation.add_grads(self.op, g, c, (k, v), c.args(self.scale, self.softcap),
                                           GradTarget(dq, c.q0, c.q1),
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


def attend_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> _CallPlan:
    """The plan of one single-device call (`spec.what` names the entry point in messages), after every
    check; varlen when `spec.cu_seqlens_q` is set."""
    if spec.cu_seqlens_q is not None:
        return _varlen_plan(q, k, v, spec)
    what = spec.what
    check_qkv(q, k, v, what)
    q_start = spec.k_start + k.shape[1] - q.shape[1] if spec.q_start is None else spec.q_start
    window = spec.window_size  # checked by AttentionSpec.make
    end = max(q_start + q.shape[1], spec.k_start + k.shape[1])
    docs = check_docs(spec.cu_seqlens, end, what, past_end=True)
    scale = check_scale(spec.softmax_scale, q.shape[-1], what)
    # windows need intervals or an op taking them as a rule (fa4); documents alone are cut into plain
    # calls for ops without intervals, except that `auto` takes an op with intervals for both (one
    # launch per block, not per document)
    windowed = window != (-1, -1)
    backend = backend_from_name(spec.backend)
    op = get_block_op(backend, q.device, q.dtype, masked=backend == "auto" and (windowed or docs is not None),
                      head_dim=q.shape[-1], window=windowed, softcap=spec.softcap, v_head_dim=v.shape[-1])
    rule = Rule(spec.causal, window, docs)
    sq, sk = q.shape[1], k.shape[1]
    step = max(sk if spec.chunk_size is None else spec.chunk_size, 1)
    calls = [c for k0 in range(0, sk, step)
             for c in _block_calls(op, rule, 0, sq, k0, min(sk, k0 + step), q_start, spec.k_start + k0, what)]
    return _CallPlan(op, scale, calls, spec.softcap)


def _varlen_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> _CallPlan:
    """`varlen_attention`'s plan over `[1, total, h, d]` views: document `i` of q attends document `i`
    of k, causal and windows aligned bottom-right within each pair."""
    what = spec.what
    check_qkv(q, k, v, what)
    qb, kb = check_docs(spec.cu_seqlens_q, q.shape[1], what), check_docs(spec.cu_seqlens, k.shape[1], what)
    if len(qb) != len(kb):
        raise ValueError(f"{what}: cu_seqlens_q has {len(qb) - 1} documents, cu_seqlens_k {len(kb) - 1}")
    window = spec.window_size  # checked by AttentionSpec.make
    scale = check_scale(spec.softmax_scale, q.shape[-1], what)
    backend = backend_from_name(spec.backend)
    op = get_block_op(backend, q.device, q.dtype, masked=backend == "auto" and window != (-1, -1),
                      head_dim=q.shape[-1], window=window != (-1, -1), softcap=spec.softcap, v_head_dim=v.shape[-1])
    rule = Rule(spec.causal, window)
    calls = []
    for (qa, qe), (ka, ke) in zip(zip(qb, qb[1:]), zip(kb, kb[1:])):
        # positions: keys at their row index, queries aligned to end with their document's keys
        q_start = ka + (ke - ka) - (qe - qa)
        calls += _block_calls(op, rule, qa, qe, ka, ke, q_start, ka, what)
    return _CallPlan(op, scale, calls, spec.softcap)
