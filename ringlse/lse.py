"""The LSE toolkit: softmax, log_softmax, logsumexp and the log-semiring bmm, safe for `-inf`.

On CUDA tensors of float32/float16/bfloat16 these run the Triton kernels of `ringlse.kernels.softmax`
and `ringlse.kernels.log_bmm` (imported on first use, so importing this module needs neither Triton nor
a GPU). Everything else (CPU, float64) runs the PyTorch fallbacks below. Semantics (of both paths, but
for the kernels' known gap below):

- arithmetic is float32 for float32/float16/bfloat16 inputs (float64 for float64), outputs are in the
  input dtype, except `log_bmm`, whose output is float32 (float64 if either input is float64);
- NaN and `+inf` follow torch: a row holding a NaN gives NaN everywhere (softmax, log_softmax) and a NaN
  logsumexp; a row holding `+inf` (and no NaN) gives NaN everywhere for softmax and log_softmax and
  `+inf` for logsumexp; a `log_bmm` entry is what `torch.logsumexp(a[:, :, :, None] + b[:, None], 2)`
  gives (NaN where a term is NaN or `+inf + -inf`, else `+inf` where a term is `+inf`). Gradients
  through such rows are NaN or match torch's where torch's are finite;
- the checks come first, before any work: `dim` out of range raises `IndexError` naming the function;
  an unsupported dtype raises `TypeError` naming the function and the dtype.

Known gap: the Triton kernels (CUDA) do not yet follow torch on rows holding NaN or `+inf` (softmax
gives 0 beside the NaN entries, log_softmax gives `x`, logsumexp and `log_bmm` NaN for `+inf`; the
cooperative softmax kernels give 0 for rows of NaN only): `tests/test_lse_semantics.py` lists each case
as a strict xfail. Rows of finite and `-inf` entries follow the semantics above on both paths.

Differences from torch (deliberate):

- an all `-inf` row is empty, not NaN: softmax 0, log_softmax `-inf`, logsumexp `-inf` (as torch), with
  no NaN forward or backward (`torch.softmax` / `torch.log_softmax` give NaN there); its softmax and
  logsumexp gradients are 0, its log_softmax gradient is `g` (`dx = g - exp(y) * sum(g)`, `exp(y) = 0`);
- softmax / log_softmax of integer or bool tensors raise `TypeError` (torch raises `NotImplementedError`);
  logsumexp of them computes in, and returns, the default float dtype, as `torch.logsumexp` does;
- only float16, bfloat16, float32 and float64 are taken (complex and float8 raise `TypeError`;
  `torch.logsumexp` takes complex);
- `log_bmm` (no torch counterpart) takes floating inputs only (else `TypeError`); mixed floating dtypes
  are allowed (unlike `torch.bmm`) and computed as described above, each gradient in its input's dtype.
"""

from __future__ import annotations

import operator

import torch

from ringlse.kernel_import import kernel_module

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# log_bmm fallback: at most this many elements in one [B, N, k-chunk, P] intermediate
_LOG_BMM_CHUNK_ELEMS = 1 << 24


def _kernels(name: str, *tensors: torch.Tensor):
    """`ringlse.kernels.<name>` when it serves these tensors (CUDA, a kernel dtype), else None."""
    if all(t.is_cuda and t.dtype in _KERNEL_DTYPES for t in tensors):
        return kernel_module(name)
    return None


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


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


# ----------------------------------------------------------------------------------------------------
# PyTorch fallbacks (plain differentiable ops, bounded memory)
# ----------------------------------------------------------------------------------------------------


def _row_max(xc: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(m, shift, empty)`: the row max `m` (detached; NaN for a row holding a NaN: amax propagates it),
    the shift (a constant shift changes nothing mathematically): `m`, but 0 for all -inf rows so that
    `x - shift` stays -inf there instead of `-inf - -inf` = NaN, and `empty` = the all -inf rows.

    Emptiness is read from the max, not from the sum of exps: a NaN row (sum NaN) or a `+inf` row
    (`+inf - +inf` = NaN in the sum) is not empty, and must not be taken for one."""
    m = xc.detach().amax(dim=dim, keepdim=True)
    empty = torch.isneginf(m)
    return m, torch.where(empty, torch.zeros_like(m), m), empty


def _torch_softmax(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    if x.dim() == 0:
        return _torch_softmax(x.reshape(1), 0, log).reshape(())
    if x.shape[dim] == 0:
        return torch.empty_like(x)
    xc = x.to(_compute_dtype(x.dtype))
    _, shift, empty = _row_max(xc, dim)
    shifted = xc - shift
    e = torch.exp(shifted)
    s = e.sum(dim=dim, keepdim=True)
    # s >= 1 unless the row is all -inf (s = 0: replaced before dividing, with no gradient through it) or
    # holds NaN or +inf (s = NaN, kept: every output of the row is NaN, as torch's)
    s_safe = torch.where(empty, torch.ones_like(s), s)
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
    m, shift, empty = _row_max(xc, dim)
    s = torch.exp(xc - shift).sum(dim=dim, keepdim=True)
    # all -inf rows give -inf and +inf rows +inf (torch's answer; shift + log(s) would be NaN there), each
    # chosen by `where` with s replaced by 1, so that no gradient flows through log(0) or log(NaN): a +inf
    # row's gradient is then torch's, 0 at its finite entries (NaN at its +inf ones, from exp(+inf - +inf));
    # a NaN row keeps s = NaN and gives NaN, as torch
    posinf = torch.isposinf(m)
    special = empty | posinf
    lse = torch.where(special, m, shift + torch.log(torch.where(special, torch.ones_like(s), s)))
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
    # m is NaN where a term is NaN (or +inf + -inf): maximum and amax propagate NaN, and so does the sum
    shift = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    s = torch.zeros((B, N, P), dtype=a.dtype, device=a.device)
    for k0 in range(0, M, kc):
        s += torch.exp(a[:, :, k0 : k0 + kc, None] + b[:, None, k0 : k0 + kc, :] - shift[:, :, None, :]).sum(dim=2)
    # log(0) = -inf where every term is -inf; +inf where a term is +inf (and none NaN), where the sum
    # holds exp(+inf - +inf) = NaN, as torch.logsumexp of the terms gives
    return torch.where(torch.isposinf(m), m, shift + torch.log(s))


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

    NaN and +inf as torch: a row holding either gives NaN everywhere.

    Args:
        x: any shape; float32/float16/bfloat16 (float32 arithmetic) or float64. Other dtypes raise
            TypeError (torch.softmax does not take integer or bool tensors either).
        dim: the reduced dim (any: other dims are handled through strides, without a copy); out of
            range raises IndexError.

    Returns:
        shape and dtype of `x`.
    """
    _check_float("softmax", x)
    dim = _check_dim("softmax", x, dim)
    kernels = _kernels("softmax", x)
    if kernels is not None:
        return kernels.softmax(x, dim)
    return _torch_softmax(x, dim, log=False)


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
    _check_float("log_softmax", x)
    dim = _check_dim("log_softmax", x, dim)
    kernels = _kernels("softmax", x)
    if kernels is not None:
        return kernels.log_softmax(x, dim)
    return _torch_softmax(x, dim, log=True)


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
    return _torch_logsumexp(x, dim, keepdim)


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
    return _TorchLogBmm.apply(a, b)
