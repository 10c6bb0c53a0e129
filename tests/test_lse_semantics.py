"""The LSE toolkit's semantics against torch's, case by case (NaN, +inf, -inf, dtypes, dim).

`ringlse.softmax`, `log_softmax`, `logsumexp` follow `torch.softmax`, `torch.log_softmax`,
`torch.logsumexp` on the same input (same dtype, CPU), compared with `assert_close(equal_nan=True)`,
except for the deliberate differences of `ringlse.lse`'s docstring:

- an all -inf row: softmax 0 and log_softmax -inf (torch: NaN), no NaN in the gradients;
- integer / bool input to softmax / log_softmax: our TypeError (torch: NotImplementedError);
- complex / float8: TypeError (torch.logsumexp takes complex).

`log_bmm` (no torch counterpart) follows the naive `torch.logsumexp(a[:, :, :, None] + b[:, None], 2)`.
Gradients of NaN / +inf rows: no crash, and torch's where torch's are finite.

CPU runs the PyTorch fallbacks; the same cases also run through the Triton kernels under the interpreter
(CPU tensors, the kernel modules' launchers, float32) and, `@pytest.mark.gpu`, through the public
functions on CUDA (float32). Where the kernels disagree with torch on NaN / +inf the cases are marked
`xfail(strict=True)` (KERNEL_XFAIL, GPU_XFAIL): the jit kernels are not changed here.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

import ringlse
from ringlse.lse import functions as lt
from ringlse.lse import torch_paths

NAN, INF, NEG_INF = float("nan"), float("inf"), float("-inf")
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64

pytestmark = [
    # the interpreter evaluates both sides of guarded `where`s (e.g. -inf - -inf) in numpy
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter"),
]

ISSUE = "LSE toolkit NaN/+inf issue (silent wrong answers)"

FNS = ["softmax", "log_softmax", "logsumexp"]
OURS: dict[str, Callable[..., torch.Tensor]] = {
    "softmax": ringlse.softmax, "log_softmax": ringlse.log_softmax, "logsumexp": ringlse.logsumexp,
}
TORCH: dict[str, Callable[..., torch.Tensor]] = {
    "softmax": torch.softmax, "log_softmax": torch.log_softmax, "logsumexp": torch.logsumexp,
}

# id: (the row's three special entries, filler of its other columns in longer rows: None = finite values)
ROW_CASES: dict[str, tuple[list[float], float | None]] = {
    "finite": ([0.0, 1.0, 2.0], None),
    "neginf_mix": ([NEG_INF, 0.0, 1.0], None),
    "one_finite": ([NEG_INF, 2.0, NEG_INF], NEG_INF),
    "all_neginf": ([NEG_INF, NEG_INF, NEG_INF], NEG_INF),  # deliberate difference (softmax, log_softmax)
    "nan": ([0.0, NAN, 1.0], None),
    "nan_neginf": ([NEG_INF, NAN, NEG_INF], NEG_INF),  # a NaN makes the row NaN, not empty
    "all_nan": ([NAN, NAN, NAN], NAN),
    "posinf": ([0.0, INF, 1.0], None),
    "posinf_twice": ([INF, INF, 1.0], None),
    "posinf_neginf": ([NEG_INF, INF, 1.0], None),
    "posinf_neginf_only": ([NEG_INF, INF, NEG_INF], NEG_INF),
    "all_posinf": ([INF, INF, INF], INF),
    "nan_posinf": ([NAN, INF, 1.0], None),
}
CASES = list(ROW_CASES)
SPECIAL = {"nan", "nan_neginf", "all_nan", "posinf", "posinf_twice", "posinf_neginf", "posinf_neginf_only",
           "all_posinf", "nan_posinf"}

DTYPES = [pytest.param(F32, id="fp32"), pytest.param(F64, id="fp64"), pytest.param(F16, id="fp16"),
          pytest.param(BF16, id="bf16")]
LAYOUTS = ["last", "dim0"]


def make_rows(case: str, n: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """`[2, n]`: row 0 the case (its three entries at columns 0, n // 2, n - 1), row 1 finite."""
    vals, fill = ROW_CASES[case]
    base = torch.linspace(-3.0, 3.0, n, dtype=F64)
    row = base.flip(0) if fill is None else torch.full((n,), fill, dtype=F64)
    row[[0, n // 2, n - 1]] = torch.tensor(vals, dtype=F64)
    return torch.stack([row, base]).to(device=device, dtype=dtype)


def laid_out(x: torch.Tensor, layout: str) -> tuple[torch.Tensor, int]:
    """`(x, dim)`: the rows along the last dim, or along dim 0 of the transposed (contiguous) tensor."""
    return (x, -1) if layout == "last" else (x.t().contiguous(), 0)


def expected(fn: str, x: torch.Tensor, dim: int) -> torch.Tensor:
    """torch's answer, with our deliberate difference for all -inf rows (softmax 0, log_softmax -inf)."""
    ref = TORCH[fn](x, dim)
    if fn != "logsumexp":
        empty = torch.isneginf(x).all(dim, keepdim=True)
        ref = torch.where(empty, torch.full_like(ref, 0.0 if fn == "softmax" else NEG_INF), ref)
    return ref


def grad_weights(shape: torch.Size, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """Fixed output gradients in [-1, 1] of mean ~0 (so that `sum(g)` stays small and long rows' backward
    is well conditioned)."""
    return torch.sin(1.0 + torch.arange(shape.numel(), dtype=F64)).reshape(shape).to(device=device, dtype=dtype)


def assert_grad_where_torch_finite(ours: torch.Tensor, ref: torch.Tensor, **tol) -> None:
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    finite = torch.isfinite(ref)
    torch.testing.assert_close(ours[finite], ref[finite], **tol)


# ----------------------------------------------------------------------------------------------------
# the PyTorch fallbacks (CPU) against torch


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("fn", FNS)
def test_forward_matches_torch(fn, case, dtype, layout):
    x, dim = laid_out(make_rows(case, 3, dtype), layout)
    y = OURS[fn](x, dim)
    assert y.dtype == dtype
    want = expected(fn, x, dim)
    if dtype in (F16, BF16):
        # torch's 16-bit log_softmax rounds its lse to 16 bits before `x - lse` (ours: one rounding, of
        # the float32 result): the values are judged against torch's float32 answer rounded once, the
        # NaN / +-inf pattern against torch's own 16-bit answer
        for special in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(special(y), special(want)), special.__name__
        want = expected(fn, x.float(), dim).to(dtype)
    torch.testing.assert_close(y, want, equal_nan=True)


@pytest.mark.parametrize("n", [3, 40], ids=["n3", "n40"])
@pytest.mark.parametrize("dtype", [pytest.param(F32, id="fp32"), pytest.param(F64, id="fp64")])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("fn", FNS)
def test_backward_matches_torch_where_finite(fn, case, dtype, n):
    x = make_rows(case, n, dtype)
    xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, yt = OURS[fn](xo, -1), TORCH[fn](xt, -1)
    g = grad_weights(y.shape, dtype)
    (dx,) = torch.autograd.grad(y, xo, g)
    (dxt,) = torch.autograd.grad(yt, xt, g)
    assert_grad_where_torch_finite(dx, dxt)
    # the finite row is untouched by its neighbour
    torch.testing.assert_close(dx[1], dxt[1])
    if case == "all_neginf":  # torch: NaN; ours: 0 (softmax, logsumexp) or g (log_softmax), no NaN
        torch.testing.assert_close(dx[0], g[0] if fn == "log_softmax" else torch.zeros_like(dx[0]), rtol=0, atol=0)


@pytest.mark.parametrize("fn", FNS)
def test_issue_examples(fn):
    """The reported wrong answers, one by one."""
    x = torch.tensor([0.0, NAN, 1.0])
    assert torch.isnan(OURS[fn](x)).all()  # was -inf (logsumexp)
    x = torch.tensor([0.0, INF, 1.0])
    want = TORCH[fn](x, -1)  # softmax, log_softmax: NaN everywhere (was [0, nan, 0]); logsumexp +inf
    torch.testing.assert_close(OURS[fn](x), want, equal_nan=True)
    if fn == "logsumexp":
        assert OURS[fn](x).item() == INF
        torch.testing.assert_close(ringlse.logsumexp(torch.arange(4)), torch.tensor(3.4401896))  # was 3
    else:
        with pytest.raises(TypeError, match=f"{fn}: .*torch.int64"):
            OURS[fn](torch.arange(5))  # was zeros (softmax)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", FNS)
def test_all_neginf_rows_deliberate_difference(fn, dtype):
    """Documented difference from torch: an all -inf row is empty (no NaN forward or backward)."""
    x = torch.full((2, 5), NEG_INF, dtype=dtype, requires_grad=True)
    y = OURS[fn](x, -1)
    want = {"softmax": 0.0, "log_softmax": NEG_INF, "logsumexp": NEG_INF}[fn]
    assert y.dtype == dtype and torch.all(y == want)
    if fn != "logsumexp":
        assert torch.isnan(TORCH[fn](x.detach(), -1)).all()  # (torch's answer, which we do not follow)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert not torch.isnan(dx).any()


# integer and bool inputs

INT_DTYPES = [pytest.param(dt, id=str(dt).removeprefix("torch.")) for dt in
              (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)]


@pytest.mark.parametrize("dtype", INT_DTYPES)
@pytest.mark.parametrize("fn", ["softmax", "log_softmax"])
def test_softmax_rejects_integer_and_bool(monkeypatch, fn, dtype):
    x = (torch.arange(5) % 3).to(dtype)
    with pytest.raises(NotImplementedError):  # torch raises too (its own error)
        TORCH[fn](x, -1)
    # ours: a TypeError naming the function and the dtype, raised before any work
    def no_work(*args, **kwargs):
        raise AssertionError("work started before the dtype check")

    monkeypatch.setattr(lt, "_kernels", no_work)
    monkeypatch.setattr(lt, "torch_softmax", no_work)
    with pytest.raises(TypeError, match=rf"^{fn}: x must be .* got {dtype}"):
        OURS[fn](x, -1)


@pytest.mark.parametrize("default", [pytest.param(F32, id="default-fp32"), pytest.param(F64, id="default-fp64")])
@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_logsumexp_integer_and_bool_as_torch(dtype, default):
    """torch.logsumexp computes integer and bool input in (and returns) the default float dtype."""
    x = (torch.arange(12).reshape(3, 4) % 5).to(dtype)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        for dim, keepdim in ((-1, False), (0, True)):
            want = torch.logsumexp(x, dim, keepdim=keepdim)
            got = ringlse.logsumexp(x, dim, keepdim=keepdim)
            assert got.dtype == want.dtype == default
            torch.testing.assert_close(got, want)
        torch.testing.assert_close(ringlse.logsumexp(x[0, 0], 0), torch.logsumexp(x[0, 0], 0))  # 0-D
    finally:
        torch.set_default_dtype(saved)


OTHER_DTYPES = [pytest.param(torch.complex64, id="complex64"), pytest.param(torch.float8_e4m3fn, id="float8_e4m3fn"),
                pytest.param(torch.float8_e5m2, id="float8_e5m2")]


@pytest.mark.parametrize("dtype", OTHER_DTYPES)
@pytest.mark.parametrize("fn", FNS)
def test_other_dtypes_raise_type_error(fn, dtype):
    x = torch.zeros(2, 3).to(dtype)
    with pytest.raises(TypeError, match=rf"^{fn}: x must be .* got {dtype}"):
        OURS[fn](x, -1)


# dim


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize(
    "shape,dim",
    [pytest.param((2, 3), 2, id="2d-dim2"), pytest.param((2, 3), 3, id="2d-dim3"),
     pytest.param((2, 3), -3, id="2d-dim-3"), pytest.param((), 1, id="0d-dim1"),
     pytest.param((), -2, id="0d-dim-2"), pytest.param((4,), 1, id="1d-dim1")],
)
def test_dim_out_of_range(fn, shape, dim):
    x = torch.zeros(shape)
    with pytest.raises(IndexError):
        TORCH[fn](x, dim)  # torch raises IndexError too
    with pytest.raises(IndexError, match=rf"^{fn}: dim {dim} out of range for a {len(shape)}-D tensor"):
        OURS[fn](x, dim)


@pytest.mark.parametrize("fn", FNS)
def test_dim_out_of_range_checked_first_for_integer_logsumexp(fn):
    x = torch.arange(6).reshape(2, 3)
    with pytest.raises(IndexError if fn == "logsumexp" else TypeError, match=f"^{fn}: "):
        OURS[fn](x, 5)


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("dim", [0, -1])
def test_zero_dim_tensor_as_torch(fn, dim):
    x = torch.tensor(1.5)
    torch.testing.assert_close(OURS[fn](x, dim), TORCH[fn](x, dim))


@pytest.mark.parametrize("fn", FNS)
def test_dim_not_an_int(fn):
    with pytest.raises(TypeError, match=f"^{fn}: dim must be an int"):
        OURS[fn](torch.zeros(2, 3), 1.0)


# ----------------------------------------------------------------------------------------------------
# log_bmm against the naive torch.logsumexp of the terms


def naive_log_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(a[:, :, :, None] + b[:, None, :, :], dim=2)


def _bmm_case(case: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 `a` [2, 3, 4], `b` [2, 4, 2] with the case's specials in batch 0 (batch 1 stays finite)."""
    a = torch.linspace(-2.0, 2.0, 24, dtype=F64).reshape(2, 3, 4)
    b = torch.linspace(1.5, -1.5, 16, dtype=F64).reshape(2, 4, 2)
    if case == "neginf_mix":
        a[0, 0, 1] = NEG_INF
        b[0, 2, 1] = NEG_INF
    elif case == "all_neginf":  # an all -inf row and column of out
        a[0, 1, :] = NEG_INF
        b[0, :, 0] = NEG_INF
    elif case == "nan_in_a":
        a[0, 1, 2] = NAN
    elif case == "nan_in_b":
        b[0, 3, 1] = NAN
    elif case == "posinf_in_a":
        a[0, 0, 1] = INF
    elif case == "posinf_in_b":
        b[0, 2, 0] = INF
    elif case == "posinf_plus_neginf":  # the term +inf + -inf is NaN: out (2, 0) NaN, (2, 1) +inf
        a[0, 2, 0] = INF
        b[0, 0, 0] = NEG_INF
    elif case == "posinf_and_nan":
        a[0, 0, 0] = INF
        a[0, 0, 3] = NAN
    elif case != "finite":
        raise ValueError(case)
    return a, b


BMM_CASES = ["finite", "neginf_mix", "all_neginf", "nan_in_a", "nan_in_b", "posinf_in_a", "posinf_in_b",
             "posinf_plus_neginf", "posinf_and_nan"]
BMM_DTYPES = [  # (a's dtype, b's dtype)
    pytest.param(F32, F32, id="fp32"), pytest.param(F64, F64, id="fp64"), pytest.param(F16, F16, id="fp16"),
    pytest.param(BF16, BF16, id="bf16"), pytest.param(F32, F64, id="fp32-fp64"), pytest.param(BF16, F32, id="bf16-fp32"),
]


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "k-chunks-of-1"])
@pytest.mark.parametrize("da,db", BMM_DTYPES)
@pytest.mark.parametrize("case", BMM_CASES)
def test_log_bmm_matches_naive_torch(monkeypatch, case, da, db, chunked):
    if chunked:
        monkeypatch.setattr(torch_paths, "_LOG_BMM_CHUNK_ELEMS", 1)
    a, b = _bmm_case(case)
    a, b = a.to(da), b.to(db)
    out_dtype = F64 if F64 in (da, db) else F32
    ao, bo = a.clone().requires_grad_(), b.clone().requires_grad_()
    at, bt = a.to(out_dtype).requires_grad_(), b.to(out_dtype).requires_grad_()
    out, ref = ringlse.log_bmm(ao, bo), naive_log_bmm(at, bt)
    assert out.dtype == out_dtype
    torch.testing.assert_close(out, ref, equal_nan=True)
    g = grad_weights(out.shape, out_dtype)
    ga, gb = torch.autograd.grad(out, (ao, bo), g)
    ra, rb = torch.autograd.grad(ref, (at, bt), g)
    assert ga.dtype == da and gb.dtype == db
    tol = {} if da == db and da in (F32, F64) else {"rtol": 1e-2, "atol": 1e-2}  # (grads rounded to 16 bits)
    assert_grad_where_torch_finite(ga, ra.to(da), **tol)
    assert_grad_where_torch_finite(gb, rb.to(db), **tol)
    if case == "all_neginf":  # torch's naive gradient is NaN there; ours 0
        assert not (ga.isnan().any() or gb.isnan().any())


@pytest.mark.parametrize(
    "da,db",
    [pytest.param(torch.int64, torch.int64, id="int64"), pytest.param(torch.int32, F32, id="int32-fp32"),
     pytest.param(F32, torch.bool, id="fp32-bool"), pytest.param(torch.bool, torch.bool, id="bool"),
     pytest.param(torch.complex64, torch.complex64, id="complex64")],
)
def test_log_bmm_rejects_non_floating(da, db):
    a, b = torch.zeros(1, 2, 3).to(da), torch.zeros(1, 3, 2).to(db)
    bad = "a" if da not in (F32,) else "b"
    with pytest.raises(TypeError, match=rf"^log_bmm: {bad} must be .* got {a.dtype if bad == 'a' else b.dtype}"):
        ringlse.log_bmm(a, b)


# ----------------------------------------------------------------------------------------------------
# the Triton kernels under the interpreter (CPU tensors, the launchers called directly, float32)

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="kernels on CPU tensors need TRITON_INTERPRET=1 (conftest sets it where there is no CUDA)",
)

# forward regimes, shrunk so that short rows take them (as tests/test_lse_toolkit.py's REGIMES), with the
# row length that takes them: `fwd_rows_kernel` ("rows"), the rows off 16-byte boundaries in 16-byte
# vectors (`fwd_rows_aligned_kernel`, "aligned"), two passes in one program per row ("fused"), rows
# split over programs with a stats kernel and a merge ("split")
_LONG = {"max_row_block": 16, "max_row_block_16": 16, "max_row_block_bwd": 16, "chunk": 32}
# the cooperative kernels with one piece per row, on 3 programs (as test_kernel_cooperative_one_piece_per_row:
# more pieces would wait on programs the interpreter has not run yet)
_COOP = {**_LONG, "coop_max_programs": 3, "coop_min_rows": 1, "coop_piece_fwd": 64}
KERNEL_REGIMES: dict[str, tuple[int, dict]] = {
    "rows": (3, {}),
    "aligned": (41, {"aligned_rows_min_cols": 1}),
    "fused": (40, {**_LONG, "split_rows": 1}),
    "split": (40, {**_LONG, "split_rows": 1 << 30}),
    # `fwd_coop_kernel` (40 columns) and, rows off 16-byte boundaries, `fwd_coop_aligned_kernel` (41);
    # logsumexp takes "split" there
    "coop": (40, _COOP),
    "coop_aligned": (41, _COOP),
}

# (fn, case) where the kernels' forward disagrees with torch, in every regime above (found under the
# interpreter, and the same on an H100; the jit kernels are not changed here), row [0, nan, 1] or
# [0, +inf, 1] for instance:
# - softmax: the row's finite entries come out 0 and its NaN / +inf entries NaN ([0, nan, 0]) where torch
#   gives NaN everywhere (rows of NaN only, or +inf only, are NaN everywhere, as torch, except below);
# - log_softmax: `x` itself ([0, nan, 1], [0, inf, 1]; +inf only: +inf): the row is taken for an empty
#   one, its lse for 0, where torch gives NaN everywhere (rows of NaN only are NaN, as torch);
# - logsumexp: NaN where torch gives +inf (rows with +inf and no NaN); NaN rows are NaN, as torch.
KERNEL_XFAIL: set[tuple[str, str]] = {
    *(("softmax", case) for case in SPECIAL - {"all_nan", "all_posinf"}),
    *(("log_softmax", case) for case in SPECIAL - {"all_nan"}),
    *(("logsumexp", case) for case in ("posinf", "posinf_twice", "posinf_neginf", "posinf_neginf_only", "all_posinf")),
}
# ... and the cooperative softmax kernels (`_fwd_coop_kernel`, `_fwd_coop_aligned_kernel`) also give 0
# everywhere (an empty row) for rows of NaN only or +inf only, where torch gives NaN
KERNEL_XFAIL_COOP: set[tuple[str, str]] = {("softmax", "all_nan"), ("softmax", "all_posinf")}


def kernel_xfail(fn: str, case: str, regime: str) -> bool:
    return (fn, case) in KERNEL_XFAIL or (regime.startswith("coop") and (fn, case) in KERNEL_XFAIL_COOP)


def kernel_params():
    for fn in FNS:
        for case in CASES:
            for regime in KERNEL_REGIMES:
                marks = [pytest.mark.xfail(strict=True, reason=f"{ISSUE}: Triton kernel differs from torch")] \
                    if kernel_xfail(fn, case, regime) else []
                yield pytest.param(fn, case, regime, id=f"{fn}-{case}-{regime}", marks=marks)


@interpreted
@pytest.mark.parametrize("fn,case,regime", list(kernel_params()))
def test_kernel_forward_matches_torch(fn, case, regime):
    from ringlse.lse.kernels import softmax as ks

    n, knobs = KERNEL_REGIMES[regime]
    x = make_rows(case, n, F32)
    with ks.config_override(**knobs):
        if fn == "logsumexp":
            y = ks.logsumexp_forward(x, -1)
        else:
            y = ks.softmax_forward(x, -1, log=fn == "log_softmax")
    torch.testing.assert_close(y, expected(fn, x, -1), equal_nan=True)


# (case) where the log_bmm kernel's forward disagrees with the naive torch answer: NaN where a +inf term
# (and no NaN one) gives torch +inf; NaN entries and +inf + -inf terms give NaN, as torch
KERNEL_BMM_XFAIL = {"posinf_in_a", "posinf_in_b", "posinf_plus_neginf"}


@interpreted
@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=[pytest.mark.xfail(strict=True, reason=f"{ISSUE}: Triton log_bmm kernel differs from torch")]
                  if c in KERNEL_BMM_XFAIL else []) for c in BMM_CASES],
)
def test_kernel_log_bmm_matches_naive_torch(case):
    from ringlse.lse.kernels import log_bmm as lbmm

    a, b = (t.to(F32) for t in _bmm_case(case))
    torch.testing.assert_close(lbmm.log_bmm_forward(a, b), naive_log_bmm(a, b), equal_nan=True)


