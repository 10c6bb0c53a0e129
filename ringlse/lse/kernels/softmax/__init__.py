"""Softmax, log_softmax and logsumexp over one dim, in Triton, with backward kernels.

All arithmetic is float32 whatever the input dtype (fp32/bf16/fp16); outputs are in the input dtype,
each rounded once from float32. An all `-inf` row gives softmax 0, log_softmax `-inf`, logsumexp
`-inf`, and no NaN anywhere, forward or backward.

Layout of the package: `row_kernels.py` (rows held whole in registers), `split_kernels.py` (long rows
in two passes), `coop_kernels.py` (long rows as cooperative pieces in registers, with `coop_pieces.py`
and `coop_launch.py`), `vectors.py` (rows off 16-byte boundaries in whole vectors); `plan.py` decides
the path once per layout of a call's tensors; `config.py` holds the measured constants.
"""

from __future__ import annotations

import torch

from .config import CONFIG, SoftmaxConfig, active_config, config_override
from .layout import layout
from .plan import CALL_PLANS, backward_plan, forward_plan, logsumexp_backward_plan, logsumexp_plan

__all__ = [
    "CONFIG", "SoftmaxConfig", "active_config", "config_override", "log_softmax", "logsumexp",
    "logsumexp_backward", "logsumexp_forward", "softmax", "softmax_backward", "softmax_forward",
]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(x: torch.Tensor, what: str) -> None:
    if x.dtype not in _DTYPES:
        raise TypeError(f"{what}: the Triton kernels take float32/float16/bfloat16, got {x.dtype}")


# ----------------------------------------------------------------------------------------------------
# Launchers (no autograd): a call plan per layout of the tensors and the active config (`plan.py`)
# ----------------------------------------------------------------------------------------------------


def softmax_forward(
    x: torch.Tensor, dim: int = -1, *, log: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax (or log_softmax) of `x` over `dim`, no autograd.

    Args:
        x: any shape, float32/float16/bfloat16, on a CUDA device (or CPU under TRITON_INTERPRET=1).
        dim: the reduced dim.
        log: log_softmax instead of softmax.
        out: optional output, shape and dtype of `x` (tests pass a NaN-poisoned one).

    Returns:
        `y`, shape and dtype of `x`; all -inf rows give 0 (softmax) or -inf (log_softmax).
    """
    _check(x, "softmax")
    if x.dim() == 0:
        return softmax_forward(x.reshape(1), 0, log=log, out=None if out is None else out.reshape(1)).reshape(())
    dim = dim % x.dim()
    cfg = active_config()
    key = ("softmax", layout(x), layout(out), dim, log, cfg)
    return CALL_PLANS.run(key, forward_plan, cfg, x, out, dim, log)


def logsumexp_forward(x: torch.Tensor, dim: int = -1, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """log(sum(exp(x))) over `dim` in float32, no autograd.

    Args:
        x: any shape (at least 1-D), float32/float16/bfloat16.
        dim: the reduced dim.
        out: optional float32 output of `x.shape` without `dim`.

    Returns:
        float32 lse, shape of `x` without `dim`; `-inf` for all -inf (or empty) rows.
    """
    _check(x, "logsumexp")
    if x.dim() == 0:
        x = x.reshape(1)
    dim = dim % x.dim()
    cfg = active_config()
    key = ("logsumexp", layout(x), layout(out), dim, cfg)
    return CALL_PLANS.run(key, logsumexp_plan, cfg, x, out, dim)


def softmax_backward(
    y: torch.Tensor, g: torch.Tensor, dim: int = -1, *, log: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Gradient of softmax (log_softmax) from its output `y` and the output gradient `g`.

    softmax: `dx = y * (g - sum(g * y))`; log_softmax: `dx = g - exp(y) * sum(g)` (sums over `dim`).

    Args:
        y: the forward output, any shape, float32/float16/bfloat16.
        g: gradient of `y`, same shape (any strides, e.g. expanded).
        dim: the reduced dim.
        log: `y` is a log_softmax.
        out: optional output, shape and dtype of `y`.

    Returns:
        `dx`, shape and dtype of `y`.
    """
    _check(y, "softmax_backward")
    if y.dim() == 0:  # a one-element row: softmax is the constant 1 (log_softmax 0), its gradient 0
        return torch.zeros_like(y)
    dim = dim % y.dim()
    cfg = active_config()
    key = ("softmax_backward", layout(y), layout(g), layout(out), dim, log, cfg)
    return CALL_PLANS.run(key, backward_plan, cfg, y, g, out, dim, log)


def logsumexp_backward(
    x: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, dim: int = -1, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Gradient of logsumexp: `dx = g * exp(x - lse)`, 0 on rows whose lse is -inf.

    Args:
        x: the forward input, any shape, float32/float16/bfloat16.
        lse: float32 logsumexp of `x` over `dim`, shape of `x` without `dim`.
        g: gradient of the output, shape of `lse` (any dtype, any strides).
        dim: the reduced dim.
        out: optional output, shape and dtype of `x`.

    Returns:
        `dx`, shape and dtype of `x`.
    """
    _check(x, "logsumexp_backward")
    if x.dim() == 0:
        return logsumexp_backward(x.reshape(1), lse.reshape(()), g.reshape(()), 0).reshape(())
    dim = dim % x.dim()
    cfg = active_config()
    key = ("logsumexp_backward", layout(x), layout(out), dim, cfg)
    return CALL_PLANS.run(key, logsumexp_backward_plan, cfg, x, lse, g, out, dim)


# ----------------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------------


class _SoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
        y = softmax_forward(x, dim, log=log)
        ctx.save_for_backward(y)
        ctx.dim, ctx.log = dim, log
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (y,) = ctx.saved_tensors
        return softmax_backward(y, g, ctx.dim, log=ctx.log), None, None


class _LogsumexpFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, keepdim: bool) -> torch.Tensor:
        lse = logsumexp_forward(x, dim)
        ctx.save_for_backward(x, lse)
        ctx.dim = dim
        out = lse if x.dtype == torch.float32 else lse.to(x.dtype)
        return out.unsqueeze(dim) if keepdim and x.dim() > 0 else out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, lse = ctx.saved_tensors
        return logsumexp_backward(x, lse, g, ctx.dim), None, None


# ----------------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------------


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax over `dim` with autograd (Triton forward and backward).

    Args:
        x: any shape, float32/float16/bfloat16 (float32 arithmetic).
        dim: the reduced dim.

    Returns:
        shape and dtype of `x`; an all -inf row gives zeros.
    """
    return _SoftmaxFn.apply(x, dim, False)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log_softmax over `dim` with autograd; an all -inf row stays -inf. Shapes as `softmax`."""
    return _SoftmaxFn.apply(x, dim, True)


def logsumexp(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """log(sum(exp(x))) over `dim` with autograd.

    Args:
        x: any shape, float32/float16/bfloat16.
        dim: the reduced dim.
        keepdim: keep `dim` with size 1.

    Returns:
        dtype of `x` (computed in float32), shape of `x` without `dim` (or with size 1); -inf for an
        all -inf row, whose gradient is 0.
    """
    return _LogsumexpFn.apply(x, dim, keepdim)
