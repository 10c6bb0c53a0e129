"""The one path every attention call takes, eager and compiled alike (as flash-attn's interface):
public function → `autograd.Function` (`attend`, `ring`) → `torch.library` custom ops
(`ringlse::attend`, `ringlse::attend_backward`, `ringlse::ring`, `ringlse::ring_backward`) → the plan of
block calls (`ringlse.attention_plan`, `ringlse.ring.entry`).

Under torch.compile each call is one opaque node: the plan, the checks and the ranks' agreement run
inside the op at run time (no graph break), and the fake implementations give the output shapes.
Options travel as op arguments (`AttentionSpec` / `RingSpec.op_args`). A plan is a pure function of the
tensors' shapes and the options, so the backward op takes the forward's from a small cache and rebuilds
it when it is gone (the ring's without a second agreement: the forward's already compared the ranks'
inputs, and the backward's come from autograd).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor

from ringlse.attention_plan import attend_plan
from ringlse.blocks.contract import torch_delta
from ringlse.checks import lse_dtype
from ringlse.ring.entry import ring_plan
from ringlse.sinks import fold_sinks, sink_grad
from ringlse.specs import (AttentionSpec, RingSpec, backend_from_name, error_message, group_from_name,
                           raise_error)

# plans of recent calls by shapes and options: a model's layers share one; enough for the calls
# between a forward and its backward in any model we know
_PLANS: OrderedDict[str, object] = OrderedDict()
_PLANS_KEPT = 64


def _key(kind: str, tensors: tuple[Tensor, ...], args: tuple) -> str:
    """A plan's key: a string, which the garbage collector does not track (a cache of tuples made the
    process's tracked-object count drift with collection timing)."""
    metas = [(tuple(t.shape), t.dtype, t.device) for t in tensors]
    values = [a.tolist() if isinstance(a, Tensor) else a for a in args]
    return repr((kind, metas, values))


def _remember(key: str, plan):
    _PLANS[key] = plan
    _PLANS.move_to_end(key)
    while len(_PLANS) > _PLANS_KEPT:
        _PLANS.popitem(last=False)
    return plan


