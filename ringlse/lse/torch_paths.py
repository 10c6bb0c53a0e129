"""The LSE toolkit's PyTorch paths (CPU, float64, and wherever the kernels do not serve): plain
differentiable ops whose memory stays bounded (`log_bmm` walks k in chunks), with the semantics of
`ringlse.lse`'s docstring."""

from __future__ import annotations

import torch

# log_bmm fallback: at most this many elements in one [B, N, k-chunk, P] intermediate
_LOG_BMM_CHUNK_ELEMS = 1 << 24


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32



def _row_max(xc: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(m, shift, empty)`: the row max `m` (detached; NaN for a row holding a NaN: amax propagates it),
    the shift (a constant shift changes nothing mathematically): `m`, but 0 for all -inf rows so that
    `x - shift` stays -inf there instead of `-inf - -inf` = NaN, and `empty` = the all -inf rows.

    Emptiness is read from the max, not from the sum of exps: a NaN row (sum NaN) or a `+inf` row
    (`+inf - +inf` = NaN in the sum) is not empty, and must not be taken for one."""
    m = xc.detach().amax(dim=dim, keepdim=True)
    empty = torch.isneginf(m)
    return m, torch.where(empty, torch.zeros_like(m), m), empty


def torch_softmax(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    if x.dim() == 0:
        return torch_softmax(x.reshape(1), 0, log).reshape(())
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


def torch_logsumexp(x: torch.Tensor, dim: int, keepdim: bool) -> torch.Tensor:
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


class TorchLogBmm(torch.autograd.Function):
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
