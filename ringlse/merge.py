"""Numerically stable merge of attention states `(out, lse)` (DESIGN §3), with autograd.

A state is `out` `[..., seqlen, nheads, headdim]` with its `lse` `[..., nheads, seqlen]`.
States merge to `lse = logsumexp_i lse_i`, `out = sum_i exp(lse_i - lse) * out_i`. We subtract the
largest lse before any `exp`, so lse values of +-1e4 neither overflow nor underflow, and replace that
max by 0 where every state is `-inf`: such rows come out `(0, -inf)` and every weight there is 0, which
also keeps the gradients finite (the custom backward below never evaluates `exp(-inf - -inf)`).
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Sequence

import torch

from ringlse.reference import lse_dtype


def _merge_kernel_module():
    """`ringlse.kernels.merge`, imported on first use (so `import ringlse` needs no Triton), or None."""
    global _KERNEL_MODULE
    if _KERNEL_MODULE is None:
        try:
            from ringlse.kernels import merge as module
        except ImportError as err:  # no triton: the PyTorch path serves
            module = False
            try:
                has_triton = importlib.util.find_spec("triton") is not None
            except (ImportError, ValueError):
                has_triton = False
            if has_triton:
                # triton is there but the kernels are not: ringlse is imported from a source tree
                # without `pip install -e .` (kernels/ installs as ringlse.kernels); say so once
                warnings.warn(f"ringlse.kernels is not importable ({err}); merges use the PyTorch path", RuntimeWarning)
        _KERNEL_MODULE = module
    return _KERNEL_MODULE or None


_KERNEL_MODULE = None


def _kernel_for(tensors: Sequence[torch.Tensor], outs, lses, out, lse):
    """The fused merge module when it can serve this call (CUDA, autograd not recording, dtypes and
    layouts it handles), else None."""
    if not all(t.is_cuda for t in tensors):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None  # autograd must record: the PyTorch path below carries the custom backward
    module = _merge_kernel_module()
    if module is None or module.check_kernel_inputs(outs, lses, out, lse) is not None:
        return None
    return module


def _check_state(out: torch.Tensor, lse: torch.Tensor, what: str) -> None:
    if out.dim() < 3:
        raise ValueError(f"{what}: out must be [..., seqlen, nheads, headdim], got shape {tuple(out.shape)}")
    *lead, s, h, _ = out.shape
    if tuple(lse.shape) != (*lead, h, s):
        raise ValueError(
            f"{what}: lse must have shape {(*lead, h, s)} ([..., nheads, seqlen]) for out of shape "
            f"{tuple(out.shape)}, got {tuple(lse.shape)}"
        )


def merge_weights(lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised merge weights and merged lse of stacked lses.

    Args:
        lses: `[n, ...]` (any trailing shape), float32 or float64.

    Returns:
        `(w, lse)`: `w` `[n, ...]` with `w_i = exp(lse_i - lse)` (0 where everything is `-inf`) and
        `lse` `[...]` = `logsumexp` over the first dim.
    """
    top = lses.amax(dim=0)
    empty = torch.isneginf(top)
    top = torch.where(empty, torch.zeros_like(top), top)
    e = torch.exp(lses - top)
    total = e.sum(dim=0)
    lse = top + torch.log(total)  # log(0) = -inf exactly where every state is -inf
    w = e / torch.where(empty, torch.ones_like(total), total)
    return w, lse


def _lse_to_out_layout(x: torch.Tensor) -> torch.Tensor:
    """`[..., h, s]` -> `[..., s, h, 1]`, to broadcast against an `out`."""
    return x.transpose(-1, -2).unsqueeze(-1)


class _MergeStates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, n: int, *tensors: torch.Tensor):
        outs, lses = tensors[:n], tensors[n:]
        acc = lse_dtype(outs[0].dtype)
        w, lse = merge_weights(torch.stack([x.to(acc) for x in lses]))
        out = sum(_lse_to_out_layout(w[i]) * outs[i].to(acc) for i in range(n))
        ctx.n = n
        ctx.save_for_backward(w, out, *outs)
        return out, lse

    @staticmethod
    def backward(ctx, g_out: torch.Tensor | None, g_lse: torch.Tensor | None):
        w, out, *outs = ctx.saved_tensors
        n = ctx.n
        g_outs, g_lses = [], []
        for i in range(n):
            wi = w[i]
            g_o = torch.zeros_like(outs[i]) if g_out is None else (_lse_to_out_layout(wi) * g_out).to(outs[i].dtype)
            # d out / d lse_i = w_i (o_i - o);  d lse / d lse_i = w_i
            g_l = torch.zeros_like(wi)
            if g_out is not None:
                g_l = wi * ((g_out * (outs[i].to(out.dtype) - out)).sum(-1)).transpose(-1, -2)
            if g_lse is not None:
                g_l = g_l + wi * g_lse
            g_outs.append(g_o)
            g_lses.append(g_l)
        return (None, *g_outs, *g_lses)


