"""The PyTorch block op: float32 math (float64 for float64 inputs), any device. Serves CPU ranks and is
the fallback everywhere. GQA works by viewing the query heads as `[hkv, group]`, never by repeating K/V.
"""

from __future__ import annotations

import torch

from ringlse.blocks.contract import BlockOp, Capabilities, Masks
from ringlse.checks import lse_dtype
from ringlse.masks import Intervals, visibility_mask
from ringlse.merge import merge_weights


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, q_start: int, k_start: int,
            intervals: Intervals | None, softcap: float = 0.0) -> torch.Tensor:
    """`[b, hkv, g, sq, sk]` scaled (and, with `softcap`, capped: `softcap * tanh(s / softcap)`) scores
    in the accumulation dtype, masked entries `-inf`."""
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    acc = lse_dtype(q.dtype)
    qg = q.to(acc).reshape(b, sq, hkv, h // hkv, d)
    s = torch.einsum("bikgd,bjkd->bkgij", qg, k.to(acc)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if intervals is not None:
        s = s.masked_fill(~intervals.dense(s.device), float("-inf"))
    elif causal:
        s = s.masked_fill(~visibility_mask(sq, k.shape[1], q_start, k_start, device=q.device), float("-inf"))
    return s


def torch_block_forward(
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
    intervals: Intervals | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block-op forward in float32/float64 torch math (its parameters are the block-op contract's,
    `ringlse.blocks.contract`, one per operand and mask argument)."""
    b, sq, h, _ = q.shape
    s = _scores(q, k, softmax_scale, causal, q_start, k_start, intervals, softcap)
    p, lse = merge_weights(s, dim=-1)
    out = torch.einsum("bkgij,bjkd->bikgd", p, v.to(s.dtype)).reshape(b, sq, h, v.shape[-1])
    lse = lse.reshape(b, h, sq)
    if out_acc is None:
        return out.to(q.dtype), lse
    w, merged = merge_weights(torch.stack([lse_acc, lse]))  # the running state and the block
    wt = w.transpose(-1, -2).unsqueeze(-1)  # [2, b, sq, h, 1]
    out_acc.copy_(wt[0] * out_acc + wt[1] * out)
    lse_acc.copy_(merged)
    return out_acc, lse_acc


def torch_block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    q_start: int,
    k_start: int,
    dq_acc: torch.Tensor | None,
    dk_acc: torch.Tensor | None,
    dv_acc: torch.Tensor | None,
    lse_grad: torch.Tensor | None = None,  # already in delta (block-op contract)
    intervals: Intervals | None = None,
    softcap: float = 0.0,
) -> None:
    """The block-op backward in PyTorch math (P from the global lse, CONVENTIONS.md §6). Its parameters
    are the block-op contract's (`ringlse.blocks.contract`), one per operand and mask argument."""
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    s = _scores(q, k, softmax_scale, causal, q_start, k_start, intervals, softcap)
    acc = s.dtype
    lse_g = lse.to(acc).reshape(b, hkv, g, sq, 1)
    # P from the *global* lse; rows whose global lse is -inf saw nothing anywhere: P = 0 there
    p = torch.exp(s - torch.where(torch.isneginf(lse_g), torch.zeros_like(lse_g), lse_g))
    dout_g = dout.to(acc).reshape(b, sq, hkv, g, v.shape[-1])
    if dv_acc is not None:
        dv_acc += torch.einsum("bkgij,bikgd->bjkd", p, dout_g)
    dp = torch.einsum("bikgd,bjkd->bkgij", dout_g, v.to(acc))
    ds = p * (dp - delta.to(acc).reshape(b, hkv, g, sq, 1)) * softmax_scale
    if softcap:  # d(c tanh(x / c))/dx = 1 - tanh^2 = 1 - (s / c)^2; masked entries have p = 0
        ds = ds * (1 - torch.where(torch.isneginf(s), torch.zeros_like(s), s / softcap) ** 2)
    if dq_acc is not None:
        dq_acc += torch.einsum("bkgij,bjkd->bikgd", ds, k.to(acc)).reshape(b, sq, h, d)
    if dk_acc is not None:
        dk_acc += torch.einsum("bkgij,bikgd->bjkd", ds, q.to(acc).reshape(b, sq, hkv, g, d))


TORCH_BLOCK_OP = BlockOp("torch", torch_block_forward, torch_block_backward,
                         Capabilities(Masks.INTERVALS, split_backward=True, softcap=True, v_head_dim=True))