# ----------------------------------------------------------------------------------------------------
# GPU: the public functions on CUDA (float32), the same cases, rows short to long (the kernels' regimes)

# row lengths that take the kernels' regimes (float32, 80 rows; seen on an H100): forward
# `_fwd_rows_kernel` (3 and 20000 columns), `_fwd_rows_aligned_kernel` (4097: rows off 16-byte
# boundaries), `_fwd_coop_kernel` (70000; logsumexp: `_fwd_stats_kernel`); backward `_bwd_rows_kernel`
# (3), `_bwd_coop_aligned_kernel` (4097), `_bwd_coop_kernel` (20000, 70000), `_lse_bwd_kernel`
GPU_NS = [3, 4097, 20000, 70000]
# (fn, case, n) where the public functions on CUDA disagree with torch, found on an H100 (the jit kernels
# are not changed here): forward, as under the interpreter (KERNEL_XFAIL; the 70000-column rows take the
# cooperative kernels: KERNEL_XFAIL_COOP); backward, logsumexp of rows with +inf and no NaN: NaN
# everywhere (from the forward's NaN lse) where torch's gradient is 0 at the finite entries
GPU_XFAIL: set[tuple[str, str, int]] = {
    *((fn, case, n) for fn, case in KERNEL_XFAIL for n in GPU_NS),
    *((fn, case, 70000) for fn, case in KERNEL_XFAIL_COOP),
}
GPU_BWD_XFAIL: set[tuple[str, str, int]] = {
    ("logsumexp", case, n) for case in ("posinf", "posinf_twice", "posinf_neginf", "posinf_neginf_only")
    for n in GPU_NS
}
# log_bmm on CUDA: the forward gives NaN where a +inf term (and no NaN one) gives torch +inf (as under the
# interpreter), and so its gradients are NaN where torch's are finite (0)
GPU_BMM_XFAIL: set[tuple[str, str]] = {
    (case, part) for case in ("posinf_in_a", "posinf_in_b", "posinf_plus_neginf") for part in ("forward", "backward")
}
GPU_TOL = {"rtol": 1e-5, "atol": 1e-6}
# (the backward's row sums of up to 70000 float32 terms, here and in torch, differ by a few 1e-6)
GPU_BWD_TOL = {"rtol": 1e-5, "atol": 5e-5}


