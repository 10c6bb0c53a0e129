"""The LSE toolkit's public functions: argument checks first, then the Triton kernels where they serve
(CUDA, float32/float16/bfloat16; imported on first use) or else the PyTorch paths; semantics: the
package's docstring."""

from __future__ import annotations

import operator

import torch

from ringlse.kernel_import import kernel_module
from ringlse.lse.torch_paths import TorchLogBmm, torch_logsumexp, torch_softmax

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _kernels(name: str, *tensors: torch.Tensor):
    """`ringlse.lse.kernels.<name>` when it serves these tensors (CUDA, a kernel dtype), else None."""
    if all(t.is_cuda and t.dtype in _KERNEL_DTYPES for t in tensors):
        return kernel_module(name, package="ringlse.lse.kernels")
    return None


# ----------------------------------------------------------------------------------------------------
# Argument checks (before any work)
# ----------------------------------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_float(what: str, x: torch.Tensor, name: str = "x") -> None:
    if x.dtype not in _FLOAT_DTYPES:
        hint = f"; convert first, e.g. {name}.float()" if not (x.is_complex() or x.is_floating_point()) else ""
        raise TypeError(f"{what}: {name} must be float16, bfloat16, float32 or float64, got {x.dtype}{hint}")


def _check_dim(what: str, x: torch.Tensor, dim: int) -> int:
    """`dim` as a Python int in torch's range for `x` (`[-1, 0]` for a 0-D tensor), or IndexError naming
    `what` (TypeError if it is no integer)."""
    try:
        dim = operator.index(dim)
    except TypeError:
        raise TypeError(f"{what}: dim must be an int, got {dim!r}") from None
    n = max(x.dim(), 1)
    if not -n <= dim < n:
        raise IndexError(
            f"{what}: dim {dim} out of range for a {x.dim()}-D tensor (expected to be in range of [{-n}, {n - 1}])"
        )
    return dim


def _softmax(what: str, x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    """softmax or log_softmax (`log`) after the checks, on the kernels where they serve."""
    _check_float(what, x)
    dim = _check_dim(what, x, dim)
    kernels = _kernels("softmax", x)
    if kernels is not None:
        return kernels.log_softmax(x, dim) if log else kernels.softmax(x, dim)
    return torch_softmax(x, dim, log=log)


# ----------------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------------


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax over `dim`, differentiable; an all -inf row gives zeros (and zero gradient).

    NaN and +inf as torch: a row holding either gives NaN everywhere.

    Args:
        x: any shape; float32/float16/bfloat16 (float32 arithmetic) or float64. Other dtypes raise
            TypeError (torch.softmax does not take integer or bool tensors either).
        dim: the reduced dim (any: other dims are handled through strides, without a copy); out of
            range raises IndexError.

    Returns:
        shape and dtype of `x`.
    """
    return _softmax("softmax", x, dim, log=False)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log_softmax over `dim`, differentiable; an all -inf row stays -inf (never NaN).

    NaN and +inf as torch: a row holding either gives NaN everywhere.

    Args:
        x: any shape; float32/float16/bfloat16 (float32 arithmetic) or float64. Other dtypes raise
            TypeError.
        dim: the reduced dim; out of range raises IndexError.

    Returns:
        shape and dtype of `x`.
    """
    return _softmax("log_softmax", x, dim, log=True)


def logsumexp(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """`log(sum(exp(x)))` over `dim`, differentiable; -inf (with zero gradient) for an all -inf row.

    NaN and +inf as torch: NaN for a row holding a NaN, else +inf for a row holding +inf.

    Args:
        x: any shape; float32/float16/bfloat16 (float32 arithmetic) or float64; integer and bool
            tensors are converted to the default float dtype first, as `torch.logsumexp` does. Other
            dtypes (complex, float8) raise TypeError.
        dim: the reduced dim; out of range raises IndexError.
        keepdim: keep `dim` with size 1.

    Returns:
        dtype of `x` (the default float dtype for integer and bool `x`), shape of `x` without `dim`
        (or with size 1 there).
    """
    dim = _check_dim("logsumexp", x, dim)
    if not (x.is_floating_point() or x.is_complex()):  # integer or bool: as torch.logsumexp
        x = x.to(torch.get_default_dtype())
    _check_float("logsumexp", x)
    kernels = _kernels("softmax", x)
    if kernels is not None:
        return kernels.logsumexp(x, dim, keepdim)
    return torch_logsumexp(x, dim, keepdim)


def log_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Log-semiring batched matmul, differentiable: `out[b,i,j] = logsumexp_k(a[b,i,k] + b[b,k,j])`.

    Never forms `[B, N, M, P]`: the Triton kernel keeps output tiles in registers; the PyTorch fallback
    walks k in chunks of bounded size. -inf entries are allowed; an `(i, j)` whose terms are all -inf
    gives -inf and passes zero gradients. NaN and +inf as `torch.logsumexp` over the terms `a + b`:
    NaN where a term is NaN (a NaN entry, or `+inf + -inf`), else +inf where a term is +inf.

    Args:
        a: `[B, N, M]`, b: `[B, M, P]`; float32 (bf16/fp16 accepted, computed in float32) or float64.
            Integer, bool, complex or float8 inputs raise TypeError. Mixed floating dtypes are allowed
            (computed in float64 if either is float64, else float32); each gradient is in its input's
            dtype.

    Returns:
        `[B, N, P]`, float32 (float64 if either input is float64).
    """
    _check_float("log_bmm", a, "a")
    _check_float("log_bmm", b, "b")
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"log_bmm: need a [B, N, M] and b [B, M, P], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"log_bmm: a is on {a.device}, b on {b.device}")
    kernels = _kernels("log_bmm", a, b)
    if kernels is not None:
        return kernels.log_bmm(a, b)
    return TorchLogBmm.apply(a, b)
