"""The LSE toolkit: softmax / log_softmax / logsumexp and the log-semiring bmm.

Every numeric check compares with float64 PyTorch math on the same (already rounded) inputs and asserts
the CONVENTIONS.md §7 bound through `ringlse.testing.assert_judged`: float32 within `1e-3 * max|ref|`, float16 /
bfloat16 within twice the error of the same math done naively in that dtype plus the rounding floor.
Inputs are fresh random draws with `-inf` entries and all `-inf` rows mixed in; kernel outputs are
poisoned with NaN before the kernel writes them (the launchers take `out=`).

CPU: the PyTorch fallbacks (float64 gradcheck) and the Triton kernels under the interpreter (float32 and
float16: the interpreter is only trusted for those, CONVENTIONS.md §7). GPU (`@pytest.mark.gpu`): the public
functions on CUDA in bf16/fp16/fp32, rows up to 1M columns, and log_bmm.

The kernels' paths are steered through `ringlse.lse.kernels.softmax.config_override` (rows shrunk so that
small inputs take the long-row kernels) and observed through `ringlse.kernels.launch.recorded_launches`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringlse import lse as lt
from ringlse.lse import torch_paths
from ringlse.testing import assert_judged
from lse_checks import (
    F64, INTERPRETER_WARNINGS, KERNEL_DTYPES, LOG_BMM_CASES, MODES, NEG_INF, call_public, grad_from_y, judge_against,
    kernel_forward, log_bmm_ref, make_ab, make_x,
)

pytestmark = INTERPRETER_WARNINGS

# ----------------------------------------------------------------------------------------------------
# cheapest first: import and the PyTorch fallbacks


def test_import_needs_no_triton():
    code = "import sys, ringlse; ringlse.softmax, ringlse.log_bmm; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": "0"})



FALLBACK_CASES = [
    pytest.param((1,), -1, id="1"),
    pytest.param((5, 97), -1, id="5x97"),
    pytest.param((3, 4097), -1, id="3x4097"),
    pytest.param((4, 13, 6), 1, id="4x13x6-dim1"),
    pytest.param((97, 3), 0, id="97x3-dim0"),
]




@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,dim", FALLBACK_CASES)
def test_fallback_forward_backward(shape, dim, mode, dtype):
    x = make_x(shape, dim, dtype, scale=3.0, seed=1).requires_grad_()
    y = call_public(mode, x, dim)
    assert y.dtype == dtype and not torch.isnan(y).any()
    judge_against("fwd", y.float() if mode == "logsumexp" else y, x.detach(), dim, mode, dtype)
    g = torch.randn(y.shape, dtype=F64, generator=torch.Generator().manual_seed(2)).to(dtype)  # (not the global
    # RNG: the draw would depend on which tests ran before)
    (dx,) = torch.autograd.grad(y, x, g)
    assert not torch.isnan(dx).any()
    judge_against("dx", dx, x.detach(), dim, mode, dtype, g=g)


@pytest.mark.parametrize("mode", MODES)
def test_fallback_gradcheck_float64(mode):
    x = make_x((3, 11), -1, F64, scale=2.0, seed=2, inf_frac=0.0, empty_rows=False).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: call_public(mode, t, -1), (x,))
    assert torch.autograd.gradgradcheck(lambda t: call_public(mode, t, 0), (x,))


@pytest.mark.parametrize("mode", MODES)
def test_fallback_all_neginf_rows_no_nan(mode):
    x = torch.full((2, 5), NEG_INF, dtype=torch.float32, requires_grad=True)
    y = call_public(mode, x, -1)
    expect = {"softmax": 0.0, "log_softmax": NEG_INF, "logsumexp": NEG_INF}[mode]
    assert torch.all(y == expect)
    g = torch.randn(y.shape)
    (dx,) = torch.autograd.grad(y, x, g)
    # softmax and logsumexp: zero gradient; log_softmax: dx = g - exp(y) * sum(g) = g
    torch.testing.assert_close(dx, g if mode == "log_softmax" else torch.zeros_like(dx), rtol=0, atol=0)


def test_fallback_matches_torch_on_finite_rows():
    x = torch.randn(6, 33, dtype=F64) * 5
    torch.testing.assert_close(lt.softmax(x, 1), torch.softmax(x, 1))
    torch.testing.assert_close(lt.log_softmax(x, 0), torch.log_softmax(x, 0))
    torch.testing.assert_close(lt.logsumexp(x, 1, keepdim=True), torch.logsumexp(x, 1, keepdim=True))


def test_fallback_empty_dim():
    x = torch.randn(3, 0)
    assert lt.softmax(x).shape == (3, 0)
    assert torch.all(lt.logsumexp(x, -1) == NEG_INF)






@pytest.mark.parametrize("dims", LOG_BMM_CASES)
def test_fallback_log_bmm(dims):
    a, b = make_ab(*dims, torch.float32, seed=3)
    a.requires_grad_()
    b.requires_grad_()
    out = lt.log_bmm(a, b)
    g = torch.randn(out.shape)
    ga, gb = torch.autograd.grad(out, (a, b), g)
    ref, ra, rb = log_bmm_ref(a.detach(), b.detach(), g)
    assert_judged("out", out, ref, None, torch.float32)
    assert_judged("grad_a", ga, ra, None, torch.float32)
    assert_judged("grad_b", gb, rb, None, torch.float32)
    assert not (ga.isnan().any() or gb.isnan().any())


def test_fallback_log_bmm_gradcheck_and_chunking(monkeypatch):
    a, b = make_ab(2, 5, 9, 4, F64, seed=4, infs=False)
    # k-chunks of 2 (as when memory is short) must give the same function and gradients
    monkeypatch.setattr(torch_paths, "_LOG_BMM_CHUNK_ELEMS", 2 * 2 * 5 * 4)
    assert torch.autograd.gradcheck(lt.log_bmm, (a.requires_grad_(), b.requires_grad_()))
    torch.testing.assert_close(lt.log_bmm(a, b), log_bmm_ref(a, b))


def test_log_bmm_rejects_bad_shapes():
    with pytest.raises(ValueError, match="log_bmm"):
        lt.log_bmm(torch.randn(2, 3, 4), torch.randn(2, 5, 6))


# ----------------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (CPU tensors, kernel-module functions called directly)

KERNEL_CASES = [
    pytest.param((1, 1), -1, id="1x1"),
    pytest.param((5, 97), -1, id="5x97"),
    pytest.param((3, 4097), -1, id="3x4097"),
    pytest.param((4, 13, 6), 1, id="4x13x6-dim1"),
    pytest.param((97, 3), 0, id="97x3-dim0"),
    pytest.param((2, 3, 40, 5), 2, id="2x3x40x5-dim2"),  # rows fold into (outer 6, inner 5) strides
]

# long-row regimes, shrunk so that small rows take them: two passes in one program per row ("fused") or
# rows split over programs with a stats kernel and a merge ("split")
REGIMES = {
    "rows": {},
    "fused": {"max_row_block": 16, "max_row_block_16": 16, "max_row_block_bwd": 16, "chunk": 32, "split_rows": 1},
    "split": {"max_row_block": 16, "max_row_block_16": 16, "max_row_block_bwd": 16, "chunk": 32, "split_rows": 1 << 30},
}
# the cooperative kernels under the interpreter: at most 3 programs, rows of one piece (it runs programs
# one after another: a program waiting on a later one would wait forever, so rows of more pieces take
# the other paths there), pieces at least as long as the rows of these tests (the launcher halves them
# where that fills them better)
COOP_ONE_PIECE = {"coop_max_programs": 3, "coop_min_rows": 1,
                  **{f"coop_piece_{which}": 128 for which in ("fwd", "fwd_16", "bwd", "bwd_16")}}








def kernel_backward(ks, mode, x, g, dim):
    out = torch.full_like(x, float("nan"))
    if mode == "logsumexp":
        lse = ks.logsumexp_forward(x, dim)
        return ks.logsumexp_backward(x, lse, g, dim, out=out)
    y = ks.softmax_forward(x, dim, log=mode == "log_softmax")
    return ks.softmax_backward(y, g, dim, log=mode == "log_softmax", out=out)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,dim", KERNEL_CASES)
def test_kernel_forward(kernels, shape, dim, mode, dtype):
    x = make_x(shape, dim, dtype, scale=3.0, seed=5)
    y = kernel_forward(kernels, mode, x, dim)
    assert not torch.isnan(y).any()
    judge_against("fwd", y, x, dim, mode, dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,dim", KERNEL_CASES)
def test_kernel_backward(kernels, shape, dim, mode, dtype):
    x = make_x(shape, dim, dtype, scale=3.0, seed=6)
    gshape = x.movedim(dim, -1).shape[:-1] if mode == "logsumexp" else x.shape
    g = torch.randn(gshape, dtype=F64, generator=torch.Generator().manual_seed(7)).to(dtype)
    dx = kernel_backward(kernels, mode, x, g, dim)
    assert dx.dtype == dtype and not torch.isnan(dx).any()
    judge_against("dx", dx, x, dim, mode, dtype, g=g)


LONG_CASES = [
    pytest.param((5, 97), -1, id="5x97"),
    pytest.param((2, 300), -1, id="2x300"),
    pytest.param((4, 45, 3), 1, id="4x45x3-dim1"),
]


@pytest.mark.parametrize("regime", ["fused", "split"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,dim", LONG_CASES)
def test_kernel_long_rows(kernels, shape, dim, mode, regime):
    x = make_x(shape, dim, torch.float32, scale=3.0, seed=7)
    gshape = x.movedim(dim, -1).shape[:-1] if mode == "logsumexp" else x.shape
    g = torch.randn(gshape)
    with kernels.config_override(**REGIMES[regime]):
        judge_against("fwd", kernel_forward(kernels, mode, x, dim), x, dim, mode, torch.float32)
        judge_against("dx", kernel_backward(kernels, mode, x, g, dim), x, dim, mode, torch.float32, g=g)


@pytest.mark.parametrize("regime", ["rows", "split"])
@pytest.mark.parametrize("mode", MODES)
def test_kernel_scaled_x100_fp16(kernels, mode, regime):
    """Large logits: the max shift must keep every exp in range (fp16 holds at most 65504)."""
    x = make_x((3, 150), -1, torch.float16, scale=100.0, seed=8)
    with kernels.config_override(**REGIMES[regime]):
        judge_against("fwd", kernel_forward(kernels, mode, x, -1), x, -1, mode, torch.float16)


def test_kernel_non_foldable_layout_and_all_neginf(kernels):
    # leading dims that fold into three stride groups: the launcher copies; all -inf rows stay finite
    x = make_x((3, 4, 5, 6), 3, torch.float32, seed=9).permute(0, 2, 1, 3)
    for mode in MODES:
        judge_against("fwd", kernel_forward(kernels, mode, x, 3), x, 3, mode, torch.float32)
    z = torch.full((2, 7), NEG_INF)
    assert torch.all(kernels.softmax_forward(z) == 0)
    assert torch.all(kernels.softmax_forward(z, log=True) == NEG_INF)
    assert torch.all(kernels.logsumexp_forward(z) == NEG_INF)
    assert torch.all(kernels.logsumexp_backward(z, kernels.logsumexp_forward(z), torch.ones(2)) == 0)


def test_kernel_out_checked_before_launch(kernels):
    """An `out` of the wrong shape, dtype or device raises ValueError (a `meta` tensor stands for
    another device), before any kernel reads a pointer."""
    x = make_x((3, 40), -1, torch.float32, seed=10)
    for bad in (torch.empty(3, 41), torch.empty(3, 40, dtype=torch.float16), torch.empty(3, 40, device="meta")):
        with pytest.raises(ValueError, match="out must be"):
            kernels.softmax_forward(x, out=bad)
        with pytest.raises(ValueError, match="out must be"):
            kernels.softmax_backward(x, x, out=bad)
    for bad in (torch.empty(4), torch.empty(3, dtype=torch.float16), torch.empty(3, device="meta")):
        with pytest.raises(ValueError, match="out must be"):
            kernels.logsumexp_forward(x, out=bad)


@pytest.mark.parametrize("mode", ["softmax", "log_softmax"])
def test_kernel_cooperative_one_piece_per_row(kernels, launches, mode):
    """The cooperative kernels under the interpreter: with one piece per row a program waits only on
    itself (more pieces would wait on programs the interpreter has not run yet; the GPU tests cover
    those). Rows are spread over 3 programs, strided columns included (`fwd_coop_kernel` element by
    element, `bwd_coop_kernel`), as whole rows in flight."""
    for shape in ((7, 45, 3), (7, 32, 3)):  # 32: the row fills its piece, no column mask (EVEN)
        x = make_x(shape, 1, torch.float32, scale=3.0, seed=17)
        g = torch.randn(x.shape)
        launches.clear()
        with kernels.config_override(**{**COOP_ONE_PIECE, "coop_piece_fwd": 64, "coop_piece_bwd": 64},
                                     max_row_block=16, max_row_block_bwd=16):
            judge_against("fwd", kernel_forward(kernels, mode, x, 1), x, 1, mode, torch.float32)
            judge_against("dx", kernel_backward(kernels, mode, x, g, 1), x, 1, mode, torch.float32, g=g)
        fwd = [ln for ln in launches if ln.kernel == "fwd_coop_kernel"]
        bwd = [ln for ln in launches if ln.kernel == "bwd_coop_kernel"]
        assert len(fwd) == 2 and len(bwd) == 1, [ln.kernel for ln in launches]
        assert fwd[0].grid == (3,) and fwd[0].consts["PACK"] == 0 and not fwd[0].consts["TASKS"]
        assert fwd[0].consts["EVEN"] == (shape[1] == 32) and bwd[0].consts["EVEN"] == (shape[1] == 32)


def assert_backward_of_y(dx, y, g, dim, mode):
    """A 2-byte `softmax_backward(y, g)` against the exact (float64) backward of the same rounded y and
    g: within one rounding of its dtype (a whole ulp: the interpreter's float32 -> bf16 cast truncates)
    plus float32 arithmetic. Not the gradient of softmax(x) with an in-dtype baseline: on rows near one
    hot (x100) y's own rounding is most of that error, which no backward can undo and which the baseline,
    from its own rounded y, meets or misses by chance (fp16 strided x100: 7 of 150 draws of g over the
    bound, every one with dx equal to the exact backward of the rounded y)."""
    gd = g.double()
    exact = grad_from_y(y.double(), gd, dim, mode)
    ulp = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dx.dtype]  # relative spacing, at most
    err = (dx.double() - exact).abs()
    tol = ulp * exact.abs() + 1e-5 * (gd.abs().max() + exact.abs().max())
    worst = (err - tol).flatten().argmax()
    assert (err <= tol).all(), f"err {err.flatten()[worst].item():.3e} over tol {tol.flatten()[worst].item():.3e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(
    "shape, dim, cut, kernel",
    [
        pytest.param((9, 46), -1, 0, "aligned", id="9x46"),
        # rows on 16-byte boundaries: the plain form loads as wide (2-byte rows as words of two)
        pytest.param((5, 64), -1, 0, "pairs", id="5x64"),
        pytest.param((3, 4, 98), -1, 0, "aligned", id="3x4x98"),
        pytest.param((9, 45), -1, 0, "aligned", id="odd-9x45"),  # rows start anywhere: end vectors padded
        pytest.param((9, 48), -1, 2, "pairs", id="cut2-9x46"),  # base 4-byte but not 16-byte aligned
        pytest.param((9, 47), -1, 1, "elements", id="cut1-9x46"),  # base 2-byte aligned
        pytest.param((46, 9), 0, 0, "elements", id="strided"),  # columns not contiguous
        pytest.param((11, 7), -1, 0, "aligned", id="tiny-11x7"),  # rows of 7: one whole vector at most, or none
    ],
)
@pytest.mark.parametrize("mode", ["softmax", "log_softmax"])
def test_kernel_cooperative_layouts(kernels, launches, mode, dtype, shape, dim, cut, kernel):
    """The cooperative kernels' forms under the interpreter, with one piece per row: rows of
    contiguous columns off 16-byte boundaries in 16-byte vectors and their ends element by element
    (`fwd_coop_aligned_kernel`, 2-byte rows as words of two; `bwd_coop_aligned_kernel`), else
    2-byte rows as words where they are 4-byte aligned, else element by element (`fwd_coop_kernel`,
    `bwd_coop_kernel`); -inf entries, all -inf rows, values x100, forward and backward; and logsumexp,
    which takes the aligned forward for 2-byte rows off the boundaries."""
    # (rows longer than the row kernels take: every row here; the aligned backward from one column)
    knobs = dict(COOP_ONE_PIECE, max_row_block=4, max_row_block_16=4, max_row_block_bwd=4, aligned_min_cols=1,
                 aligned_min_cols_16=1)
    for scale in (3.0, 100.0):
        x = make_x(shape, dim, dtype, scale=scale, seed=23)[..., cut:]
        g = torch.randn(x.shape, dtype=F64, generator=torch.Generator().manual_seed(29)).to(dtype)
        with kernels.config_override(**knobs):
            judge_against("fwd", kernel_forward(kernels, mode, x, dim), x, dim, mode, dtype)
            if dtype == torch.float32:
                judge_against("dx", kernel_backward(kernels, mode, x, g, dim), x, dim, mode, dtype, g=g)
            else:
                y = kernels.softmax_forward(x, dim, log=mode == "log_softmax")
                dx = kernels.softmax_backward(y, g, dim, log=mode == "log_softmax")
                assert_backward_of_y(dx, y, g, dim, mode)
    pack = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[dtype]
    if dtype == torch.float32 and kernel == "pairs":
        kernel = "elements"  # (float32 rows are not paired)
    want = {"aligned": ("fwd_coop_aligned_kernel", pack), "pairs": ("fwd_coop_kernel", pack),
            "elements": ("fwd_coop_kernel", 0)}[kernel]
    # the backward's y, g and dx are fresh: contiguous rows, off the boundaries where their length is
    off = dim == -1 and x.shape[-1] * x.element_size() % 16
    want_bwd = "bwd_coop_aligned_kernel" if off else "bwd_coop_kernel"
    coop = [(ln.kernel, ln.consts.get("PACK")) for ln in launches if "_coop_" in ln.kernel]
    assert coop[0] == want
    assert next(name for name, _ in coop if name.startswith("bwd")) == want_bwd
    if mode == "softmax":  # 2-byte logsumexp reads rows off the boundaries as the forward does (its MODE 2)
        launches.clear()
        for scale in (3.0, 100.0):
            x = make_x(shape, dim, dtype, scale=scale, seed=29)[..., cut:]
            with kernels.config_override(**knobs):
                judge_against("lse", kernel_forward(kernels, "logsumexp", x, dim), x, dim, "logsumexp", dtype)
        coop = [(ln.kernel, ln.consts.get("PACK")) for ln in launches if "_coop_" in ln.kernel]
        assert coop == ([want] * 2 if kernel == "aligned" and pack else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(
    "shape, cut, aligned",
    [
        pytest.param((9, 46), 0, True, id="9x46"),
        pytest.param((3, 4, 98), 0, True, id="3x4x98"),  # rows fold into (outer, inner) strides
        pytest.param((9, 45), 0, True, id="odd-9x45"),  # rows start anywhere
        pytest.param((4, 1025), 0, True, id="4x1025"),
        # rows of 46 every 47 elements: the output's rows (46 apart) sit elsewhere from the boundaries
        pytest.param((9, 47), -1, "lse", id="end1-9x46"),
        pytest.param((11, 7), 0, True, id="tiny-11x7"),  # one whole vector at most, or none
        pytest.param((5, 64), 0, False, id="5x64"),  # on the boundaries: the row kernel loads as wide
        pytest.param((9, 47), 1, False, id="cut1-9x46"),  # base off 16 bytes: element by element
    ],
)
@pytest.mark.parametrize("mode", MODES)
def test_kernel_aligned_rows(kernels, launches, mode, dtype, shape, cut, aligned):
    """Short rows off 16-byte boundaries, one per program, in 16-byte vectors and their ends element by
    element (`fwd_rows_aligned_kernel`), under the interpreter: -inf entries, all -inf rows, values
    x100; rows on the boundaries, or with a base pointer off them, keep the row kernel."""
    for scale in (3.0, 100.0):
        x = make_x(shape, -1, dtype, scale=scale, seed=31)
        x = x[..., cut:] if cut >= 0 else x[..., :cut]
        with kernels.config_override(aligned_rows_min_cols=1):  # (the small rows take it too)
            judge_against("fwd", kernel_forward(kernels, mode, x, -1), x, -1, mode, dtype)
    aligned = aligned is True or (aligned == "lse" and mode == "logsumexp")
    want = "fwd_rows_aligned_kernel" if aligned else "fwd_rows_kernel"
    assert [ln.kernel for ln in launches] == [want, want]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_kernel_aligned_rows_any_length_and_stride(data):
    """`fwd_rows_aligned_kernel` under the interpreter on drawn row counts, lengths (1-200) and row
    strides (rows start anywhere), x and the output alike strided: values against float64; rows whose
    length leaves them off the 16-byte boundaries must take it. float32 and fp16 only: the interpreter's
    float32 -> bf16 cast truncates where the GPU rounds to nearest, a whole bf16 ulp that the bound
    derived from PyTorch's own bf16 softmax does not allow on rows of a few elements (found here: a row
    of 2); bf16 runs compiled in `test_gpu_aligned_rows`."""
    from ringlse.lse.kernels import softmax as ks
    from ringlse.kernels.launch import recorded_launches

    dtype = data.draw(st.sampled_from([torch.float32, torch.float16]), "dtype")
    mode = data.draw(st.sampled_from(MODES), "mode")
    rows, cols = data.draw(st.integers(1, 5), "rows"), data.draw(st.integers(1, 200), "cols")
    gap = data.draw(st.integers(0, 9), "gap")  # row stride = cols + gap
    x = make_x((rows, cols + gap), -1, dtype, scale=data.draw(st.sampled_from([1.0, 30.0]), "scale"),
               seed=data.draw(st.integers(0, 1 << 16), "seed"))[:, :cols]
    with recorded_launches() as launched, ks.config_override(aligned_rows_min_cols=1):
        if mode == "logsumexp":
            y = ks.logsumexp_forward(x)
        else:
            out = torch.full((rows, cols + gap), float("nan"), dtype=dtype)[:, :cols]
            y = ks.softmax_forward(x, log=mode == "log_softmax", out=out)
            assert y.data_ptr() == out.data_ptr()  # written in place, through the same strides
    judge_against("fwd", y, x, -1, mode, dtype)
    if cols * x.element_size() % 16:
        assert [ln.kernel for ln in launched] == ["fwd_rows_aligned_kernel"]


def test_cooperative_launch_refused_takes_fewer_programs():
    """Where the driver refuses a cooperative grid as too large, the launch (`coop_launch.CoopGrid`)
    halves its programs (a whole number of rows in flight unless the kernel takes tasks) and remembers
    the count for the next launch of that plan; below one row's K programs it reports that it ran
    nothing (the call plan is then built again and avoids the grid); other errors propagate."""
    from ringlse.kernels.launch import FREE
    from ringlse.lse.kernels.softmax.coop_launch import CoopGrid

    grids = []

    class FakeKernel:  # (not a JITFunction: launched through `kernel[grid](...)`, Triton's path)
        def __init__(self, limit, message="Triton Error [CUDA]: too many blocks in cooperative launch"):
            self.limit, self.message = limit, message

        def __getitem__(self, grid):
            def run(*args, **kw):
                grids.append(grid[0])
                if grid[0] > self.limit:
                    raise RuntimeError(self.message)
            return run

    caps: dict = {}
    x, y = torch.zeros(16, 8), torch.zeros(16, 8)

    def grid(limit, programs=15, tasks=True, key="fwd", message=None):  # rows of K = 2 pieces
        kernel = FakeKernel(limit) if message is None else FakeKernel(limit, message)
        return CoopGrid(kernel, (FREE, FREE, 16), programs, 2, tasks, 1, {"MODE": 0}, key, caps)

    assert grid(6)(x, y)
    assert grids == [15, 7, 3] and caps == {"fwd": 3}  # tasks: any number of programs
    grids.clear()
    assert grid(6)(x, y)
    assert grids == [3]  # straight to the remembered count
    grids.clear()
    assert not grid(0)(x, y)
    assert grids == [3]  # then 1 program, too few for a row of 2 pieces: nothing launched
    assert grid(0).most_programs() < 2  # (such a plan is not built: `coop_step` returns None)
    grids.clear()
    assert grid(6, programs=14, tasks=False, key="bwd")(x, y)
    assert grids == [14, 6]  # whole rows in flight: 7 then 3
    with pytest.raises(RuntimeError, match="out of memory"):
        grid(0, programs=14, tasks=False, key="oom", message="CUDA out of memory")(x, y)


@pytest.mark.parametrize("R, K, resident, logsumexp, want", [
    pytest.param(512, 64, 1584, False, True, id="512x64-fewer-steps"),  # 24 rows a step: 22 steps; tasks: 21
    pytest.param(1300, 25, 1584, False, False, id="1300x25-as-many"),  # 63 rows: 21 steps; tasks: 21
    pytest.param(1300, 25, 1584, True, True, id="1300x25-logsumexp"),  # piece 0 waits: its role rotates
    pytest.param(10, 4, 6, False, True, id="one-row-in-flight"),  # 1 row a step: 10 steps; tasks: 7
])
def test_tasks_where_they_take_fewer_steps(R, K, resident, logsumexp, want):
    """The forward takes its tasks in turn over every resident program where that takes fewer steps
    than whole rows in flight, and always for logsumexp (MODE 2)."""
    from ringlse.lse.kernels.softmax.coop_launch import use_tasks

    assert use_tasks(R, K, lambda tasks: min(R * K, resident), logsumexp) is want


def test_call_plan_built_again_after_refused_launch():
    """A plan whose cooperative launch was refused outright (`Replan`) is dropped and built again
    (the new one avoids that grid); the plan that worked is kept for the next call of the key."""
    from ringlse.lse.kernels.softmax.coop_launch import Replan
    from ringlse.lse.kernels.softmax.plan import PlanCache

    builds, runs = [], []

    def build(v):
        n = len(builds) + 1
        builds.append(v)

        def plan(v):
            runs.append(n)
            if n == 1:
                raise Replan
            return v * 10

        return plan

    cache = PlanCache()
    key = ("test", "refused")
    assert cache.run(key, build, 3) == 30
    assert builds == [3, 3] and runs == [1, 2]
    assert cache.run(key, build, 4) == 40
    assert builds == [3, 3] and runs == [1, 2, 2] and len(cache) == 1


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_call_plans_follow_layout_and_alignment(kernels, launches, dtype):
    """One plan per layout: tensors of one shape and strides whose data sit on and off 16-byte
    boundaries take different kernels (whichever comes first), and a config change takes effect at the
    next call; every result against float64."""
    from ringlse.lse.kernels.softmax.plan import CALL_PLANS

    flat = make_x((5, 46), -1, dtype, scale=3.0, seed=31).reshape(-1)
    # rows of 45: off the boundaries; `off` starts 1 element past one (the output rows are fresh)
    on, off = flat[:225].reshape(5, 45), flat[1:226].reshape(5, 45)
    CALL_PLANS.clear()
    with kernels.config_override(aligned_rows_min_cols=1):
        for x in (on, off, on, off):
            launches.clear()
            judge_against("fwd", kernels.softmax_forward(x), x, -1, "softmax", dtype)
            want = "fwd_rows_aligned_kernel" if x.data_ptr() % 16 == 0 else "fwd_rows_kernel"
            assert [ln.kernel for ln in launches] == [want]
    assert len(CALL_PLANS) == 2
    launches.clear()  # the default config again: rows of 45 (< `aligned_rows_min_cols`) take the row kernel
    judge_against("fwd", kernels.softmax_forward(on), on, -1, "softmax", dtype)
    assert [ln.kernel for ln in launches] == ["fwd_rows_kernel"]


def test_call_plans_hold_no_tensor(kernels):
    """A cached plan keeps no tensor of the call that built it alive (inputs, outputs, workspace)."""
    import gc
    import weakref

    from ringlse.lse.kernels.softmax.plan import CALL_PLANS

    CALL_PLANS.clear()
    x = torch.randn(6, 40, 3).movedim(1, 2)  # (a view whose rows are columns of the storage)
    g = torch.randn(6, 3, 40)
    y = kernels.softmax_forward(x)
    dx = kernels.softmax_backward(y, g)
    lse = kernels.logsumexp_forward(x)
    dl = kernels.logsumexp_backward(x, lse, lse)
    refs = [weakref.ref(t) for t in (x, g, y, dx, lse, dl)]
    del x, g, y, dx, lse, dl
    gc.collect()
    assert len(CALL_PLANS) == 4
    assert all(r() is None for r in refs)


def test_config_override_is_scoped_and_checked(kernels):
    """`config_override` replaces fields for its block only (nested blocks too) and refuses unknown
    names; the config is frozen."""
    import dataclasses

    base = kernels.active_config()
    assert base is kernels.CONFIG
    with kernels.config_override(max_row_block=64) as outer:
        assert kernels.active_config() is outer and outer.max_row_block == 64
        with kernels.config_override(chunk=32) as inner:
            assert (inner.max_row_block, inner.chunk) == (64, 32)
        assert kernels.active_config() is outer
    assert kernels.active_config() is base and base.max_row_block == 32768
    with pytest.raises(TypeError):
        with kernels.config_override(lookback_fwd=1):  # (a deleted knob)
            pass
    assert kernels.active_config() is base
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.max_row_block = 1
    assert hash(dataclasses.replace(base)) == hash(base) and dataclasses.replace(base) == base


@pytest.mark.parametrize(
    "n_regs, warps, shared, blocks",
    [
        pytest.param(246, 1, 0, 8, id="246r-1w"),  # 7936 registers per warp: 2 per sub-partition
        pytest.param(223, 1, 0, 8, id="223r-1w"),  # 9 by the SM's pool, 8 by its sub-partitions
        pytest.param(196, 1, 0, 8, id="196r-1w"),
        pytest.param(168, 1, 0, 12, id="168r-1w"),
        pytest.param(80, 2, 8, 12, id="80r-2w"),
        pytest.param(72, 2, 8, 14, id="72r-2w"),
        pytest.param(128, 4, 8, 4, id="128r-4w"),
        pytest.param(32, 1, 0, 32, id="32r-1w"),  # the 32-blocks limit
        pytest.param(32, 4, 100_000, 2, id="shared-bound"),
    ],
)
def test_blocks_per_sm_by_rules(n_regs, warps, shared, blocks):
    """The occupancy rules on known H100/H200 cases (registers allocated per warp in units of 256 from
    one of four sub-partitions of 16K registers; 1 KiB of shared memory reserved per block)."""
    from ringlse.lse.kernels.occupancy import blocks_per_sm_by_rules

    assert blocks_per_sm_by_rules(n_regs, warps, shared) == blocks


@pytest.mark.parametrize("mode", MODES)
def test_kernel_autograd_vs_float64(kernels, mode):
    """Gradients through the kernels' autograd Functions against float64 (float32: §7 bound rather
    than gradcheck, whose finite differences are too coarse in float32)."""
    x = make_x((4, 50), -1, torch.float32, scale=2.0, seed=10).requires_grad_()
    fn = {"softmax": kernels.softmax, "log_softmax": kernels.log_softmax, "logsumexp": kernels.logsumexp}[mode]
    y = fn(x, -1)
    g = torch.randn(y.shape)
    (dx,) = torch.autograd.grad(y, x, g)
    judge_against("dx", dx, x.detach(), -1, mode, torch.float32, g=g)
    x64 = x.detach().double().requires_grad_()
    (dx64,) = torch.autograd.grad(call_public(mode, x64, -1), x64, g.double())
    assert_judged("vs autograd", dx, dx64, None, torch.float32)


