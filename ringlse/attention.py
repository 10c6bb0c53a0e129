"""Single-device attention over any block op: `block_attention` (one block at global positions),
`attention` (bottom-right causal), `chunked_attention` (keys in chunks merged by lse, bounded memory).
All three are one plan of block calls under the autograd skeleton of `ringlse.blocks.contract`."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ringlse.blocks import get_block_op
from ringlse.blocks.contract import BlockOp, planned_attention
from ringlse.checks import check_flag, check_qkv, check_scale, lse_dtype
from ringlse.masks import BlockKind, block_kind


class _KeyChunk(NamedTuple):
    k0: int
    k1: int
    causal: bool  # a causal boundary crosses the chunk (chunks nothing sees are left out)


class _ChunkPlan:
    """Attend all queries to key chunks `[k0, k1)`: one call returns its state as it is, several merge
    into float32 accumulators (the op merges in place)."""

    def __init__(self, op: BlockOp, scale: float, q_start: int, k_start: int, chunks: list[_KeyChunk]):
        self.op, self.scale, self.q_start, self.k_start, self.chunks = op, scale, q_start, k_start, chunks

    def _block(self, c: _KeyChunk) -> dict:
        return dict(softmax_scale=self.scale, causal=c.causal, q_start=self.q_start, k_start=self.k_start + c.k0)

    def forward(self, q, k, v):
        b, sq, h, _ = q.shape
        acc = lse_dtype(q.dtype)
        if len(self.chunks) == 1 and (self.chunks[0].k0, self.chunks[0].k1) == (0, k.shape[1]):
            return self.op.forward(q, k, v, **self._block(self.chunks[0]))
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full((b, h, sq), float("-inf"), dtype=acc, device=q.device)
        for c in self.chunks:
            self.op.forward(q, k[:, c.k0:c.k1], v[:, c.k0:c.k1], **self._block(c), out_acc=out, lse_acc=lse)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, delta, lse_grad):
        acc = lse_dtype(q.dtype)
        dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
        for c in self.chunks:
            keys = slice(c.k0, c.k1)
            self.op.backward(dout, q, k[:, keys], v[:, keys], out, lse, delta, **self._block(c),
                             dq_acc=dq, dk_acc=dk[:, keys], dv_acc=dv[:, keys], lse_grad=lse_grad)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _attend(q, k, v, *, causal, softmax_scale, q_start, k_start, chunk_size, backend, what):
    """`(out, lse)` over key chunks of `chunk_size` (None: one chunk), after every check; `q_start=None`
    aligns the ends of q and k (bottom-right)."""
    check_qkv(q, k, v, what)
    check_flag(causal, "causal", what)
    if q_start is None:
        q_start = k_start + k.shape[1] - q.shape[1]
    for name, value in (("q_start", q_start), ("k_start", k_start)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{what}: {name} must be an int, got {type(value).__name__}")
    scale = check_scale(softmax_scale, q.shape[-1], what)
    op = get_block_op(backend, q.device, q.dtype)
    sq, sk = q.shape[1], k.shape[1]
    step = sk if chunk_size is None else chunk_size
    chunks = []
    for k0 in range(0, sk, max(step, 1)):
        k1 = min(sk, k0 + step)
        kind = block_kind(sq, k1 - k0, q_start, k_start + k0, causal)
        if kind is not BlockKind.EMPTY:
            chunks.append(_KeyChunk(k0, k1, kind is BlockKind.PARTIAL))
    return planned_attention(q, k, v, _ChunkPlan(op, scale, q_start, k_start, chunks))


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
        causal: key `j` visible to query `i` iff `k_start + j <= q_start + i` (CONVENTIONS.md §4).
        softmax_scale: defaults to `headdim ** -0.5`.
        q_start, k_start: global positions of the first query and key.
        backend: `auto` (`triton` on CUDA where it computes the dtype, else `sdpa`, else `torch`),
            `triton`, `sdpa`, `flash`, `torch`, or a `BlockOp`.

    Returns:
        `(out, lse)`: `out` like `q`; `lse` `[batch, nheads, seqlen_q]` float32 (float64 for float64),
        `-inf` with `out = 0` on rows that see no key. Both are differentiable, so blocks merged with
        `merge_attn_states` backpropagate exactly.

    Raises:
        ValueError / TypeError: malformed inputs or options, or a backend that cannot run the call.
    """
    return _attend(q, k, v, causal=causal, softmax_scale=softmax_scale, q_start=q_start, k_start=k_start,
                   chunk_size=None, backend=backend, what="block_attention")


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
    out, lse = _attend(q, k, v, causal=causal, softmax_scale=softmax_scale, q_start=None, k_start=0,
                       chunk_size=None, backend=backend, what="attention")
    return (out, lse) if check_flag(return_lse, "return_lse", "attention") else out


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
    """Softmax attention over K/V chunks of `chunk_size` keys, merged exactly by lse: memory for scores
    stays `O(seqlen_q * chunk_size)` however long the keys, forward and backward.

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
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunked_attention: chunk_size must be a positive int, got {chunk_size!r}")
    out, lse = _attend(q, k, v, causal=causal, softmax_scale=softmax_scale, q_start=None, k_start=0,
                       chunk_size=chunk_size, backend=backend, what="chunked_attention")
    return (out, lse) if check_flag(return_lse, "return_lse", "chunked_attention") else out
