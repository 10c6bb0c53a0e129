"""The public merge of attention states (CONVENTIONS.md §3) in the inference engines' conventions:
`merge_attn_states` and `update_out_and_lse` (re-exported by `ringlse.merge` and `ringlse`).

A state is `out` `[..., T, H, D]` with its lse in one of two layouts (`lse_layout`):
- `"heads_first"`: lse `[..., H, T]` (ringlse's own, vLLM's `merge_attn_states`);
- `"tokens_first"`: lse `[..., T, H]` (FlashInfer's `merge_state`/`merge_states`, SGLang, FA4's
  `flash_attn_combine`);
and in one of two bases (`lse_base`): `None`/`math.e` (natural log) or `2.0` (FlashInfer). Every lse
given and returned is in the call's layout and base. States come as sequences of N tensors, or as one
tensor each with the N states stacked along `dim` (FlashInfer's `merge_states`: `v [T, N, H, D]`,
`s [T, N, H]`, `dim=1`; FA4's combine: `[N, ..., T, H, D]`, `[N, ..., T, H]`, `dim=0`).

How each option is served. Layouts and stacking are views: a tokens-first lse is its transpose, a
stacked input is `select(dim, i)` per state, so neither copies. On the PyTorch path (CPU, float64,
autograd) a base-2 lse is multiplied by ln 2 on the way in and divided on the way out (both recorded by
autograd); the fused kernel (`ringlse.kernels.merge`, CUDA, no autograd) computes in base 2 directly
(`exp2`/`log2`: the same weights, no conversion pass). The formula itself is `ringlse.merge.merge_weights`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ringlse.checks import lse_dtype
from ringlse.kernel_import import kernel_module
from ringlse.merge_formula import merge_weights

LN2 = math.log(2.0)
LSE_LAYOUTS = ("heads_first", "tokens_first")


# ---------------------------------------------------------------------------------------------------
# options and checks


def _check_options(what: str, lse_layout: object, lse_base: object) -> bool:
    """Validate `lse_layout` and `lse_base`; whether the lse is in base 2."""
    if not isinstance(lse_layout, str) or lse_layout not in LSE_LAYOUTS:
        raise ValueError(f"{what}: lse_layout must be 'heads_first' or 'tokens_first', got {lse_layout!r}")
    if lse_base is None:
        return False
    if isinstance(lse_base, bool) or not isinstance(lse_base, (int, float)):
        raise ValueError(f"{what}: lse_base must be None, math.e or 2.0, got {lse_base!r}")
    if lse_base == math.e:
        return False
    if lse_base == 2:
        return True
    raise ValueError(f"{what}: lse_base must be None, math.e or 2.0, got {lse_base!r}")


def _lse_shape(out_shape: Sequence[int], lse_layout: str) -> tuple[int, ...]:
    *lead, s, h, _ = out_shape
    return (*lead, h, s) if lse_layout == "heads_first" else (*lead, s, h)


def _heads_first(lse: torch.Tensor, lse_layout: str) -> torch.Tensor:
    """The lse as a `[..., H, T]` view (a transpose for tokens-first; no copy)."""
    return lse if lse_layout == "heads_first" else lse.transpose(-1, -2)


def _check_state(out: torch.Tensor, lse: torch.Tensor, what: str, lse_layout: str = "heads_first") -> None:
    for name, t in (("out", out), ("lse", lse)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if out.dim() < 3:
        raise ValueError(f"{what}: out must be [..., seqlen, nheads, headdim], got shape {tuple(out.shape)}")
    want = _lse_shape(out.shape, lse_layout)
    if tuple(lse.shape) != want:
        dims = "[..., nheads, seqlen]" if lse_layout == "heads_first" else "[..., seqlen, nheads]"
        raise ValueError(
            f"{what}: lse must have shape {want} ({dims}, lse_layout={lse_layout!r}) for out of shape "
            f"{tuple(out.shape)}, got {tuple(lse.shape)}"
        )


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes `[first, one past the last)` that `t` can touch (addresses: tensors of different
    allocations never overlap; an empty tensor touches none)."""
    if t.numel() == 0:
        return 0, 0
    start = t.data_ptr()
    return start, start + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _stacked_dim(what: str, outs, lses, dim, lse_layout: str) -> int | None:
    """The (non-negative) dim `outs` and `lses` are stacked along, or None for sequences of states
    (checked: as many lses as outs, >= 1)."""
    stacked_o, stacked_l = isinstance(outs, torch.Tensor), isinstance(lses, torch.Tensor)
    if stacked_o != stacked_l:
        raise ValueError(f"{what}: outs and lses must both be tensors (stacked along dim) or both sequences")
    if not stacked_o:
        if dim is not None:
            raise ValueError(f"{what}: dim={dim!r} is for stacked tensors; outs and lses are sequences")
        if len(outs) == 0 or len(outs) != len(lses):
            raise ValueError(f"{what}: need as many lses as outs (>= 1), got {len(outs)} and {len(lses)}")
        return None
    if dim is None or isinstance(dim, bool) or not isinstance(dim, int):
        raise ValueError(f"{what}: stacked outs and lses need dim (the int dim the states are stacked along), got {dim!r}")
    nd = outs.dim()
    if nd < 4:
        raise ValueError(f"{what}: stacked outs must have >= 4 dims ([..., T, H, D] plus the states' dim), got shape {tuple(outs.shape)}")
    if lses.dim() != nd - 1:
        raise ValueError(
            f"{what}: stacked lses must have one dim fewer than outs ({nd - 1}), got shapes {tuple(outs.shape)} and {tuple(lses.shape)}"
        )
    if not -nd <= dim < nd:
        raise ValueError(f"{what}: dim={dim} is out of range for outs of {nd} dims")
    d = dim % nd
    # the states' dim counts from the front of outs; lses stack along the same (non-negative) dim
    limit = nd - 3 if lse_layout == "heads_first" else nd - 1
    if d >= limit:
        where = "a leading dim (before T, H, D)" if lse_layout == "heads_first" else "any dim but the head dim D"
        raise ValueError(f"{what}: dim={dim} of outs {tuple(outs.shape)}: with lse_layout={lse_layout!r} it must be {where}")
    if outs.shape[d] != lses.shape[d] or outs.shape[d] == 0:
        raise ValueError(
            f"{what}: outs {tuple(outs.shape)} and lses {tuple(lses.shape)} must hold the same number (>= 1) of states along dim={dim}"
        )
    return d


