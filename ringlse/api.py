"""Single-device attention with autograd over any registered block op."""

from __future__ import annotations

import torch

from ringlse.backends import get_block_op
from ringlse.blockop import BlockOp
from ringlse.positions import BlockKind, block_kind
from ringlse.reference import lse_dtype
from ringlse.validation import check_qkv


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, op: BlockOp, scale: float, causal: bool, q_start: int, k_start: int):
        ctx.set_materialize_grads(False)  # an unused lse gets None, not a zero gradient
        b, sq, h, d = q.shape
        kind = block_kind(sq, k.shape[1], q_start, k_start, causal)
        if kind is BlockKind.EMPTY:
            out = torch.zeros_like(q)
            lse = torch.full((b, h, sq), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
        else:
            out, lse = op.forward(
                q, k, v, softmax_scale=scale, causal=kind is BlockKind.PARTIAL, q_start=q_start, k_start=k_start
            )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (op, scale, kind, q_start, k_start)
        return out, lse

    @staticmethod
    def backward(ctx, g_out, g_lse):
        q, k, v, out, lse = ctx.saved_tensors
        op, scale, kind, q_start, k_start = ctx.args
        acc = lse_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        if kind is not BlockKind.EMPTY:
            dout, delta, lse_grad = op.backward_inputs(g_out, g_lse, out)
            op.backward(
                dout, q, k, v, out, lse, delta, softmax_scale=scale,
                causal=kind is BlockKind.PARTIAL, q_start=q_start, k_start=k_start,
                dq_acc=dq, dk_acc=dk, dv_acc=dv, lse_grad=lse_grad,
            )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    q_start: int = 0,
    k_start: int = 0,
    backend: str | BlockOp = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block of queries to one block of keys at global positions, with its lse.

    Args:
        q: `[batch, seqlen_q, nheads, headdim]`; k, v: `[batch, seqlen_k, nheads_kv, headdim]`.
        causal: key `j` visible to query `i` iff `k_start + j <= q_start + i` (DESIGN §4).
        softmax_scale: defaults to `headdim ** -0.5`.
        q_start, k_start: global positions of the first query and key.
        backend: `auto` (`triton` on CUDA, `torch` elsewhere), `triton`, `sdpa`, `flash`, `torch`, or a
            `BlockOp`.

    Returns:
        `(out, lse)`: `out` like `q`; `lse` `[batch, nheads, seqlen_q]` float32 (float64 for float64),
        `-inf` with `out = 0` on rows that see no key. Both are differentiable, so blocks merged with
        `merge_attn_states` backpropagate exactly.
    """
    check_qkv(q, k, v, "block_attention")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    op = get_block_op(backend, q.device)
    return _BlockAttention.apply(q, k, v, op, scale, causal, q_start, k_start)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: str | BlockOp = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Single-device softmax attention; causal masks align bottom-right when `seqlen_q != seqlen_k`.

    Args:
        q: `[batch, seqlen_q, nheads, headdim]`; k, v: `[batch, seqlen_k, nheads_kv, headdim]`.
        causal, softmax_scale, backend: as in `block_attention`.
        return_lse: also return lse `[batch, nheads, seqlen_q]`.

    Returns:
        `out` like `q`, or `(out, lse)`.
    """
    out, lse = block_attention(
        q, k, v, causal=causal, softmax_scale=softmax_scale,
        q_start=k.shape[1] - q.shape[1], k_start=0, backend=backend,
    )
    return (out, lse) if return_lse else out
