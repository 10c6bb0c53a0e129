"""`torch.library` custom ops, so that torch.compile sees each attention call as one opaque node.

Under `torch.compile`, `attention`, `block_attention`, `chunked_attention` and `ring_attention` call
`ringlse::attend` / `ringlse::ring` instead of running their Python: the plan of block calls, the
checks and the ranks' agreement run inside the op, at run time, so dynamo records one node per call
(no graph break), the fake implementations give the output shapes, and the registered autograd runs the
backward as a second op (`ringlse::attend_backward`, `ringlse::ring_backward`). Eager calls run the
same plans directly, without the dispatcher.

Options travel as op arguments (ints, floats, strings, an optional boundaries tensor); the ring's
process group by its name (`ProcessGroup.group_name`, "" for the default group). The ring's backward
rebuilds the forward's plan without a second agreement: the forward's already compared every rank's
inputs, and the backward's come from autograd.
"""

from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ringlse.checks import lse_dtype


def _boundaries(cu_seqlens: Sequence[int] | Tensor | None) -> Optional[Tensor]:
    """Document boundaries as an op argument (a constant tensor when given as a list)."""
    if cu_seqlens is None or isinstance(cu_seqlens, Tensor):
        return cu_seqlens
    return torch.tensor(list(cu_seqlens), dtype=torch.int64)


def _fake_out_lse(q: Tensor) -> tuple[Tensor, Tensor]:
    b, n, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, n), dtype=lse_dtype(q.dtype))


def _run_backward(plan, g_out, g_lse, q, k, v, out, lse) -> tuple[Tensor, Tensor, Tensor]:
    dout, delta, lse_grad = plan.op.backward_inputs(g_out, g_lse, out)
    return tuple(g.contiguous() for g in plan.backward(dout, q, k, v, out, lse, delta, lse_grad))


