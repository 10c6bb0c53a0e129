"""Inputs, float64 references and launch helpers shared by the LSE toolkit's tests (tests/test_lse_toolkit.py:
the PyTorch fallbacks and the kernels under the interpreter; tests/test_launch.py: Triton's launch
path; tests/test_lse_log_bmm_kernel.py: the log_bmm kernels; tests/test_lse_toolkit_gpu.py: CUDA)."""

from __future__ import annotations

import pytest
import torch

from ringlse import lse as lt
from ringlse.reference import masked_softmax_and_lse
from ringlse.testing import assert_judged

F64 = torch.float64
NEG_INF = float("-inf")
# every LSE test module: the interpreter evaluates both sides of guarded `where`s (e.g. -inf - -inf) in numpy
INTERPRETER_WARNINGS = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter"),
]


# ----------------------------------------------------------------------------------------------------
# inputs and float64 references


def make_x(shape, dim, dtype, *, scale=1.0, seed=0, device="cpu", inf_frac=0.1, empty_rows=True):
    """Random `shape` in `dtype` with a fraction of -inf entries and (optionally) the first and last
    rows along `dim` entirely -inf."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=F64) * scale
    if inf_frac:
        x = x.masked_fill(torch.rand(shape, generator=g, dtype=F64) < inf_frac, NEG_INF)
    if empty_rows and x.numel():
        xm = x.movedim(dim, -1).contiguous()
        rows = xm.view(-1, xm.shape[-1])
        if rows.shape[0] > 1:
            rows[0] = NEG_INF
        if rows.shape[0] > 2:
            rows[-1] = NEG_INF
        x = xm.movedim(-1, dim).contiguous()
    return x.to(device=device, dtype=dtype)


def softmax_math(x: torch.Tensor, dim: int, mode: str) -> torch.Tensor:
    """softmax / log_softmax / logsumexp with -inf-safe semantics, in x's own dtype."""
    xm = x.movedim(dim, -1)
    p, lse = masked_softmax_and_lse(xm)
    if mode == "logsumexp":
        return lse
    if mode == "softmax":
        return p.movedim(-1, dim)
    empty = torch.isneginf(lse)
    lse_safe = torch.where(empty, torch.zeros_like(lse), lse)
    y = torch.where(empty[..., None], torch.full_like(xm, NEG_INF), xm - lse_safe[..., None])
    return y.movedim(-1, dim)


def grad_from_y(y: torch.Tensor, g: torch.Tensor, dim: int, mode: str) -> torch.Tensor:
    """The backward formula of softmax or log_softmax from its output y, in y's dtype."""
    if mode == "softmax":
        return y * (g - (g * y).sum(dim, keepdim=True))
    return g - torch.exp(y) * g.sum(dim, keepdim=True)


def grad_math(x: torch.Tensor, g: torch.Tensor, dim: int, mode: str) -> torch.Tensor:
    """The backward formulas of the task, from the forward output of `softmax_math` in x's dtype."""
    y = softmax_math(x, dim, mode)
    if mode != "logsumexp":
        return grad_from_y(y, g, dim, mode)
    lse = y.unsqueeze(dim)
    e = torch.where(torch.isneginf(lse), torch.zeros_like(x), torch.exp(x - torch.where(torch.isneginf(lse), 0.0, lse)))
    return g.unsqueeze(dim) * e


def judge_against(name, ours, x, dim, mode, dtype, *, g=None):
    """Forward (g None) or backward of `mode` judged against float64, with the in-dtype baseline."""
    if g is None:
        ref = softmax_math(x.double(), dim, mode)
        base = softmax_math(x, dim, mode) if dtype in (torch.float16, torch.bfloat16) else None
    else:
        ref = grad_math(x.double(), g.double(), dim, mode)
        base = grad_math(x, g, dim, mode) if dtype in (torch.float16, torch.bfloat16) else None
    # logsumexp is float32 out of the kernel launchers (the public function casts it): judge as lse
    return assert_judged(name, ours, ref, base, dtype, is_lse=(mode == "logsumexp" and g is None))


def log_bmm_ref(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor | None = None):
    """float64 out (and grads for `g`) of the log-semiring bmm, via the expanded [B, N, P, M] tensor."""
    a, b = a.double(), b.double()
    t = a[:, :, None, :] + b.transpose(1, 2)[:, None, :, :]  # [B, N, P, M]
    _, out = masked_softmax_and_lse(t)
    if g is None:
        return out
    o = torch.where(torch.isneginf(out), float("inf"), out)
    w = torch.exp(t - o[..., None]) * g.double()[..., None]
    return out, w.sum(2), w.sum(1).transpose(1, 2)


MODES = ["softmax", "log_softmax", "logsumexp"]


def call_public(mode, x, dim):
    if mode == "logsumexp":
        return lt.logsumexp(x, dim)
    return (lt.softmax if mode == "softmax" else lt.log_softmax)(x, dim)


LOG_BMM_CASES = [
    pytest.param((1, 1, 1, 1), id="1x1x1x1"),
    pytest.param((2, 37, 53, 29), id="2x37x53x29"),
    pytest.param((1, 130, 5, 70), id="1x130x5x70"),
]


def make_ab(B, N, M, P, dtype, *, scale=2.0, seed=0, device="cpu", infs=True):
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randn(B, N, M, generator=g, dtype=F64) * scale
    b = torch.randn(B, M, P, generator=g, dtype=F64) * scale
    if infs:
        a = a.masked_fill(torch.rand(a.shape, generator=g, dtype=F64) < 0.1, NEG_INF)
        a[0, N // 2, :] = NEG_INF  # an all -inf row of out
        b[-1, :, P - 1] = NEG_INF  # an all -inf column of out
    return a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)


KERNEL_DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]


def kernel_forward(ks, mode, x, dim):
    """The launcher with a NaN-poisoned output, checking that the kernel wrote every element."""
    if mode == "logsumexp":
        shape = x.movedim(dim, -1).shape[:-1]
        out = torch.full(shape, float("nan"), dtype=torch.float32, device=x.device)
        y = ks.logsumexp_forward(x, dim, out=out)
        return y
    out = torch.full_like(x, float("nan"))
    y = ks.softmax_forward(x, dim, log=mode == "log_softmax", out=out)
    assert y.data_ptr() == out.data_ptr()  # written in place (through a copy for odd layouts)
    return y