def gpu_params(xfail: set[tuple[str, str, int]]):
    for fn in FNS:
        for case in CASES:
            for n in GPU_NS:
                marks = [pytest.mark.xfail(strict=True, reason=f"{ISSUE}: Triton kernel differs from torch on CUDA")] \
                    if (fn, case, n) in xfail else []
                yield pytest.param(fn, case, n, id=f"{fn}-{case}-n{n}", marks=marks)


def gpu_rows(case: str, n: int) -> torch.Tensor:
    """`[80, n]` float32 on the CPU: `make_rows` 40 times over (so the long rows take the cooperative
    kernels, which want many rows)."""
    return make_rows(case, n, F32).repeat(40, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("fn,case,n", list(gpu_params(GPU_XFAIL)))
def test_gpu_forward_matches_torch(fn, case, n):
    x = gpu_rows(case, n)
    y = OURS[fn](x.cuda(), -1)
    torch.testing.assert_close(y.cpu(), expected(fn, x, -1), equal_nan=True, **GPU_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("fn,case,n", list(gpu_params(GPU_BWD_XFAIL)))
def test_gpu_backward_matches_torch_where_finite(fn, case, n):
    x_cpu = gpu_rows(case, n)
    x, xt = x_cpu.cuda().requires_grad_(), x_cpu.clone().requires_grad_()
    y, yt = OURS[fn](x, -1), TORCH[fn](xt, -1)
    g = grad_weights(yt.shape, F32)
    (dx,) = torch.autograd.grad(y, x, g.cuda())
    (dxt,) = torch.autograd.grad(yt, xt, g)
    assert_grad_where_torch_finite(dx.cpu(), dxt, **GPU_BWD_TOL)
    if case == "all_neginf":  # torch: NaN; ours: 0 (softmax, logsumexp) or g (log_softmax), no NaN
        dx0 = dx[0].cpu()
        torch.testing.assert_close(dx0, g[0] if fn == "log_softmax" else torch.zeros_like(dx0), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case,part",
    [pytest.param(c, part, id=f"{c}-{part}",
                  marks=[pytest.mark.xfail(strict=True, reason=f"{ISSUE}: Triton log_bmm kernel differs from torch on CUDA")]
                  if (c, part) in GPU_BMM_XFAIL else [])
     for c in BMM_CASES for part in ("forward", "backward")],
)
def test_gpu_log_bmm_matches_naive_torch(case, part):
    """forward: out against the naive torch answer; backward: the gradients where torch's are finite."""
    a_cpu, b_cpu = (t.to(F32) for t in _bmm_case(case))
    a, b = a_cpu.to("cuda").requires_grad_(), b_cpu.to("cuda").requires_grad_()
    at, bt = a_cpu.clone().requires_grad_(), b_cpu.clone().requires_grad_()
    out, ref = ringlse.log_bmm(a, b), naive_log_bmm(at, bt)
    if part == "forward":
        torch.testing.assert_close(out.cpu(), ref, equal_nan=True)
        return
    g = grad_weights(out.shape, F32)
    ga, gb = torch.autograd.grad(out, (a, b), g.to("cuda"))
    ra, rb = torch.autograd.grad(ref, (at, bt), g)
    assert_grad_where_torch_finite(ga.cpu(), ra)
    assert_grad_where_torch_finite(gb.cpu(), rb)
