"""Single-device attention with K/V processed in chunks merged by lse: memory for scores stays
`O(seqlen_q * chunk_size)` however long the keys, forward and backward."""

from __future__ import annotations

import torch

from ringlse.backends import get_block_op
from ringlse.blockop import BlockOp
from ringlse.positions import BlockKind, block_kind
from ringlse.reference import lse_dtype
from ringlse.validation import check_qkv


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, op: BlockOp, scale: float, chunks):
        ctx.set_materialize_grads(False)  # an unused lse gets None, not a zero gradient
        b, sq, h, d = q.shape
        acc = lse_dtype(q.dtype)
        out = torch.zeros((b, sq, h, d), dtype=acc, device=q.device)
        lse = torch.full((b, h, sq), float("-inf"), dtype=acc, device=q.device)
        for k0, k1, causal, q_start in chunks:
            op.forward(q, k[:, k0:k1], v[:, k0:k1], softmax_scale=scale, causal=causal, q_start=q_start,
                       k_start=k0, out_acc=out, lse_acc=lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (op, scale, chunks)
        return out, lse

    @staticmethod
    def backward(ctx, g_out, g_lse):
        q, k, v, out, lse = ctx.saved_tensors
        op, scale, chunks = ctx.args
        acc = lse_dtype(q.dtype)
        g_out, delta, lse_grad = op.backward_inputs(g_out, g_lse, out)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        for k0, k1, causal, q_start in chunks:
            op.backward(g_out, q, k[:, k0:k1], v[:, k0:k1], out, lse, delta, softmax_scale=scale, causal=causal,
                        q_start=q_start, k_start=k0, dq_acc=dq, dk_acc=dk[:, k0:k1], dv_acc=dv[:, k0:k1],
                        lse_grad=lse_grad)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    chunk_size: int,
    return_lse: bool = False,
    backend: str | BlockOp = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over K/V chunks of `chunk_size` keys, merged exactly by lse.

    Args:
        q: `[batch, seqlen_q, nheads, headdim]`; k, v: `[batch, seqlen_k, nheads_kv, headdim]`.
        causal: causal mask aligned bottom-right (as `ringlse.attention`); chunks it empties are skipped.
        softmax_scale: defaults to `headdim ** -0.5`.
        chunk_size: keys per chunk (>= 1).
        return_lse: also return lse `[batch, nheads, seqlen_q]`.
        backend: block op, as in `ringlse.block_attention`.

    Returns:
        `out` like `q` (or `(out, lse)`), differentiable in q, k, v.
    """
    check_qkv(q, k, v, "chunked_attention")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunked_attention: chunk_size must be a positive int, got {chunk_size!r}")
    sq, sk = q.shape[1], k.shape[1]
    q_start = sk - sq
    chunks = []
    for k0 in range(0, sk, chunk_size):
        k1 = min(sk, k0 + chunk_size)
        kind = block_kind(sq, k1 - k0, q_start, k0, causal)
        if kind is not BlockKind.EMPTY:
            chunks.append((k0, k1, kind is BlockKind.PARTIAL, q_start))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    out, lse = _ChunkedAttention.apply(q, k, v, get_block_op(backend, q.device), scale, chunks)
    return (out, lse) if return_lse else out