def _check_destinations(what, out, out_lse, shape, lse_shape, device, acc, inputs) -> None:
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"{what}: out must be a torch.Tensor, got {type(out).__name__}")
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"{what}: out has shape {tuple(out.shape)}, the merged state is {tuple(shape)}")
        if not out.dtype.is_floating_point:
            raise ValueError(f"{what}: out must have a floating dtype, got {out.dtype}")
        if out.device != device:
            raise ValueError(f"{what}: out is on {out.device}, the inputs on {device}")
    if out_lse is not None:
        if not isinstance(out_lse, torch.Tensor):
            raise ValueError(f"{what}: out_lse must be a torch.Tensor, got {type(out_lse).__name__}")
        if tuple(out_lse.shape) != tuple(lse_shape):
            raise ValueError(f"{what}: out_lse has shape {tuple(out_lse.shape)}, the merged lse is {tuple(lse_shape)}")
        if out_lse.dtype != acc:
            raise ValueError(f"{what}: out_lse must be {acc} (the merged lse's dtype), got {out_lse.dtype}")
        if out_lse.device != device:
            raise ValueError(f"{what}: out_lse is on {out_lse.device}, the inputs on {device}")
    if out is not None and out_lse is not None and _overlaps(_span(out), _span(out_lse)):
        raise ValueError(f"{what}: out and out_lse overlap in memory")
    spans = [_span(t) for t in inputs]
    for name, dst in (("out", out), ("out_lse", out_lse)):
        if dst is not None and any(_overlaps(_span(dst), x) for x in spans):
            raise ValueError(f"{what}: {name} shares memory with an input (outs/lses are never written)")


# ---------------------------------------------------------------------------------------------------
# the two paths


