"""Exact attention in float64 with plain PyTorch: the yardstick every other path is checked against.

Used by tests and `ringlse.testing` only, never by production code; and it shares no code with what
it checks (its softmax, mask and GQA indexing are its own), so a bug there cannot hide itself.
"""

from __future__ import annotations

import torch


def masked_softmax_and_lse(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim and its natural-log normaliser, safe for rows that are all `-inf`.

    Such rows give probabilities 0 and lse `-inf`, and finite (zero) gradients: the max and the
    denominator are replaced by safe constants *before* anything is differentiated, so no
    `exp(-inf - -inf)` or `log(0)` ever enters the autograd graph.

    Args:
        scores: `[..., n]`, masked entries already `-inf`.

    Returns:
        `(p, lse)`: `p` like `scores`, `lse` of shape `[...]`.
    """
    if scores.shape[-1] == 0:
        # an empty key block (a ring step or key partition with no keys): every row is empty, and
        # `amax` refuses to reduce a zero-size dim. Stay in the graph so autograd sees (zero) grads.
        return scores * 0.0, scores.sum(dim=-1) + float("-inf")
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    empty = torch.isneginf(row_max)
    row_max = torch.where(empty, torch.zeros_like(row_max), row_max)
    e = torch.exp(scores - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    denom_safe = torch.where(empty, torch.ones_like(denom), denom)
    p = e / denom_safe
    lse = torch.where(empty, torch.full_like(denom, float("-inf")), row_max + torch.log(denom_safe))
    return p, lse.squeeze(-1)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    q_start: int | None = None,
    k_start: int = 0,
    window_size: tuple[int, int] = (-1, -1),
    cu_seqlens: list[int] | torch.Tensor | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention computed in float64, differentiable, returning `(out, lse)`.

    Args:
        q: `[batch, seqlen_q, nheads, headdim]`.
        k, v: `[batch, seqlen_k, nheads_kv, headdim]`, `nheads % nheads_kv == 0` (GQA/MQA; K/V are
            indexed per group, never repeated).
        causal: key `j` is visible to query `i` iff `k_start + j <= q_start + i`.
        softmax_scale: defaults to `headdim ** -0.5`.
        q_start: global position of query 0; `None` aligns the ends of q and k (bottom-right, as
            flash-attn >= 2.1): `q_start = k_start + seqlen_k - seqlen_q`.
        k_start: global position of key 0.
        window_size: `(left, right)`: the query at `p` sees keys in `[p - left, p + right]`, -1
            unbounded (CONVENTIONS.md §10).
        cu_seqlens: document boundaries over global positions; a query sees keys of its document only.
        softcap: 0 (off) or `s > 0`: scores capped to `s * tanh(score / s)` before the softmax.
        v may have a head dim of its own (out then has it).
        sinks: `[nheads]` logits of a key that every query sees and that carries no value (GPT-OSS's
            attention sinks); the lse includes it.

    Returns:
        `out` `[batch, seqlen_q, nheads, headdim]` in `q.dtype`, and `lse` `[batch, nheads, seqlen_q]`
        (float32; float64 for float64 inputs), natural log. Rows with no visible key give `out = 0`,
        `lse = -inf`.
    """
    out, lse = attention_math(q, k, v, causal=causal, softmax_scale=softmax_scale, q_start=q_start,
                              k_start=k_start, window_size=window_size, cu_seqlens=cu_seqlens, sinks=sinks, softcap=softcap,
                              dtype=torch.float64)
    return out.to(q.dtype), lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def attention_math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    q_start: int | None = None,
    k_start: int = 0,
    window_size: tuple[int, int] = (-1, -1),
    cu_seqlens: list[int] | torch.Tensor | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention of `reference_attention` with every operation in `dtype` (float64: the reference;
    the input dtype: the naive baseline of `ringlse.testing`). Returns `(out, lse)` in `dtype`.

    Its many parameters are the call's options, one keyword each, as the public entry points take them.
    """
    # one check for every malformed input (3-D tensors, nheads_kv = 0 included), so callers always get
    # this ValueError rather than an unpacking error or a ZeroDivisionError
    if (
        q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or v.shape[:3] != k.shape[:3]
        or (k.shape[0], k.shape[3]) != (q.shape[0], q.shape[3]) or k.shape[2] == 0 or q.shape[2] % k.shape[2]
    ):
        raise ValueError(f"reference_attention: incompatible shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}")
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    if q_start is None:
        q_start = k_start + sk - sq
    g = h // hkv
    qg = q.to(dtype).reshape(b, sq, hkv, g, d)
    scores = torch.einsum("bikgd,bjkd->bkgij", qg, k.to(dtype)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    # the visibility rule of CONVENTIONS.md §10, written out pair by pair (its own code, not ringlse.masks)
    p = q_start + torch.arange(sq, device=q.device)[:, None]
    t = k_start + torch.arange(sk, device=q.device)[None, :]
    hidden = torch.zeros(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        hidden |= t > p
    left, right = window_size
    if left >= 0:
        hidden |= t < p - left
    if right >= 0:
        hidden |= t > p + right
    if cu_seqlens is not None:
        bounds = torch.as_tensor(cu_seqlens, dtype=torch.int64, device=q.device)
        hidden |= torch.bucketize(t, bounds, right=True) != torch.bucketize(p, bounds, right=True)
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:  # one more key per head, seen by every query, whose value is 0
        column = sinks.to(dtype).reshape(1, hkv, g, 1, 1).expand(b, hkv, g, sq, 1)
        p, lse = masked_softmax_and_lse(torch.cat([scores, column], dim=-1))
        p = p[..., :sk]
    else:
        p, lse = masked_softmax_and_lse(scores)
    out = torch.einsum("bkgij,bjkd->bikgd", p, v.to(dtype)).reshape(b, sq, h, v.shape[3])
    return out, lse.reshape(b, h, sq)