def _fake_out_lse(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    b, n, h, _ = q.shape
    return q.new_empty((b, n, h, v.shape[-1])), q.new_empty((b, h, n), dtype=lse_dtype(q.dtype))


def _finish(out: Tensor, lse: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    """A plan's `(out, lse)` as the op returns them: `out` in q's dtype."""
    return out.to(q.dtype).contiguous(), lse.contiguous()


def _run_backward(plan, g_out, g_lse, q, k, v, sinks, out, lse) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`(dq, dk, dv, dsinks)` from the folded `out`, `lse` (`ringlse.sinks`); `dsinks` is empty without
    sinks (an op's outputs are tensors)."""
    dout, delta, lse_grad = plan.op.backward_inputs(g_out, g_lse, out)
    grads = tuple(g.contiguous() for g in plan.backward(dout, q, k, v, out, lse, delta, lse_grad))
    if sinks is None:
        return (*grads, q.new_empty(0))
    if delta is None:  # kernels that compute it themselves
        delta = torch_delta(dout, out) - (0 if lse_grad is None else lse_grad)
    return (*grads, sink_grad(sinks, lse, delta))


# The ops are defined through `torch.library.Library` rather than `torch.library.custom_op`: the
# latter wraps every call in a dynamo guard whose first use imports torch._dynamo (over a second),
# which would delay a process's first attention call, and in a ring its ranks' agreement, that long.
_LIB = torch.library.Library("ringlse", "DEF")
_ATTEND_OPTIONS = ("Tensor? cu_seqlens, Tensor? cu_seqlens_q, bool causal, float? softmax_scale, int? q_start, "
                   "int k_start, int[] window, int? chunk_size, str backend, float softcap, str what, str error")
_RING_OPTIONS = ("Tensor? cu_seqlens, bool causal, float? softmax_scale, str group, str layout, bool return_lse, "
                 "int[] window, str backend, float? timeout, bool agree, float softcap, str error, int[] head_split")
_QKV = "Tensor q, Tensor k, Tensor v, Tensor? sinks"
_GRADS_IN = "Tensor? g_out, Tensor? g_lse, Tensor q, Tensor k, Tensor v, Tensor? sinks, Tensor out, Tensor lse"


def _define(name: str, inputs: str, outputs: str, impl, fake) -> None:
    _LIB.define(f"{name}({inputs}) -> ({outputs})")
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"ringlse::{name}", fake, lib=_LIB)


def _fake_grads(g_out, g_lse, q, k, v, sinks, out, lse, *options):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(0) if sinks is None else torch.empty_like(sinks))


def _function(name: str) -> type[torch.autograd.Function]:
    """The `autograd.Function` over the op `ringlse::{name}` and its backward op; its options (after q,
    k, v and the sinks; the document boundaries among them) go to the backward as they came."""
    forward_op, backward_op = getattr(torch.ops.ringlse, name), getattr(torch.ops.ringlse, f"{name}_backward")

    class _Call(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, sinks, *options):
            ctx.set_materialize_grads(False)  # an unused lse gets None, not a zero gradient
            out, lse = forward_op(q, k, v, sinks, *options)
            ctx.save_for_backward(q, k, v, sinks, out, lse)
            ctx.options = options
            return out, lse

        @staticmethod
        def backward(ctx, g_out, g_lse):
            # saved_tensors read once: activation checkpointing (non-reentrant) lets each be unpacked once
            saved = ctx.saved_tensors
            dq, dk, dv, dsinks = backward_op(g_out, g_lse, *saved, *ctx.options)
            return (dq, dk, dv, dsinks if saved[3] is not None else None, *([None] * len(ctx.options)))

    _Call.__name__ = _Call.__qualname__ = f"_{name.capitalize()}"
    return _Call


# ---- single device -------------------------------------------------------------------------------

def _attend_plan(q: Tensor, k: Tensor, v: Tensor, args: tuple):
    raise_error(args[-1])
    key = _key("attend", (q, k, v), args)
    plan = _PLANS.get(key)
    return plan if plan is not None else _remember(key, attend_plan(q, k, v, AttentionSpec.from_op_args(*args)))


def _attend_impl(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, *args) -> tuple[Tensor, Tensor]:
    """`(out, lse)` of one single-device call (`AttentionSpec.op_args` after q, k, v, sinks)."""
    return _finish(*_attend_plan(q, k, v, args).forward(q, k, v, sinks), q)


def _attend_backward_impl(g_out, g_lse, q, k, v, sinks, out, lse, *args) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`(dq, dk, dv, dsinks)` of `ringlse::attend`."""
    return _run_backward(_attend_plan(q, k, v, args), g_out, g_lse, q, k, v, sinks, out, lse)


_define("attend", f"{_QKV}, {_ATTEND_OPTIONS}", "Tensor, Tensor", _attend_impl,
        lambda q, k, v, *options: _fake_out_lse(q, v))
_define("attend_backward", f"{_GRADS_IN}, {_ATTEND_OPTIONS}", "Tensor, Tensor, Tensor, Tensor",
        _attend_backward_impl, _fake_grads)
_Attend = _function("attend")


def attend(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, sinks: Tensor | None = None
           ) -> tuple[Tensor, Tensor]:
    """`(out, lse)` of one single-device call, differentiable in q, k, v (and `sinks`) through both;
    `sinks` `[h]` are folded in once, after every block (`ringlse.sinks`)."""
    return _Attend.apply(q, k, v, sinks, *spec.op_args())


# ---- the ring ------------------------------------------------------------------------------------

def _ring_plan(q: Tensor, k: Tensor, v: Tensor, args: tuple, agree: bool):
    spec = RingSpec.from_op_args(*args)
    plan = ring_plan(q, k, v, causal=spec.causal, softmax_scale=spec.softmax_scale, group=group_from_name(spec.group),
                     layout=spec.layout, return_lse=spec.return_lse, window_size=spec.window_size,
                     cu_seqlens=spec.cu_seqlens, backend=backend_from_name(spec.backend), timeout=spec.timeout,
                     agree=agree and spec.agree, local_error=error_message(spec.error) or None,
                     softcap=spec.softcap, head_split=spec.head_split)
    return _remember(_key("ring", (q, k, v), args), plan)


def _ring_impl(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, *args) -> tuple[Tensor, Tensor]:
    """`(out, lse)` of `ring_attention` over the process group named in `args` (`RingSpec.op_args`)."""
    # each rank folds the sinks into its own rows once, after the ring
    return _finish(*fold_sinks(*_ring_plan(q, k, v, args, agree=True).forward(q, k, v), sinks), q)


def _ring_backward_impl(g_out, g_lse, q, k, v, sinks, out, lse, *args) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`(dq, dk, dv, dsinks)` of `ringlse::ring` (the ranks' backward passes meet in the ring)."""
    plan = _PLANS.get(_key("ring", (q, k, v), args)) or _ring_plan(q, k, v, args, agree=False)
    return _run_backward(plan, g_out, g_lse, q, k, v, sinks, out, lse)


_define("ring", f"{_QKV}, {_RING_OPTIONS}", "Tensor, Tensor", _ring_impl,
        lambda q, k, v, *options: _fake_out_lse(q, v))
_define("ring_backward", f"{_GRADS_IN}, {_RING_OPTIONS}", "Tensor, Tensor, Tensor, Tensor", _ring_backward_impl,
        _fake_grads)
_Ring = _function("ring")


def ring(q: Tensor, k: Tensor, v: Tensor, spec: RingSpec, sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`(out, lse)` of one `ring_attention` call, differentiable in q, k, v (and `sinks`) through both;
    each rank folds the sinks into its own rows once, after the ring."""
    return _Ring.apply(q, k, v, sinks, *spec.op_args())
