"""The LSE toolkit: softmax, log_softmax, logsumexp and the log-semiring bmm, safe for `-inf`.

On CUDA tensors of float32/float16/bfloat16 these run the Triton kernels of `ringlse.kernels.softmax`
and `ringlse.kernels.log_bmm` (imported on first use, so importing this module needs neither Triton nor
a GPU). Everything else (CPU, float64) runs the PyTorch fallbacks below, which have the same semantics:

- an all `-inf` row has softmax 0, log_softmax `-inf` and logsumexp `-inf`, with no NaN forward or
  backward (`torch.softmax` gives NaN there); its softmax and logsumexp gradients are 0, its
  log_softmax gradient is `g` (the formula `dx = g - exp(y) * sum(g)` with `exp(y) = 0`);
- arithmetic is float32 for float32/float16/bfloat16 inputs (float64 for float64), outputs are in the
  input dtype, except `log_bmm`, whose output is float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import importlib.util
from functools import cache

import torch

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# log_bmm fallback: at most this many elements in one [B, N, k-chunk, P] intermediate
_LOG_BMM_CHUNK_ELEMS = 1 << 24


@cache
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _use_kernels(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda and t.dtype in _KERNEL_DTYPES for t in tensors) and _have_triton()


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


# ----------------------------------------------------------------------------------------------------
# PyTorch fallbacks (plain differentiable ops, bounded memory)
# ----------------------------------------------------------------------------------------------------


def _safe_shift(xc: torch.Tensor, dim: int) -> torch.Tensor:
    """The row max, detached (a constant shift changes nothing mathematically), 0 for all -inf rows so
    that `x - shift` stays -inf there instead of `-inf - -inf` = NaN."""
    m = xc.detach().amax(dim=dim, keepdim=True)
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def _torch_softmax(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    if x.dim() == 0:
        return _torch_softmax(x.reshape(1), 0, log).reshape(())
    if x.shape[dim] == 0:
        return torch.empty_like(x)
    xc = x.to(_compute_dtype(x.dtype))
    shifted = xc - _safe_shift(xc, dim)
    e = torch.exp(shifted)
    s = e.sum(dim=dim, keepdim=True)
    # s >= 1 unless the row is all -inf (its max contributes exp(0)); replace that 0 before dividing
    s_safe = torch.where(s > 0, s, torch.ones_like(s))
    y = shifted - torch.log(s_safe) if log else e / s_safe
    return y.to(x.dtype)


def _torch_logsumexp(x: torch.Tensor, dim: int, keepdim: bool) -> torch.Tensor:
    if x.dim() == 0:
        x = x.reshape(1)
        dim, keepdim = 0, False
    if x.shape[dim] == 0:
        shape = list(x.shape)
        shape[dim] = 1
        out = torch.full(shape, float("-inf"), dtype=x.dtype, device=x.device)
        return out if keepdim else out.squeeze(dim)
    xc = x.to(_compute_dtype(x.dtype))
    shift = _safe_shift(xc, dim)
    s = torch.exp(xc - shift).sum(dim=dim, keepdim=True)
    nonempty = s > 0
    # the -inf branch is chosen by `where`, so no gradient ever flows through log(0)
    lse = torch.where(nonempty, shift + torch.log(torch.where(nonempty, s, torch.ones_like(s))), float("-inf"))
    lse = lse if keepdim else lse.squeeze(dim)
    return lse.to(x.dtype)


def _k_chunk(B: int, N: int, M: int, P: int) -> int:
    return max(1, min(M, _LOG_BMM_CHUNK_ELEMS // max(1, B * N * P)))


def _torch_log_bmm_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two passes over k-chunks, as the kernel: the exact max, then the shifted sum of exps."""
    B, N, M = a.shape
    P = b.shape[2]
    kc = _k_chunk(B, N, M, P)
    m = torch.full((B, N, P), float("-inf"), dtype=a.dtype, device=a.device)
    for k0 in range(0, M, kc):
        t = a[:, :, k0 : k0 + kc, None] + b[:, None, k0 : k0 + kc, :]
        m = torch.maximum(m, t.amax(dim=2))
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    s = torch.zeros((B, N, P), dtype=a.dtype, device=a.device)
    for k0 in range(0, M, kc):
        s += torch.exp(a[:, :, k0 : k0 + kc, None] + b[:, None, k0 : k0 + kc, :] - m[:, :, None, :]).sum(dim=2)
    return m + torch.log(s)  # log(0) = -inf where every term is -inf