def merge_attn_states(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N attention states at once (split-KV decoding, prefix caching, chunked keys).

    Args:
        outs: N tensors `[..., seqlen, nheads, headdim]` (same shape), each the attention output over
            one disjoint part of the keys.
        lses: N tensors `[..., nheads, seqlen]`, their log-sum-exps (natural log); `-inf` marks a row
            that saw no key in that part.

    Returns:
        `(out, lse)`: `out` in the dtype of `outs[0]`, `lse` float32 (float64 for float64 inputs).
        Differentiable in every input; rows that are `-inf` everywhere give `(0, -inf)`.
    """
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"merge_attn_states: need as many lses as outs (>= 1), got {len(outs)} and {len(lses)}")
    for i, (o, l) in enumerate(zip(outs, lses)):
        _check_state(o, l, f"merge_attn_states (state {i})")
        if o.shape != outs[0].shape:
            raise ValueError(f"merge_attn_states: state {i} has shape {tuple(o.shape)}, state 0 {tuple(outs[0].shape)}")
    if outs[0].is_cuda and lses[0].dtype == torch.float32 and outs[0].dtype != torch.float64:
        dst = torch.empty_like(outs[0], memory_format=torch.contiguous_format)
        dst_lse = torch.empty(lses[0].shape, dtype=torch.float32, device=lses[0].device)
        kernel = _kernel_for([*outs, *lses], outs, lses, dst, dst_lse)
        if kernel is not None:
            return kernel.merge_states(outs, lses, dst, dst_lse)
    out, lse = _MergeStates.apply(len(outs), *outs, *lses)
    return out.to(outs[0].dtype), lse


def update_out_and_lse(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
    *,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge one block's attention state into a running state.

    CUDA tensors go through the fused Triton kernel (`ringlse.kernels.merge`: one read of each input,
    one write of each output) whenever autograd does not need to record the merge; otherwise, and on
    other devices, the PyTorch math below runs (differentiable).

    Args:
        out: running state `[..., seqlen, nheads, headdim]` (float32/float64), or `None` to start one
            from the block.
        lse: its lse `[..., nheads, seqlen]`, or `None` with `out`.
        block_out: `[..., seqlen, nheads, headdim]`, any float dtype.
        block_lse: `[..., nheads, seqlen]`.
        inplace: write the merged state into `out` and `lse` (which may be strided views into larger
            buffers) and return them; needs a float32/float64 `out` and `lse`. With `out=None` a new
            state is returned as usual. Works on every device; while autograd records, the update is
            recorded as an in-place copy (a leaf that requires grad cannot be updated in place).

    Returns:
        `(out, lse)`: the merged state, float32 (float64 for float64 inputs): new tensors
        (differentiable; the inputs are not modified), or the updated `out`, `lse` with `inplace=True`.
    """
    _check_state(block_out, block_lse, "update_out_and_lse (block)")
    acc = lse_dtype(block_out.dtype)
    if out is None:
        if lse is not None:
            raise ValueError("update_out_and_lse: out is None but lse is not")
        # always a copy: `.to` would return the block itself when it is already float32/float64, and a
        # later `inplace=True` update of the state would then overwrite the caller's block
        return block_out.to(acc, copy=True), block_lse.to(acc, copy=True)
    if lse is None:
        raise ValueError("update_out_and_lse: lse is None but out is not")
    _check_state(out, lse, "update_out_and_lse (state)")
    if out.shape != block_out.shape:
        raise ValueError(f"update_out_and_lse: state {tuple(out.shape)} and block {tuple(block_out.shape)} differ")
    tensors = (out, lse, block_out, block_lse)
    if inplace:
        if out.dtype not in (torch.float32, torch.float64) or lse.dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"update_out_and_lse(inplace=True): the state must be float32/float64, got out {out.dtype}, lse {lse.dtype}"
            )
        kernel = _kernel_for(tensors, [out, block_out], [lse, block_lse], out, lse)
        if kernel is not None:
            return kernel.update_state_(out, lse, block_out, block_lse)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            # merge from copies: the custom backward needs the old state, which copy_ overwrites
            new_out, new_lse = _MergeStates.apply(2, out.clone(), block_out, lse.clone(), block_lse)
        else:
            new_out, new_lse = _merge2_math(out, lse, block_out, block_lse)
        out.copy_(new_out)
        lse.copy_(new_lse)
        return out, lse
    if out.is_cuda and out.dtype == torch.float32 and lse.dtype == torch.float32:
        dst = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        dst_lse = torch.empty(lse.shape, dtype=torch.float32, device=lse.device)
        kernel = _kernel_for(tensors, [out, block_out], [lse, block_lse], dst, dst_lse)
        if kernel is not None:
            return kernel.merge_states([out, block_out], [lse, block_lse], dst, dst_lse)
    return _MergeStates.apply(2, out, block_out, lse, block_lse)


def _merge2_math(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two-state merge without autograd bookkeeping, in the wider of the state dtypes."""
    acc = torch.promote_types(torch.promote_types(out.dtype, lse.dtype), torch.float32)
    w, merged = merge_weights(torch.stack([lse.to(acc), block_lse.to(acc)]))
    return _lse_to_out_layout(w[0]) * out.to(acc) + _lse_to_out_layout(w[1]) * block_out.to(acc), merged
