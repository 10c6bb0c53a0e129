"""Plans of block calls for single-device attention (CONVENTIONS.md §4, §10): which block-op calls
cover one `attention` / `block_attention` / `chunked_attention` / `varlen_attention` call, and how they
run forward and backward (`_CallPlan`). Built from the tensors and an `AttentionSpec`, after every check;
run by `ringlse.ops`."""

from __future__ import annotations

import torch

from ringlse.blocks import get_block_op
from ringlse.blocks.contract import BlockCall, BlockOp, GradInputs, GradTarget, StateRows
from ringlse.checks import check_qkv, check_scale, lse_dtype
from ringlse.mask_calls import rule_calls
from ringlse.masks import Rule, check_docs
from ringlse.merge import PartSum
from ringlse.sinks import fold_sinks
from ringlse.specs import AttentionSpec, backend_from_name


class _CallPlan:
    """Block calls over one q, k, v: a lone call covering everything returns its state as it is;
    several fill float32 accumulators (`StateRows`: the first call over some rows writes them, later
    ones merge in place, into views of them). Gradients are collected as the op's accumulation says
    (`ringlse.blocks.accumulate`): kernels that return theirs (cuDNN, FlashAttention) give parts
    summed in one pass, so no float32 accumulator is zeroed, read and rewritten per call."""

    def __init__(self, op: BlockOp, scale: float, calls: list[BlockCall], softcap: float = 0.0):
        self.op, self.scale, self.calls, self.softcap = op, scale, calls, softcap

    def forward(self, q, k, v, sinks=None):
        """`(out, lse)` of the calls, `sinks` `[h]` folded in (by the kernel of a lone call whose op takes
        them, else afterwards: `ringlse.sinks`)."""
        sq = q.shape[1]
        if len(self.calls) == 1 and self.calls[0][:4] == (0, sq, 0, k.shape[1]):
            kwargs = self.calls[0].args(self.scale, self.softcap).kwargs()
            if sinks is not None and self.op.caps.sinks:
                return self.op.forward(q, k, v, **kwargs, sinks=sinks)
            return fold_sinks(*self.op.forward(q, k, v, **kwargs), sinks)
        state = StateRows((*q.shape[:3], v.shape[-1]), lse_dtype(q.dtype), q.device)
        for c in self.calls:
            state.add(self.op, q[:, c.q0:c.q1], k[:, c.k0:c.k1], v[:, c.k0:c.k1], c.q0, c.q1,
                      **c.args(self.scale, self.softcap).kwargs())
        return fold_sinks(*state.result(), sinks)

    def backward(self, dout, q, k, v, out, lse, delta, lse_grad):
        acc = lse_dtype(q.dtype)
        dq, dk, dv = (PartSum(t.shape, acc, t.device) for t in (q, k, v))
        g = GradInputs(dout, q, out, lse, delta, lse_grad)
        for c in self.calls:
            self.op.accumulation.add_grads(self.op, g, c, (k, v), c.args(self.scale, self.softcap),
                                           GradTarget(dq, c.q0, c.q1),
                                           GradTarget(dk, c.k0, c.k1), GradTarget(dv, c.k0, c.k1))
        return dq.result(q.dtype), dk.result(k.dtype), dv.result(v.dtype)


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
             for c in rule_calls(op.caps.masks, op.name, rule, 0, sq, k0, min(sk, k0 + step), q_start,
                                    spec.k_start + k0, what)]
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
        calls += rule_calls(op.caps.masks, op.name, rule, qa, qe, ka, ke, q_start, ka, what)
    return _CallPlan(op, scale, calls, spec.softcap)