def _autograd(forward_op, backward_op) -> None:
    """Register `backward_op(g_out, g_lse, q, k, v, out, lse, *options)` as `forward_op`'s gradient."""

    def setup_context(ctx, inputs, output):
        q, k, v, *options = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.options = options

    def backward(ctx, g_out, g_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward_op(g_out, g_lse, q, k, v, out, lse, *ctx.options)
        return (dq, dk, dv, *([None] * len(ctx.options)))

    forward_op.register_autograd(backward, setup_context=setup_context)


# ---- single device: attention, block_attention, chunked_attention --------------------------------------

def _attend_plan(q, k, v, causal, softmax_scale, q_start, k_start, window, cu_seqlens, chunk_size, backend, what):
    from ringlse.attention import attend_plan  # the public layer imports this module

    return attend_plan(q, k, v, causal=causal, softmax_scale=softmax_scale, q_start=q_start, k_start=k_start,
                       window_size=tuple(window), cu_seqlens=cu_seqlens, chunk_size=chunk_size, backend=backend,
                       what=what)


@torch.library.custom_op("ringlse::attend", mutates_args=())
def attend(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: Optional[float], q_start: Optional[int],
           k_start: int, window: list[int], cu_seqlens: Optional[Tensor], chunk_size: Optional[int], backend: str,
           what: str) -> tuple[Tensor, Tensor]:
    """`(out, lse)` of `ringlse.attention._attend` with these arguments."""
    plan = _attend_plan(q, k, v, causal, softmax_scale, q_start, k_start, window, cu_seqlens, chunk_size, backend,
                        what)
    out, lse = plan.forward(q, k, v)
    return out.to(q.dtype).contiguous(), lse.contiguous()


@attend.register_fake
def _(q, k, v, causal, softmax_scale, q_start, k_start, window, cu_seqlens, chunk_size, backend, what):
    return _fake_out_lse(q)


@torch.library.custom_op("ringlse::attend_backward", mutates_args=())
def attend_backward(g_out: Optional[Tensor], g_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                    lse: Tensor, causal: bool, softmax_scale: Optional[float], q_start: Optional[int], k_start: int,
                    window: list[int], cu_seqlens: Optional[Tensor], chunk_size: Optional[int], backend: str,
                    what: str) -> tuple[Tensor, Tensor, Tensor]:
    """`(dq, dk, dv)` of `ringlse::attend`."""
    plan = _attend_plan(q, k, v, causal, softmax_scale, q_start, k_start, window, cu_seqlens, chunk_size, backend,
                        what)
    return _run_backward(plan, g_out, g_lse, q, k, v, out, lse)


@attend_backward.register_fake
def _(g_out, g_lse, q, k, v, out, lse, *options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_autograd(attend, attend_backward)


def attend_op(q, k, v, *, causal, softmax_scale, q_start, k_start, window_size, cu_seqlens, chunk_size, backend,
              what) -> tuple[Tensor, Tensor]:
    """`ringlse::attend` with `ringlse.attention._attend`'s keyword arguments."""
    return attend(q, k, v, causal, softmax_scale, q_start, k_start, list(window_size), _boundaries(cu_seqlens),
                  chunk_size, backend, what)


# ---- the ring ----------------------------------------------------------------------------------------

def group_name(group: dist.ProcessGroup | None) -> str:
    """The name `ringlse::ring` finds `group` by ("" for the default group)."""
    return "" if group is None else group.group_name


def _group(name: str) -> dist.ProcessGroup | None:
    if not name:
        return None
    for group, known in dist.distributed_c10d._world.pg_names.items():
        if known == name:
            return group
    raise ValueError(f"ring_attention: no process group named {name!r} in this process")


def _ring_plan(q, k, v, causal, softmax_scale, group, layout, window, cu_seqlens, backend, timeout, agree):
    from ringlse.ring.loop import ring_plan  # the ring imports nothing of this module at its top

    return ring_plan(q, k, v, causal=causal, softmax_scale=softmax_scale, group=_group(group), layout=layout,
                     return_lse=True, window_size=tuple(window), cu_seqlens=cu_seqlens, backend=backend,
                     timeout=timeout, agree=agree)


@torch.library.custom_op("ringlse::ring", mutates_args=())
def ring(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: Optional[float], group: str, layout: str,
         window: list[int], cu_seqlens: Optional[Tensor], backend: str, timeout: Optional[float]
         ) -> tuple[Tensor, Tensor]:
    """`(out, lse)` of `ring_attention` over the process group named `group`."""
    plan = _ring_plan(q, k, v, causal, softmax_scale, group, layout, window, cu_seqlens, backend, timeout, True)
    out, lse = plan.forward(q, k, v)
    return out.to(q.dtype).contiguous(), lse.contiguous()


@ring.register_fake
def _(q, k, v, causal, softmax_scale, group, layout, window, cu_seqlens, backend, timeout):
    return _fake_out_lse(q)


@torch.library.custom_op("ringlse::ring_backward", mutates_args=())
def ring_backward(g_out: Optional[Tensor], g_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                  lse: Tensor, causal: bool, softmax_scale: Optional[float], group: str, layout: str,
                  window: list[int], cu_seqlens: Optional[Tensor], backend: str, timeout: Optional[float]
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """`(dq, dk, dv)` of `ringlse::ring` (the ranks' backward passes meet in the ring, as in eager)."""
    plan = _ring_plan(q, k, v, causal, softmax_scale, group, layout, window, cu_seqlens, backend, timeout, False)
    return _run_backward(plan, g_out, g_lse, q, k, v, out, lse)


@ring_backward.register_fake
def _(g_out, g_lse, q, k, v, out, lse, *options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_autograd(ring, ring_backward)


def ring_op(q, k, v, *, causal, softmax_scale, group, layout, window_size, cu_seqlens, backend, timeout
            ) -> tuple[Tensor, Tensor]:
    """`ringlse::ring` with `ring_attention`'s keyword arguments (`timeout` in seconds or None)."""
    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
    return ring(q, k, v, causal, softmax_scale, group_name(group) if not isinstance(group, str) else group,
                layout, list(window_size), _boundaries(cu_seqlens), backend, seconds)