def _kernel_device(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the fused kernel may serve tensors on these devices (CUDA; tests under Triton's
    interpreter widen this to CPU)."""
    return all(t.is_cuda for t in tensors)


def _kernel_for(tensors: Sequence[torch.Tensor], outs, lses, out, lse):
    """The fused merge module when it can serve this call (CUDA, autograd not recording, dtypes and
    layouts it handles), else None. `lses` and `lse` are heads-first views."""
    if not _kernel_device(tensors):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None  # autograd must record: the PyTorch path below carries the custom backward
    module = kernel_module("merge")
    if module is None or module.check_kernel_inputs(outs, lses, out, lse) is not None:
        return None
    return module


def _lse_to_out_layout(x: torch.Tensor) -> torch.Tensor:
    """`[..., h, s]` -> `[..., s, h, 1]`, to broadcast against an `out`."""
    return x.transpose(-1, -2).unsqueeze(-1)


def _to_natural(lse: torch.Tensor, base2: bool) -> torch.Tensor:
    return lse * LN2 if base2 else lse


def _from_natural(lse: torch.Tensor, base2: bool) -> torch.Tensor:
    return lse / LN2 if base2 else lse


class _MergeStates(torch.autograd.Function):
    """The merge of N states `(outs, lses)` (lses heads-first, natural log) with its own backward."""

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


def _merge_torch(outs, lses_hf, base2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch merge (differentiable): float32/float64 `out`, heads-first lse in the call's base."""
    out, lse = _MergeStates.apply(len(outs), *outs, *[_to_natural(x, base2) for x in lses_hf])
    return out, _from_natural(lse, base2)


# ---------------------------------------------------------------------------------------------------
# public API


def merge_attn_states(
    outs: Sequence[torch.Tensor] | torch.Tensor,
    lses: Sequence[torch.Tensor] | torch.Tensor,
    *,
    lse_layout: str = "heads_first",
    lse_base: float | None = None,
    dim: int | None = None,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N attention states at once (split-KV decoding, prefix caching, cascade attention).

    Args:
        outs: N tensors `[..., T, H, D]` (same shape, any float dtypes), each the attention output over
            one disjoint part of the keys; or one tensor holding the N states stacked along `dim`.
        lses: their log-sum-exps, N tensors (or one stacked along `dim`), `[..., H, T]` for
            `lse_layout="heads_first"` (vLLM) or `[..., T, H]` for `"tokens_first"` (FlashInfer, FA4);
            `-inf` marks a row that saw no key in that part.
        lse_layout: `"heads_first"` or `"tokens_first"`, for every lse given and returned.
        lse_base: `None` or `math.e` (natural log) or `2.0` (FlashInfer), for every lse given and returned.
        dim: with stacked `outs`/`lses`, the dim of `outs` the states are stacked along (negative values
            count from the end of `outs`); `lses` are stacked along the same non-negative dim. Must be a
            leading dim (before T, H, D) for heads-first lses, any dim but D for tokens-first ones.
            FlashInfer's `merge_states`: `v [T, N, H, D]`, `s [T, N, H]`, `dim=1`; FA4's combine:
            `[N, ..., T, H, D]`, `[N, ..., T, H]`, `dim=0`.
        out: optional destination `[..., T, H, D]` of any float dtype (a view into a larger buffer is
            fine); it must not share memory with an input.
        out_lse: optional destination of the merged lse (the inputs' layout, float32, or float64 for
            float64 `outs`).

    Returns:
        `(out, lse)`: `out` in the dtype of the first state's out (or `out`'s own), `lse` float32
        (float64 for float64 inputs) in the inputs' layout and base; `out`/`out_lse` themselves when
        given. Rows that are `-inf` in every state give `(0, -inf)`. Differentiable in every input,
        except with `out=`/`out_lse=`, which are for inference and raise `ValueError` while autograd
        records. On CUDA without autograd the fused kernel runs: one read of each input, one write of
        each output, and no allocation beyond the outputs (none with `out` and `out_lse` given; a
        sequence of more than 16 separately allocated states is merged in several launches through one
        float32 intermediate state: stack them to get one pass).
    """
    what = "merge_attn_states"
    base2 = _check_options(what, lse_layout, lse_base)
    d = _stacked_dim(what, outs, lses, dim, lse_layout)
    if d is None:  # a sequence of states: each checked
        outs, lses = list(outs), list(lses)
        for i, (o, l) in enumerate(zip(outs, lses)):
            _check_state(o, l, f"{what} (state {i})", lse_layout)
            if o.shape != outs[0].shape:
                raise ValueError(f"{what}: state {i} has shape {tuple(o.shape)}, state 0 {tuple(outs[0].shape)}")
            if o.device != outs[0].device or l.device != outs[0].device:
                raise ValueError(f"{what}: state {i} is on {o.device}/{l.device}, state 0 on {outs[0].device}")
        out0, lse0, inputs = outs[0], lses[0], [*outs, *lses]
    else:  # stacked: state 0 checked stands for all (a decode step's host time matters)
        out0, lse0, inputs = outs.select(d, 0), lses.select(d, 0), [outs, lses]
        _check_state(out0, lse0, f"{what} (stacked along dim={dim})", lse_layout)
        if lses.device != outs.device:
            raise ValueError(f"{what}: lses are on {lses.device}, outs on {outs.device}")
    shape = tuple(out0.shape)
    acc = lse_dtype(out0.dtype)
    if out is not None or out_lse is not None:
        _check_destinations(what, out, out_lse, shape, _lse_shape(shape, lse_layout), out0.device, acc, inputs)
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    if recording and (out is not None or out_lse is not None):
        raise ValueError(
            f"{what}: out=/out_lse= are for inference and do not record autograd; call it under "
            "torch.no_grad() or leave out=/out_lse= unset"
        )
    out_dtype = out0.dtype if out is None else out.dtype
    kernel = kernel_module("merge") if _kernel_device(inputs) and acc == torch.float32 and not recording else None
    if kernel is not None:
        dst = out if out is not None else torch.empty(shape, dtype=out_dtype, device=out0.device)
        dst_lse = out_lse if out_lse is not None else torch.empty(_lse_shape(shape, lse_layout), dtype=acc, device=dst.device)
        dst_lse_hf = _heads_first(dst_lse, lse_layout)
        if d is not None:
            lse0_hf = _heads_first(lse0, lse_layout)
            if kernel.check_kernel_inputs([out0], [lse0_hf], dst, dst_lse_hf) is None:
                kernel.merge_stacked(out0, lse0_hf, outs.shape[d], outs.stride(d), lses.stride(d), dst, dst_lse_hf,
                                     base2=base2, check=False)
                return dst, dst_lse
        else:
            lses_hf = [_heads_first(x, lse_layout) for x in lses]
            if kernel.check_kernel_inputs(outs, lses_hf, dst, dst_lse_hf) is None:
                kernel.merge_states(outs, lses_hf, dst, dst_lse_hf, base2=base2, check=False)
                return dst, dst_lse
    if d is not None:
        outs, lses = list(outs.unbind(d)), list(lses.unbind(d))
    lses_hf = [_heads_first(x, lse_layout) for x in lses]
    res_out, res_lse_hf = _merge_torch(outs, lses_hf, base2)
    res_lse = _heads_first(res_lse_hf, lse_layout)  # the transpose is its own inverse
    if out is not None or out_lse is not None:
        with torch.no_grad():
            if out is not None:
                out.copy_(res_out)
            if out_lse is not None:
                out_lse.copy_(res_lse)
        return (out if out is not None else res_out.to(out_dtype)), (out_lse if out_lse is not None else res_lse)
    return res_out.to(out_dtype), res_lse


def update_out_and_lse(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
    *,
    inplace: bool = False,
    lse_layout: str = "heads_first",
    lse_base: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge one block's attention state into a running state.

    CUDA tensors go through the fused Triton kernel (`ringlse.kernels.merge`: one read of each input,
    one write of each output) whenever autograd does not need to record the merge; otherwise, and on
    other devices, the PyTorch math runs (differentiable).

    Args:
        out: running state `[..., seqlen, nheads, headdim]` (float32/float64), or `None` to start one
            from the block.
        lse: its lse (`[..., nheads, seqlen]` heads-first, `[..., seqlen, nheads]` tokens-first), or
            `None` with `out`.
        block_out: `[..., seqlen, nheads, headdim]`, any float dtype.
        block_lse: the block's lse, in the same layout and base.
        inplace: write the merged state into `out` and `lse` (which may be strided views into larger
            buffers) and return them; needs a float32/float64 `out` and `lse`. With `out=None` a new
            state is returned as usual. Works on every device; while autograd records, the update is
            recorded as an in-place copy (a leaf that requires grad cannot be updated in place).
        lse_layout: `"heads_first"` or `"tokens_first"`, for every lse given and returned.
        lse_base: `None`/`math.e` (natural log) or `2.0`, for every lse given and returned.

    Returns:
        `(out, lse)`: the merged state, float32 (float64 for float64 inputs), lse in the call's layout
        and base: new tensors (differentiable; the inputs are not modified), or the updated `out`,
        `lse` with `inplace=True`.
    """
    what = "update_out_and_lse"
    base2 = _check_options(what, lse_layout, lse_base)
    _check_state(block_out, block_lse, f"{what} (block)", lse_layout)
    acc = lse_dtype(block_out.dtype)
    if out is None:
        if lse is not None:
            raise ValueError(f"{what}: out is None but lse is not")
        # always a copy: `.to` would return the block itself when it is already float32/float64, and a
        # later `inplace=True` update of the state would then overwrite the caller's block
        return block_out.to(acc, copy=True), block_lse.to(acc, copy=True)
    if lse is None:
        raise ValueError(f"{what}: lse is None but out is not")
    _check_state(out, lse, f"{what} (state)", lse_layout)
    if out.shape != block_out.shape:
        raise ValueError(f"{what}: state {tuple(out.shape)} and block {tuple(block_out.shape)} differ")
    tensors = (out, lse, block_out, block_lse)
    lse_hf, block_lse_hf = _heads_first(lse, lse_layout), _heads_first(block_lse, lse_layout)
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if inplace:
        if out.dtype not in (torch.float32, torch.float64) or lse.dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"{what}(inplace=True): the state must be float32/float64, got out {out.dtype}, lse {lse.dtype}"
            )
        kernel = _kernel_for(tensors, [out, block_out], [lse_hf, block_lse_hf], out, lse_hf)
        if kernel is not None:
            kernel.update_state_(out, lse_hf, block_out, block_lse_hf, base2=base2)
            return out, lse
        if recording:
            # merge from copies: the custom backward needs the old state, which copy_ overwrites
            new_out, new_lse = _merge_torch([out.clone(), block_out], [lse_hf.clone(), block_lse_hf], base2)
        else:
            new_out, new_lse = _merge2_math(out, lse_hf, block_out, block_lse_hf, base2)
        out.copy_(new_out)
        lse_hf.copy_(new_lse)
        return out, lse
    if _kernel_device(tensors) and out.dtype == torch.float32 and lse.dtype == torch.float32 and not recording:
        dst = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        dst_lse = torch.empty(lse.shape, dtype=torch.float32, device=lse.device)
        dst_lse_hf = _heads_first(dst_lse, lse_layout)
        kernel = _kernel_for(tensors, [out, block_out], [lse_hf, block_lse_hf], dst, dst_lse_hf)
        if kernel is not None:
            kernel.merge_states([out, block_out], [lse_hf, block_lse_hf], dst, dst_lse_hf, base2=base2)
            return dst, dst_lse
    new_out, new_lse = _merge_torch([out, block_out], [lse_hf, block_lse_hf], base2)
    return new_out, _heads_first(new_lse, lse_layout)


def _merge2_math(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor, base2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two-state merge without autograd bookkeeping, in the wider of the state dtypes (heads-first
    lses in the call's base)."""
    acc = torch.promote_types(torch.promote_types(out.dtype, lse.dtype), torch.float32)
    w, merged = merge_weights(torch.stack([_to_natural(lse.to(acc), base2), _to_natural(block_lse.to(acc), base2)]))
    merged = _from_natural(merged, base2)
    return _lse_to_out_layout(w[0]) * out.to(acc) + _lse_to_out_layout(w[1]) * block_out.to(acc), merged
