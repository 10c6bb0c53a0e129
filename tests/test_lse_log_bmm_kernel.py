"""The LSE toolkit's log_bmm kernels (`ringlse/lse/kernels/log_bmm.py`) under the interpreter: forward,
both backward paths and autograd. Judged as tests/test_lse_toolkit.py says."""

from __future__ import annotations

import pytest
import torch

from ringlse.testing import assert_judged
from lse_checks import INTERPRETER_WARNINGS, KERNEL_DTYPES, LOG_BMM_CASES, log_bmm_ref, make_ab

pytestmark = INTERPRETER_WARNINGS


@pytest.fixture
def lbmm():
    from ringlse.lse.kernels import log_bmm as kl

    return kl


@pytest.mark.parametrize("scale", [2.0, 100.0], ids=["x1", "x100"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("dims", LOG_BMM_CASES)
def test_kernel_log_bmm(lbmm, dims, dtype, scale):
    a, b = make_ab(*dims, dtype, scale=scale, seed=11)
    out = lbmm.log_bmm_forward(a, b, out=torch.full((dims[0], dims[1], dims[3]), float("nan")))
    g = torch.randn(out.shape)
    ga, gb = lbmm.log_bmm_backward(a, b, out, g)
    ref, ra, rb = log_bmm_ref(a, b, g)
    # float16 inputs are computed in float32 from exactly those values: the float32 bound applies
    assert_judged("out", out, ref, None, torch.float32)
    assert_judged("grad_a", ga, ra, None, torch.float32)
    assert_judged("grad_b", gb, rb, None, torch.float32)
    assert not (out.isnan().any() or ga.isnan().any() or gb.isnan().any())
    # all -inf entries of out stay -inf and pass exactly zero gradient (DESIGN §2): row N // 2 of batch 0
    # and column P - 1 of the last batch
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref))
    assert torch.isneginf(out[0, dims[1] // 2]).all() and torch.isneginf(out[-1, :, -1]).all()
    ga0, gb0 = lbmm.log_bmm_backward(a, b, out, torch.where(torch.isneginf(out), g, 0.0))
    assert torch.all(ga0 == 0) and torch.all(gb0 == 0)


@pytest.mark.parametrize("knobs", [
    {"dot_min_tiles": 1 << 62},  # the exact kernel alone
    {"dot_min_tiles": 1, "dot_bx": 16, "dot_by": 16, "dot_bs": 8},  # wide tiles redone exactly
    {"dot_min_tiles": 1, "dot_max_shift": -1e9},  # every tile redone exactly
    {"dot_min_tiles": 1, "dot_max_shift": 1e9},  # factored wherever W stays finite
    {"dot_min_tiles": 1 << 30},  # too few tiles: the exact kernel alone
], ids=["exact", "mixed", "all-exact", "all-factored", "few-tiles"])
def test_kernel_log_bmm_backward_paths(lbmm, knobs):
    """The factored backward (tile-local maxima, a float32 matmul) and its exact fallback per tile:
    one half of the inputs spread over hundreds (those tiles fall back), the other over a few units."""
    a, b = make_ab(2, 40, 50, 36, torch.float32, scale=2.0, seed=12)
    a[:, 20:] *= 100.0
    b[:, :, 18:] *= 100.0
    with lbmm.config_override(**knobs):
        out = lbmm.log_bmm_forward(a, b)
        g = torch.randn(out.shape)
        ga, gb = lbmm.log_bmm_backward(a, b, out, g)
    _, ra, rb = log_bmm_ref(a, b, g)
    assert_judged("grad_a", ga, ra, None, torch.float32)
    assert_judged("grad_b", gb, rb, None, torch.float32)
    assert not (ga.isnan().any() or gb.isnan().any())


def test_kernel_log_bmm_autograd(lbmm):
    a, b = make_ab(1, 20, 33, 9, torch.float16, seed=12)
    a.requires_grad_()
    b.requires_grad_()
    out = lbmm.log_bmm(a, b)
    assert out.dtype == torch.float32
    g = torch.randn(out.shape)
    ga, gb = torch.autograd.grad(out, (a, b), g)
    assert ga.dtype == gb.dtype == torch.float16
    _, ra, rb = log_bmm_ref(a.detach(), b.detach(), g)
    baseline_a = ra.to(torch.float16)  # the float16 rounding of the exact gradient is what fp16 allows
    assert_judged("grad_a", ga, ra, baseline_a, torch.float16)
    assert_judged("grad_b", gb, rb, rb.to(torch.float16), torch.float16)


