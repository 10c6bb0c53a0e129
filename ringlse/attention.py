"""Single-device attention over any block op: `block_attention` (one block at global positions),
`attention` (bottom-right causal), `chunked_attention` (keys in chunks merged by lse, bounded memory)
and `varlen_attention` (flash-attn's packed layout). Each builds an `AttentionSpec` and takes the one
autograd path of `ringlse.ops` to a plan of block calls (`ringlse.attention_plan`); masks follow
CONVENTIONS.md §4 and §10 (`ringlse.masks`)."""

from __future__ import annotations

from collections.abc import Sequence
import torch

from ringlse import ops
from ringlse.blocks.contract import BlockOp
from ringlse.checks import check_flag, check_tensors
from ringlse.sinks import check_sinks
from ringlse.specs import AttentionSpec


def _attend(q, k, v, spec: AttentionSpec, sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out, lse)` of one call. Non-tensors and tensors on several devices are refused before the op,
    whose dispatcher would answer them first (and malformed sinks, which it never sees); every other
    check runs inside it."""
    check_tensors(q, k, v, spec.what)
    problem = check_sinks(sinks, q, spec.what)
    if problem is not None:
        raise ValueError(problem)
    return ops.attend(q, k, v, spec, sinks)


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
    softcap: float = 0.0,
    backend: str | BlockOp = "auto",
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block of queries to one block of keys at global positions, with its lse.

    Args:
        q, k: `[batch, seqlen, nheads(_kv), headdim]`; v: `[batch, seqlen_k, nheads_kv, headdim_v]`
            (`headdim_v` may differ from q/k's: `torch` and `triton` backends; out has `headdim_v`).
        causal: key at global position `t` visible to the query at `p` only if `t <= p`, with
            `p = q_start + i`, `t = k_start + j` (CONVENTIONS.md §4).
        softmax_scale: defaults to `headdim ** -0.5`.
        q_start, k_start: global positions of the first query and key.
        window_size: `(left, right)`: the query at `p` sees keys in `[p - left, p + right]`; -1 is
            unbounded (CONVENTIONS.md §10).
        cu_seqlens: document boundaries `[0, e1, ..., S]` over global positions, `S` at or past the
            end of the later of the two blocks (the whole packed sequence's boundaries may be passed
            as they are); a query sees keys of its own document only. The same for every batch row.
        softcap: 0 (off) or `s > 0`: scores become `s * tanh(scale * q.k / s)` before the softmax, and
            the lse is taken over the capped scores (Gemma 2's logit softcapping; `torch` and `triton`
            backends, `auto` picks one of them).
        backend: `auto` (`triton` on CUDA where it computes the dtype, else `sdpa`, else `torch`),
            `triton`, `sdpa`, `flash`, `torch`, or a `BlockOp`. Windows need `torch` (or a backend
            that takes intervals); documents work everywhere (cut into per-document calls where the
            backend takes no intervals).
        sinks: learnable attention sinks `[nheads]` (GPT-OSS's `s_aux`), one logit per query head
            added to every row's softmax denominator (`ringlse.sinks`); differentiable. Blocks that
            are merged later must carry them once: pass them to one block, or merge a sink state.

    Returns:
        `(out, lse)`: `out` like `q`; `lse` `[batch, nheads, seqlen_q]` float32 (float64 for float64),
        `-inf` with `out = 0` on rows that see no key (with sinks the lse includes the sink, and such
        rows get `lse = sink`). Both are differentiable, so blocks merged with `merge_attn_states`
        backpropagate exactly.

    Raises:
        ValueError / TypeError: malformed inputs or options, or a backend that cannot run the call.
    """
    spec = AttentionSpec.make("block_attention", causal=causal, softmax_scale=softmax_scale, q_start=q_start,
                              k_start=k_start, window_size=window_size, cu_seqlens=cu_seqlens, backend=backend,
                              softcap=softcap)
    return _attend(q, k, v, spec, sinks)


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
    softcap: float = 0.0,
    backend: str | BlockOp = "auto",
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Single-device softmax attention; causal masks and windows align bottom-right when
    `seqlen_q != seqlen_k` (query `i` at position `seqlen_k - seqlen_q + i`, key `j` at `j`).

    Args:
        q: `[batch, seqlen_q, nheads, headdim]`; k: `[batch, seqlen_k, nheads_kv, headdim]`; v:
            `[batch, seqlen_k, nheads_kv, headdim_v]` (as in `block_attention`).
        causal, softmax_scale, window_size, softcap, backend, sinks: as in `block_attention`.
        cu_seqlens: document boundaries over key positions `[0, ..., seqlen_k]` (a last boundary
            past `seqlen_k` is allowed).
        return_lse: also return lse `[batch, nheads, seqlen_q]`.

    Returns:
        `out` like `q`, or `(out, lse)`.

    Its keywords are the call's options, one per feature, as in flash-attn's interface.
    """
    check_flag(return_lse, "return_lse", "attention")
    spec = AttentionSpec.make("attention", causal=causal, softmax_scale=softmax_scale, q_start=None, k_start=0,
                              window_size=window_size, cu_seqlens=cu_seqlens, backend=backend, softcap=softcap)
    out, lse = _attend(q, k, v, spec, sinks)
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
    softcap: float = 0.0,
    backend: str | BlockOp = "auto",
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over K/V chunks of `chunk_size` keys, merged exactly by lse: memory for scores
    stays `O(seqlen_q * chunk_size)` however long the keys, forward and backward.

    Args:
        q: `[batch, seqlen_q, nheads, headdim]`; k: `[batch, seqlen_k, nheads_kv, headdim]`; v:
            `[batch, seqlen_k, nheads_kv, headdim_v]` (as in `block_attention`).
        causal, window_size, cu_seqlens: as in `ringlse.attention` (bottom-right); chunks the mask
            empties are skipped.
        softmax_scale: defaults to `headdim ** -0.5`.
        chunk_size: keys per chunk (>= 1).
        return_lse: also return lse `[batch, nheads, seqlen_q]`.
        softcap, backend, sinks: as in `ringlse.block_attention`.

    Returns:
        `out` like `q` (or `(out, lse)`), differentiable in q, k, v.

    Its keywords are the call's options, one per feature, as in flash-attn's interface.
    """
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunked_attention: chunk_size must be a positive int, got {chunk_size!r}")
    check_flag(return_lse, "return_lse", "chunked_attention")
    spec = AttentionSpec.make("chunked_attention", causal=causal, softmax_scale=softmax_scale, q_start=None,
                              k_start=0, window_size=window_size, cu_seqlens=cu_seqlens, backend=backend,
                              chunk_size=chunk_size, softcap=softcap)
    out, lse = _attend(q, k, v, spec, sinks)
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
    softcap: float = 0.0,
    backend: str | BlockOp = "auto",
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """flash-attn's varlen attention (`flash_attn_varlen_func`'s layout and semantics), on any backend.

    Document `i` of q (rows `[cu_seqlens_q[i], cu_seqlens_q[i+1])`) attends document `i` of k only;
    causal masks and windows align bottom-right within each pair (query `r` of a document of `lq`
    queries sits at position `lk - lq + r` of its `lk` keys).

    Args:
        q: `[total_q, nheads, headdim]`; k, v: `[total_k, nheads_kv, headdim]`.
        cu_seqlens_q, cu_seqlens_k: document boundaries, as many documents in both.
        causal, window_size, softmax_scale, softcap, backend, sinks: as in `ringlse.block_attention`.
        return_lse: also return lse `[nheads, total_q]` (float32; float64 for float64 inputs).

    Returns:
        `out` `[total_q, nheads, headdim]` like `q`, or `(out, lse)`; differentiable.

    Its keywords are the call's options, one per feature, as in flash-attn's interface.
    """
    what = "varlen_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{what}: {name} must be [total, nheads, headdim], got {getattr(t, 'shape', t)}")
    check_flag(return_lse, "return_lse", what)
    for name, bounds in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if bounds is None:
            raise ValueError(f"{what}: {name} must be document boundaries, got None")
    spec = AttentionSpec.make(what, causal=causal, softmax_scale=softmax_scale, q_start=0, k_start=0,
                              window_size=window_size, cu_seqlens=cu_seqlens_k, cu_seqlens_q=cu_seqlens_q,
                              backend=backend, softcap=softcap)
    out, lse = _attend(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), spec, sinks)
    return (out[0], lse[0]) if return_lse else out[0]