def _torch_log_bmm_backward(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    B, N, M = a.shape
    P = b.shape[2]
    kc = _k_chunk(B, N, M, P)
    # out = -inf only where all its terms are -inf: +inf there makes each term exp(-inf) = 0, not NaN
    o = torch.where(torch.isneginf(out), torch.full_like(out, float("inf")), out)
    grad_a = torch.empty_like(a)
    grad_b = torch.empty_like(b)
    for k0 in range(0, M, kc):
        w = torch.exp(a[:, :, k0 : k0 + kc, None] + b[:, None, k0 : k0 + kc, :] - o[:, :, None, :]) * g[:, :, None, :]
        grad_a[:, :, k0 : k0 + kc] = w.sum(dim=3)
        grad_b[:, k0 : k0 + kc, :] = w.sum(dim=1)
    return grad_a, grad_b


class _TorchLogBmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        cdt = _compute_dtype(a.dtype, b.dtype)
        a_, b_ = a.to(cdt), b.to(cdt)
        out = _torch_log_bmm_forward(a_, b_)
        ctx.save_for_backward(a_, b_, out)
        ctx.dtypes = (a.dtype, b.dtype)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        a_, b_, out = ctx.saved_tensors
        grad_a, grad_b = _torch_log_bmm_backward(a_, b_, out, g.to(out.dtype))
        return grad_a.to(ctx.dtypes[0]), grad_b.to(ctx.dtypes[1])


# ----------------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------------


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax over `dim`, differentiable; an all -inf row gives zeros (and zero gradient).

    Args:
        x: any shape; float32/float16/bfloat16 (float32 arithmetic) or float64.
        dim: the reduced dim (any: other dims are handled through strides, without a copy).

    Returns:
        shape and dtype of `x`.
    """
    if _use_kernels(x):
        from ringlse.kernels import softmax as kernels

        return kernels.softmax(x, dim)
    return _torch_softmax(x, dim, log=False)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log_softmax over `dim`, differentiable; an all -inf row stays -inf (never NaN).

    Args:
        x: any shape; float32/float16/bfloat16 (float32 arithmetic) or float64.
        dim: the reduced dim.

    Returns:
        shape and dtype of `x`.
    """
    if _use_kernels(x):
        from ringlse.kernels import softmax as kernels

        return kernels.log_softmax(x, dim)
    return _torch_softmax(x, dim, log=True)


def logsumexp(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """`log(sum(exp(x)))` over `dim`, differentiable; -inf (with zero gradient) for an all -inf row.

    Args:
        x: any shape; float32/float16/bfloat16 (float32 arithmetic) or float64.
        dim: the reduced dim.
        keepdim: keep `dim` with size 1.

    Returns:
        dtype of `x`, shape of `x` without `dim` (or with size 1 there).
    """
    if _use_kernels(x):
        from ringlse.kernels import softmax as kernels

        return kernels.logsumexp(x, dim, keepdim)
    return _torch_logsumexp(x, dim, keepdim)


def log_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Log-semiring batched matmul, differentiable: `out[b,i,j] = logsumexp_k(a[b,i,k] + b[b,k,j])`.

    Never forms `[B, N, M, P]`: the Triton kernel keeps output tiles in registers; the PyTorch fallback
    walks k in chunks of bounded size. -inf entries are allowed; an `(i, j)` whose terms are all -inf
    gives -inf and passes zero gradients.

    Args:
        a: `[B, N, M]`, b: `[B, M, P]`; float32 (bf16/fp16 accepted, computed in float32) or float64.

    Returns:
        `[B, N, P]`, float32 (float64 for float64 inputs).
    """
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"log_bmm: need a [B, N, M] and b [B, M, P], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"log_bmm: a is on {a.device}, b on {b.device}")
    if _use_kernels(a, b):
        from ringlse.kernels import log_bmm as kernels

        return kernels.log_bmm(a, b)
    return _TorchLogBmm.apply(a, b)
