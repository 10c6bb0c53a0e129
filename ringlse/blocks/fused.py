"""The driver shared by the block ops over fused attention kernels (`sdpa`, `flash`): pieces, GQA,
merge, and the lse-gradient term.

Fused kernels (cuDNN, flash-attn, ...) know "no mask" and one aligned causal mask, take no running
state, and compute `rowsum(dout * out)` themselves. This module turns any such family (`KernelSet`)
into a full block op (CONVENTIONS.md §4, the contract of `ringlse.blocks.contract`):
- a causal block at global offsets is cut into pieces the kernels can run (`KernelSet.causal_pieces`),
  whose states are merged (§3) in one pass, or returned unmerged (`forward_parts`) for a caller that
  merges many blocks at once; rows that see no key stay `(0, -inf)`;
- GQA: K/V repeated to `nheads` for kernels without native GQA, dk/dv summed back over each group;
- backward with the global `out`/`lse` (§6); an lse gradient `e` (delta shifted by it) adds
  `dS_ij = P_ij * e_i`, which comes from the same kernels: `dq_i += scale * e_i * sum_j P_ij k_j`
  (attention with V = K) and `dk_j += scale * sum_i P_ij e_i q_i` (the dv of a backward pass whose dout
  is `e * q`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from ringlse.blocks.contract import BlockGrads, BlockOp, Capabilities, Parts
from ringlse.merge import GradPart, StatePart
from ringlse.checks import lse_dtype
from ringlse.masks import Piece, split_causal_block
from ringlse.merge import add_parts, merge_parts
from ringlse.merge_states import update_out_and_lse


def norm_lse(lse: torch.Tensor, sq: int) -> torch.Tensor:
    """Any lse an op returns -> `[b, h, sq]`, `-inf` (not `+inf`) on empty rows."""
    if lse.dim() == 4:  # cuDNN in some torch versions: [b, h, sq, 1]
        lse = lse[..., 0]
    lse = lse[..., :sq]  # efficient attention pads sq to a multiple of 32
    if lse.dtype not in (torch.float32, torch.float64):
        lse = lse.float()
    return lse.masked_fill(lse == float("inf"), float("-inf"))


@dataclass(frozen=True)
class KernelSet:
    """What the piece-and-merge driver below needs from a family of fused kernels."""

    forward: Callable  # (q, k, v, causal, scale) -> (out, lse)
    backward: Callable  # (dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)
    native_gqa: bool  # kernels take fewer K/V heads than Q heads
    # (sq, sk, q_start, k_start) -> pieces of a causal block, each causal piece aligned as the kernels
    # align it: top-left for the SDPA kernels; flash-attn's are bottom-right (top-left on a square)
    causal_pieces: Callable[[int, int, int, int], list[Piece]] = split_causal_block
    # (sq, sk, q_start, k_start, causal, window) -> pieces of a windowed block, for kernels with native
    # windows (FlashAttention-4), else None
    window_pieces: Callable[..., list[Piece]] | None = None


def block_pieces(ks: KernelSet, sq: int, sk: int, q_start: int, k_start: int, causal: bool,
                 window: tuple[int, int] | None = None) -> list[Piece]:
    if window is not None and window != (-1, -1):
        if ks.window_pieces is None:
            raise ValueError("these kernels take no windows")
        return ks.window_pieces(sq, sk, q_start, k_start, causal, window)
    if not causal:
        return [Piece(0, sq, 0, sk, False)] if sq and sk else []
    return ks.causal_pieces(sq, sk, q_start, k_start)


def _expand_kv(ks: KernelSet, x: torch.Tensor, nheads: int) -> torch.Tensor:
    b, s, hkv, d = x.shape
    if ks.native_gqa or hkv == nheads:
        return x
    return x[:, :, :, None, :].expand(b, s, hkv, nheads // hkv, d).reshape(b, s, nheads, d)


def _sum_groups(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """`[b, s, h, d]` gradient of repeated K/V -> `[b, s, hkv, d]` (sum over each group in float32/float64;
    without groups `x` itself: the in-place add into the accumulator converts as it reads)."""
    b, s, h, d = x.shape
    if h == hkv:
        return x
    return x.reshape(b, s, hkv, h // hkv, d).sum(3, dtype=lse_dtype(x.dtype))


def fused_block_states(
    ks: KernelSet,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    q_start: int,
    k_start: int,
    window_size: tuple[int, int] | None = None,
    softcap: float = 0.0,
) -> list[StatePart]:
    """The block-op `forward_parts` (see `ringlse.blocks.contract`) over a family of fused kernels: one state
    per piece of the block, as the kernels return it (`out` in q's dtype), never merged; `softcap` > 0
    only for kernels that take it (their op's `Capabilities.softcap`)."""
    h = q.shape[2]
    acc = lse_dtype(q.dtype)
    states = []
    with torch.no_grad():
        k, v = _expand_kv(ks, k, h), _expand_kv(ks, v, h)
        for p in block_pieces(ks, q.shape[1], k.shape[1], q_start, k_start, causal, window_size):
            out, lse = ks.forward(q[:, p.q0 : p.q1], k[:, p.k0 : p.k1], v[:, p.k0 : p.k1], p.causal, softmax_scale,
                                  **({"softcap": softcap} if softcap else {}))
            states.append(StatePart(p.q0, out, lse.to(acc)))
    return states


def fused_block_forward(
    ks: KernelSet,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    q_start: int,
    k_start: int,
    out_acc: torch.Tensor | None = None,
    lse_acc: torch.Tensor | None = None,
    window_size: tuple[int, int] | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block-op forward (see `ringlse.blocks.contract`) over a family of fused kernels: the pieces' states
    merged in one pass (a lone whole piece, the common case, as it is) or into the accumulators.
    Its parameters are the block-op contract's (`ringlse.blocks.contract`), one per operand and mask argument."""
    states = fused_block_states(ks, q, k, v, softmax_scale=softmax_scale, causal=causal, q_start=q_start,
                                k_start=k_start, window_size=window_size, softcap=softcap)
    if out_acc is None:
        return merge_parts((*q.shape[:-1], v.shape[-1]), states, q.dtype, q.device, lse_dtype(q.dtype))
    with torch.no_grad():
        for p in states:
            rows = slice(p.start, p.start + p.out.shape[1])
            update_out_and_lse(out_acc[:, rows], lse_acc[:, :, rows], p.out, p.lse, inplace=True)
    return out_acc, lse_acc


def fused_block_parts(
    ks: KernelSet,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor | None,
    *,
    softmax_scale: float,
    causal: bool,
    q_start: int,
    k_start: int,
    lse_grad: torch.Tensor | None = None,
    window_size: tuple[int, int] | None = None,
) -> BlockGrads:
    """The block-op `backward_parts` (see `ringlse.blocks.contract`) over a family of fused kernels: the
    kernels' own output tensors (q's dtype; float32 where GQA groups are summed or for the lse-gradient
    term), never added into anything. `delta` is not read: the kernels compute `rowsum(dout * out)`
    themselves and `lse_grad` adds the rest. Its parameters are the block-op contract's
    (`ringlse.blocks.contract`), one per operand and mask argument."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    acc = lse_dtype(q.dtype)
    grads = BlockGrads([], [], [])
    with torch.no_grad():
        pieces = block_pieces(ks, sq, sk, q_start, k_start, causal, window_size)
        if not pieces:
            return grads
        dout, out, lse, lse_k, e = backward_operands(q, dout, out, lse, lse_grad)
        k, v = _expand_kv(ks, k, h), _expand_kv(ks, v, h)
        for p in pieces:
            rows, keys = slice(p.q0, p.q1), slice(p.k0, p.k1)
            qp, kp, vp, op, dop = q[:, rows], k[:, keys], v[:, keys], out[:, rows], dout[:, rows]
            dq, dk, dv = ks.backward(dop, qp, kp, vp, op, lse_k[:, :, rows], p.causal, softmax_scale)
            grads.dq.append(GradPart(p.q0, dq))
            grads.dk.append(GradPart(p.k0, _sum_groups(dk, hkv)))
            grads.dv.append(GradPart(p.k0, _sum_groups(dv, hkv)))
            if e is None:
                continue
            # delta = rowsum(dout * out) - e adds dS_ij = P_ij e_i (module docstring)
            ep = e[:, :, rows]
            o_kk, lse_blk = ks.forward(qp, kp, kp, p.causal, softmax_scale)  # sum_j exp(s_ij - lse_blk_i) k_j
            glob = lse[:, :, rows]
            w = torch.where(torch.isfinite(glob), torch.exp(lse_blk.to(acc) - glob), torch.zeros_like(glob))
            grads.dq.append(GradPart(p.q0, (softmax_scale * ep * w).transpose(1, 2).unsqueeze(-1) * o_kk.to(acc)))
            eq = (ep.transpose(1, 2).unsqueeze(-1) * qp.to(acc)).to(q.dtype)
            _, _, dk_e = ks.backward(eq, qp, kp, vp, op, lse_k[:, :, rows], p.causal, softmax_scale)
            grads.dk.append(GradPart(p.k0, _sum_groups(dk_e, hkv), softmax_scale))
    return grads


def backward_operands(q, dout, out, lse, lse_grad):
    """`(dout, out, lse, lse_k, e)` as fused backward kernels take them: dout and out in q's dtype and
    contiguous (cuDNN < 9.5.1 requires equal strides), lse and the lse gradient `e` in the accumulation
    dtype, and `lse_k` with +inf for rows that saw nothing anywhere (kernels compute P = exp(s - lse):
    +inf makes it 0 there)."""
    acc = lse_dtype(q.dtype)
    lse = lse.to(acc)
    return (dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous(), lse,
            lse.masked_fill(lse == float("-inf"), float("inf")), None if lse_grad is None else lse_grad.to(acc))


def accumulate_parts(parts: Callable, dout, q, k, v, out, lse, delta, *, dq_acc, dk_acc, dv_acc, **block) -> None:
    """The block-op backward from a `backward_parts`: its gradients added into the accumulators (the
    contract's parameters, `ringlse.blocks.contract`)."""
    grads = parts(dout, q, k, v, out, lse, delta, **block)
    for acc, parts in zip((dq_acc, dk_acc, dv_acc), grads):
        add_parts(acc, parts)


def fused_block_op(name: str, ks: KernelSet) -> BlockOp:
    """The block op (forward, accumulating backward, `forward_parts`, `backward_parts`) of a family of
    fused kernels."""
    return parts_block_op(name, partial(fused_block_forward, ks), partial(fused_block_states, ks),
                          partial(fused_block_parts, ks))


def parts_block_op(name: str, forward: Callable, forward_parts: Callable, backward_parts: Callable,
                   caps: Capabilities = Capabilities()) -> BlockOp:
    """A block op whose kernels return new tensors (`Parts`) and compute `rowsum(dout * out)`
    themselves; its accumulating backward adds the parts."""
    return BlockOp(name, forward, partial(accumulate_parts, backward_parts), caps,
                   Parts(forward_parts, backward_parts), delta=None)


