"""Backends: the registry, the `sdpa` block op (PyTorch's fused kernels) and the `flash` block op.

Numbers are judged by CONVENTIONS.md §7 (`ringlse.testing.judge`) against the float64 `reference_attention`,
for out, lse, dq, dk, dv; half-precision results against the naive in-dtype baseline.

On CPU: the registry; the sdpa op through its CPU kernels (`flash_cpu`: PyTorch's CPU flash
attention, and `math`), driven through autograd like `block_attention` does (`api._BlockAttention`,
because the registry offers `sdpa` on CUDA only); the flash op against a stand-in `flash_attn` module
(PyTorch math behind the 2.7 and the 2.0 internal signatures) so its argument and version handling
runs without the package. On GPU: `block_attention(..., backend="sdpa")` with each PyTorch kernel
(cuDNN, flash, efficient), and `backend="flash"` when flash-attn is installed.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

import ringlse
from ringlse.blocks import flash as block_flash, sdpa as block_sdpa
from ringlse.blocks import available_backends, get_block_op
from ringlse.blocks.torch_math import torch_block_backward, torch_block_forward
from ringlse.merge_states import merge_attn_states
from ringlse.reference import reference_attention
from ringlse.testing import assert_judged, naive_attention

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


# ------------------------------------------------------------------------------------------------
# registry (cheapest first)


def test_auto_is_torch_on_cpu():
    assert get_block_op("auto", "cpu").name == "torch"
    assert "torch" in available_backends("cpu")


def test_unknown_backend_lists_available():
    with pytest.raises(ValueError, match=r"unknown backend 'nope'.*available here: \[.*'torch'.*\]"):
        get_block_op("nope", "cpu")


@pytest.mark.parametrize("name", ["sdpa", "flash"])
def test_cuda_only_backend_unavailable_on_cpu(name):
    with pytest.raises(ValueError, match=rf"'{name}' is not available on cpu.*available here: \[.*'torch'.*\]"):
        get_block_op(name, "cpu")
    with pytest.raises(ValueError, match="available here"):
        ringlse.block_attention(*(torch.randn(1, 4, 2, 8),) * 3, backend=name)


def test_sdpa_and_flash_ops_are_registered_under_their_names():
    assert block_sdpa.SDPA_BLOCK_OP.name == "sdpa"
    assert block_flash.FLASH_BLOCK_OP.name == "flash"


# ------------------------------------------------------------------------------------------------
# helpers


def _qkv(b, sq, sk, h, hkv, d, dtype, device, gen):
    def draw(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype).requires_grad_()

    return draw(b, sq, h, d), draw(b, sk, hkv, d), draw(b, sk, hkv, d)


def _loss(out, lse, dout, dlse):
    # lse enters the loss only where finite; empty rows have lse -inf and must get zero gradients
    finite = torch.isfinite(lse)
    lse_term = torch.where(finite, lse, torch.zeros_like(lse)) * dlse if dlse is not None else 0
    return (out.to(dout.dtype) * dout).sum() + (lse_term.sum() if dlse is not None else 0)


def _check_against_reference(run, b, sq, sk, h, hkv, d, dtype, device, *, causal, q_start, k_start, lse_grad, seed):
    """Run `run(q, k, v) -> (out, lse)` with autograd and judge out, lse, dq, dk, dv by CONVENTIONS.md §7."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(b, sq, sk, h, hkv, d, dtype, device, gen)
    out, lse = run(q, k, v)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (b, h, sq) and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert not torch.isposinf(lse).any() and not torch.isnan(out).any()
    dout = torch.randn(out.shape, generator=gen).to(device=device, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=gen).to(device=device, dtype=torch.float64) if lse_grad else None
    grads = torch.autograd.grad(_loss(out.double(), lse.double(), dout, dlse), (q, k, v))

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference_attention(q64, k64, v64, causal=causal, q_start=q_start, k_start=k_start)
    ref_grads = torch.autograd.grad(_loss(ref_out, ref_lse, dout, dlse), (q64, k64, v64))
    base = [None] * 5
    if dtype in (torch.float16, torch.bfloat16):
        qb, kb, vb = (x.detach().clone().requires_grad_() for x in (q, k, v))
        b_out, b_lse = naive_attention(qb, kb, vb, causal=causal, q_start=q_start, k_start=k_start)
        b_grads = torch.autograd.grad(
            _loss(b_out, b_lse, dout.to(dtype), dlse.to(dtype) if lse_grad else None), (qb, kb, vb)
        )
        base = [b_out, b_lse, *b_grads]
    assert_judged("out", out, ref_out, base[0], dtype)
    assert_judged("lse", lse, ref_lse, base[1], dtype, is_lse=True)
    for name, got, ref, bl in zip(("dq", "dk", "dv"), grads, ref_grads, base[2:]):
        assert_judged(name, got, ref, bl, dtype)
    # rows that see no key anywhere: out 0 and exactly zero gradient (CONVENTIONS.md §2)
    empty_rows = torch.isneginf(ref_lse).all(1)  # [b, sq]
    if empty_rows.any():
        assert (grads[0][empty_rows] == 0).all()
        assert (out[empty_rows] == 0).all()


def _via_block_op(op):
    def run_factory(causal, q_start, k_start):
        def run(q, k, v):
            return ringlse.block_attention(q, k, v, causal=causal, q_start=q_start, k_start=k_start, backend=op)

        return run

    return run_factory


# (b, sq, sk, h, hkv, d, causal, q_start, k_start)
CASES = [
    pytest.param((2, 97, 97, 4, 4, 80, True, 0, 0), id="diag-b2-s97-d80"),
    pytest.param((1, 97, 65, 4, 2, 80, True, 40, 30), id="offset-3pieces-gqa"),
    pytest.param((1, 33, 50, 3, 1, 16, True, 0, 20), id="masked-rows-mqa"),
    pytest.param((2, 33, 50, 4, 2, 64, False, 0, 0), id="full-gqa"),
    pytest.param((1, 40, 97, 2, 2, 32, True, 57, 0), id="bottom-right"),
]


# ------------------------------------------------------------------------------------------------
# sdpa on CPU (flash_cpu and math kernels)


@pytest.mark.parametrize("kernels", [("flash_cpu",), ("math",)], ids=["flash_cpu", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", CASES)
def test_sdpa_cpu_kernels(case, dtype, kernels):
    b, sq, sk, h, hkv, d, causal, q_start, k_start = case
    run = _via_block_op(block_sdpa.SDPA_BLOCK_OP)(causal, q_start, k_start)
    with block_sdpa.use_kernels(*kernels):
        _check_against_reference(
            run, b, sq, sk, h, hkv, d, dtype, "cpu", causal=causal, q_start=q_start, k_start=k_start,
            lse_grad=True, seed=hash(case) % 1000,
        )
        assert block_sdpa.last_kernels() == {"forward": kernels[0], "backward": kernels[0]}


def test_sdpa_cpu_fp16_and_no_lse_grad():
    run = _via_block_op(block_sdpa.SDPA_BLOCK_OP)(True, 40, 30)
    _check_against_reference(
        run, 1, 97, 65, 4, 2, 80, torch.float16, "cpu", causal=True, q_start=40, k_start=30, lse_grad=False, seed=7
    )


def _accumulator_check(op, dtype, device, seed):
    """forward with out_acc/lse_acc views into larger buffers: the block is merged into the state."""
    b, sq, sk, h, hkv, d = 2, 97, 65, 4, 2, 80
    q_start, k_start = 40, 30
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (x.detach() for x in _qkv(b, sq, sk, h, hkv, d, dtype, device, gen))
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    buf = torch.full((b, 2 * sq, h, d), float("nan"), dtype=acc, device=device)
    lbuf = torch.full((b, h, 2 * sq), float("nan"), dtype=acc, device=device)
    out_acc, lse_acc = buf[:, sq:], lbuf[:, :, sq:]
    out_acc.copy_(torch.randn(out_acc.shape, generator=gen))
    lse_acc.copy_(torch.randn(lse_acc.shape, generator=gen) * 2)
    lse_acc[0, 1, :5] = float("-inf")  # rows whose running state is still empty
    out_acc[0, :5, 1] = 0
    state0 = (out_acc.clone(), lse_acc.clone())
    res = op.forward(
        q, k, v, softmax_scale=d**-0.5, causal=True, q_start=q_start, k_start=k_start, out_acc=out_acc, lse_acc=lse_acc
    )
    assert res[0] is out_acc and res[1] is lse_acc
    assert torch.isnan(buf[:, :sq]).all() and torch.isnan(lbuf[:, :, :sq]).all(), "wrote outside the views"
    ref_blk = reference_attention(q, k, v, causal=True, q_start=q_start, k_start=k_start)
    ref_out, ref_lse = merge_attn_states([state0[0].double(), ref_blk[0]], [state0[1].double(), ref_blk[1].double()])
    base = [None, None]
    if dtype in (torch.float16, torch.bfloat16):
        nb = naive_attention(q, k, v, causal=True, q_start=q_start, k_start=k_start)
        # the baseline state: the naive in-dtype block merged into the same initial state
        base = list(merge_attn_states([state0[0].double(), nb[0].double()], [state0[1].double(), nb[1].double()]))
    assert_judged("out", out_acc, ref_out, base[0], dtype)
    assert_judged("lse", lse_acc, ref_lse, base[1], dtype, is_lse=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_sdpa_cpu_accumulators(dtype):
    _accumulator_check(block_sdpa.SDPA_BLOCK_OP, dtype, "cpu", seed=11)


def test_sdpa_cpu_backward_adds_into_strided_accumulators():
    """backward adds into dq/dk/dv accumulators (views into larger buffers) and leaves the rest alone."""
    b, sq, sk, h, hkv, d = 1, 97, 65, 4, 2, 80
    gen = torch.Generator().manual_seed(12)
    q, k, v = (x.detach() for x in _qkv(b, sq, sk, h, hkv, d, torch.float32, "cpu", gen))
    out, lse = torch_block_forward(q, k, v, softmax_scale=d**-0.5, causal=True, q_start=40, k_start=30)
    dout = torch.randn(out.shape, generator=gen)
    delta = (dout * out).sum(-1).transpose(1, 2)
    bufs = [torch.randn(b, 2 * s, hh, d, generator=gen) for s, hh in ((sq, h), (sk, hkv), (sk, hkv))]
    before = [x.clone() for x in bufs]
    views = [bufs[0][:, sq:], bufs[1][:, :sk], bufs[2][:, sk:]]
    kw = dict(softmax_scale=d**-0.5, causal=True, q_start=40, k_start=30)
    block_sdpa.SDPA_BLOCK_OP.backward(dout, q, k, v, out, lse, delta, **kw, dq_acc=views[0], dk_acc=views[1], dv_acc=views[2])
    want = [torch.zeros_like(x) for x in views]
    torch_block_backward(dout, q, k, v, out, lse, delta, **kw, dq_acc=want[0], dk_acc=want[1], dv_acc=want[2])
    untouched = [(bufs[0][:, :sq], before[0][:, :sq]), (bufs[1][:, sk:], before[1][:, sk:]), (bufs[2][:, :sk], before[2][:, :sk])]
    for got, ref in untouched:
        assert torch.equal(got, ref)
    starts = [before[0][:, sq:], before[1][:, :sk], before[2][:, sk:]]
    for name, view, start, w in zip(("dq", "dk", "dv"), views, starts, want):
        assert_judged(name, view - start, w.double(), None, torch.float32)


def test_sdpa_kernel_fallback_and_errors():
    with pytest.raises(ValueError, match="unknown sdpa kernels"):
        with block_sdpa.use_kernels("nope"):
            pass
    q = torch.randn(1, 8, 2, 16)
    # CUDA-only kernels are skipped by dtype or raise on CPU tensors: the next one takes over
    with pytest.warns(RuntimeWarning, match="rejected"):
        with block_sdpa.use_kernels("efficient", "math"):
            out, lse = block_sdpa.SDPA_BLOCK_OP.forward(q, q, q, softmax_scale=0.25, causal=False, q_start=0, k_start=0)
    assert block_sdpa.last_kernels()["forward"] == "math"
    ref = reference_attention(q, q, q)
    assert_judged("out", out, ref[0], None, torch.float32)
    with pytest.raises(RuntimeError, match="no kernel"):
        with block_sdpa.use_kernels("cudnn"):
            block_sdpa.SDPA_BLOCK_OP.forward(q, q, q, softmax_scale=0.25, causal=False, q_start=0, k_start=0)


# ------------------------------------------------------------------------------------------------
# flash on CPU against a stand-in flash_attn (PyTorch math behind flash-attn's internal signatures)


def _fake_flash_attn(version: str) -> types.ModuleType:
    """A `flash_attn` package whose internals compute with PyTorch math, with the calling
    conventions of flash-attn `version`: causal bottom-right from 2.1 on (top-left before), lse `+inf`
    on empty rows, native GQA, gradients written into the given dq/dk/dv, delta computed inside."""
    new_api = tuple(map(int, version.split("."))) >= (2, 7)
    bottom_right = tuple(map(int, version.split("."))) >= (2, 1)
    calls = {"forward": 0, "backward": 0}

    def q_start_for(q, k, causal):
        return k.shape[1] - q.shape[1] if (causal and bottom_right) else 0

    def fwd(q, k, v, dropout_p, softmax_scale, causal):
        assert q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and dropout_p == 0.0
        calls["forward"] += 1
        out, lse = torch_block_forward(
            q, k, v, softmax_scale=softmax_scale, causal=causal, q_start=q_start_for(q, k, causal), k_start=0
        )
        return out, torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)

    def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal):
        calls["backward"] += 1
        acc = [torch.zeros(x.shape, dtype=torch.float32) for x in (q, k, v)]
        delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)
        torch_block_backward(
            dout, q, k, v, out, softmax_lse, delta, softmax_scale=softmax_scale, causal=causal,
            q_start=q_start_for(q, k, causal), k_start=0, dq_acc=acc[0], dk_acc=acc[1], dv_acc=acc[2],
        )
        for dst, src in zip((dq, dk, dv), acc):
            dst.copy_(src)

    iface = types.ModuleType("flash_attn.flash_attn_interface")
    if new_api:

        def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                                softcap, alibi_slopes, return_softmax):
            assert (window_size_left, window_size_right, softcap, alibi_slopes) == (-1, -1, 0.0, None)
            out, lse = fwd(q, k, v, dropout_p, softmax_scale, causal)
            return out, lse, torch.empty(0), torch.empty(2, dtype=torch.int64)

        def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                                 window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                                 rng_state=None):
            bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)
            return torch.empty(0)
    else:

        def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, return_softmax):
            out, lse = fwd(q, k, v, dropout_p, softmax_scale, causal)
            return out, q, k, v, out, lse, torch.empty(0), torch.empty(2, dtype=torch.int64)

        def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                                 rng_state=None):
            bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)

    iface._flash_attn_forward = _flash_attn_forward
    iface._flash_attn_backward = _flash_attn_backward
    pkg = types.ModuleType("flash_attn")
    pkg.__version__ = version
    pkg.flash_attn_interface = iface
    pkg.calls = calls
    return pkg


@pytest.fixture(params=["2.7.4", "2.0.9"], ids=["fa-2.7-api", "fa-2.0-api"])
def fake_flash_attn(request, monkeypatch):
    pkg = _fake_flash_attn(request.param)
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", pkg.flash_attn_interface)
    block_flash._interface.cache_clear()
    yield pkg
    block_flash._interface.cache_clear()


@pytest.mark.parametrize(
    "case",
    [
        pytest.param((1, 97, 65, 4, 2, 80, True, 40, 30), id="offset-3pieces-gqa"),
        pytest.param((1, 33, 50, 3, 1, 16, True, 0, 20), id="masked-rows-mqa"),
        pytest.param((1, 40, 97, 2, 2, 36, True, 57, 0), id="bottom-right-d36"),
        pytest.param((2, 33, 50, 4, 2, 64, False, 0, 0), id="full-gqa"),
    ],
)
def test_flash_with_stand_in_package(case, fake_flash_attn):
    b, sq, sk, h, hkv, d, causal, q_start, k_start = case
    run = _via_block_op(block_flash.FLASH_BLOCK_OP)(causal, q_start, k_start)
    _check_against_reference(
        run, b, sq, sk, h, hkv, d, torch.float16, "cpu", causal=causal, q_start=q_start, k_start=k_start,
        lse_grad=True, seed=hash(case) % 1000,
    )
    if causal and q_start - k_start == sk - sq:
        # bottom-right: one call with >= 2.1 (plus the lse-gradient term's extra calls), pieces before
        single = fake_flash_attn.__version__ >= "2.1"
        assert (fake_flash_attn.calls["forward"] == 2) == single  # block forward + the V=K pass


def test_flash_accumulators_and_dtype_check(fake_flash_attn):
    _accumulator_check(block_flash.FLASH_BLOCK_OP, torch.float16, "cpu", seed=13)
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="fp16/bf16 only"):
        block_flash.FLASH_BLOCK_OP.forward(q, q, q, softmax_scale=0.25, causal=False, q_start=0, k_start=0)


def test_flash_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn -> ImportError
    block_flash._interface.cache_clear()
    try:
        q = torch.randn(1, 8, 2, 16, dtype=torch.float16)
        with pytest.raises(RuntimeError, match="needs the flash-attn package"):
            block_flash.FLASH_BLOCK_OP.forward(q, q, q, softmax_scale=0.25, causal=False, q_start=0, k_start=0)
    finally:
        block_flash._interface.cache_clear()


# ------------------------------------------------------------------------------------------------
# GPU: block_attention(..., backend="sdpa") with each PyTorch kernel, and backend="flash"


def _via_backend(backend):
    def run_factory(causal, q_start, k_start):
        def run(q, k, v):
            return ringlse.block_attention(q, k, v, causal=causal, q_start=q_start, k_start=k_start, backend=backend)

        return run

    return run_factory


GPU_CASES = [
    pytest.param((2, 1025, 1025, 8, 8, 128, True, 0, 0), id="diag-s1025-d128"),
    pytest.param((1, 1025, 640, 8, 2, 128, True, 700, 300), id="offset-3pieces-gqa"),
    pytest.param((2, 97, 200, 4, 1, 80, True, 100, 150), id="masked-rows-mqa-d80"),
    pytest.param((1, 640, 1025, 8, 2, 64, False, 0, 0), id="full-gqa-d64"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_CASES)
def test_sdpa_gpu_default_kernels(case, dtype):
    b, sq, sk, h, hkv, d, causal, q_start, k_start = case
    _check_against_reference(
        _via_backend("sdpa")(causal, q_start, k_start), b, sq, sk, h, hkv, d, dtype, "cuda",
        causal=causal, q_start=q_start, k_start=k_start, lse_grad=True, seed=hash(case) % 1000,
    )
    used = block_sdpa.last_kernels()
    assert used["forward"] in ("cudnn", "flash") and used["backward"] in ("cudnn", "flash"), used


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kernel,dtype",
    [("cudnn", torch.bfloat16), ("flash", torch.bfloat16), ("flash", torch.float16), ("efficient", torch.bfloat16),
     ("efficient", torch.float32)],
    ids=["cudnn-bf16", "flash-bf16", "flash-fp16", "efficient-bf16", "efficient-fp32"],
)
@pytest.mark.parametrize("case", [GPU_CASES[1], GPU_CASES[2]])
def test_sdpa_gpu_each_kernel(case, kernel, dtype):
    b, sq, sk, h, hkv, d, causal, q_start, k_start = case
    with block_sdpa.use_kernels(kernel):
        _check_against_reference(
            _via_backend("sdpa")(causal, q_start, k_start), b, sq, sk, h, hkv, d, dtype, "cuda",
            causal=causal, q_start=q_start, k_start=k_start, lse_grad=True, seed=hash(case) % 1000,
        )
        assert block_sdpa.last_kernels() == {"forward": kernel, "backward": kernel}


@pytest.mark.gpu
def test_sdpa_gpu_no_lse_grad_takes_no_extra_pass():
    case = GPU_CASES[1].values[0]
    b, sq, sk, h, hkv, d, causal, q_start, k_start = case
    _check_against_reference(
        _via_backend("sdpa")(causal, q_start, k_start), b, sq, sk, h, hkv, d, torch.bfloat16, "cuda",
        causal=causal, q_start=q_start, k_start=k_start, lse_grad=False, seed=5,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_sdpa_gpu_accumulators(dtype):
    _accumulator_check(block_sdpa.SDPA_BLOCK_OP, dtype, "cuda", seed=21)


# `flash` is FA4 where it is installed, which takes head dim 88 but not 80 (ringlse.blocks.fa4.VERIFIED_HEAD_DIMS)
FLASH_GPU_CASES = [GPU_CASES[0], GPU_CASES[1],
                   pytest.param((2, 97, 200, 4, 1, 88, True, 100, 150), id="masked-rows-mqa-d88"), GPU_CASES[3]]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLASH_ATTN, reason="flash-attn is not installed")
@pytest.mark.parametrize("case", FLASH_GPU_CASES)
def test_flash_gpu(case):
    b, sq, sk, h, hkv, d, causal, q_start, k_start = case
    _check_against_reference(
        _via_backend("flash")(causal, q_start, k_start), b, sq, sk, h, hkv, d, torch.bfloat16, "cuda",
        causal=causal, q_start=q_start, k_start=k_start, lse_grad=True, seed=hash(case) % 1000,
    )


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("flash_attn.flash_attn_interface") is None if HAS_FLASH_ATTN else True,
                    reason="flash-attn 2 is not installed (the op under test speaks its interface)")
def test_flash_gpu_accumulators():
    _accumulator_check(block_flash.FLASH_BLOCK_OP, torch.bfloat16, "cuda", seed=22)


@pytest.mark.parametrize(
    ("capability", "dtype", "masked", "expected"),
    [
        pytest.param((9, 0), torch.bfloat16, False, ("fa4", "sdpa", "triton", "torch"), id="sm90-bf16-measured"),
        pytest.param((9, 0), torch.float16, False, ("fa4", "sdpa", "triton", "torch"), id="sm90-fp16-measured"),
        pytest.param((9, 0), torch.float32, False, ("triton", "sdpa", "torch"), id="sm90-fp32-unmeasured"),
        pytest.param((8, 0), torch.bfloat16, False, ("triton", "sdpa", "torch"), id="sm80-unmeasured"),
        pytest.param((10, 0), torch.bfloat16, False, ("triton", "sdpa", "torch"), id="sm100-unmeasured"),
        pytest.param((9, 0), torch.bfloat16, True, ("triton", "torch"), id="sm90-masked-intervals"),
        pytest.param(None, torch.bfloat16, False, ("torch",), id="cpu"),
    ],
)
def test_auto_candidates_follow_the_measured_order(capability, dtype, masked, expected):
    assert ringlse.blocks.auto_candidates(capability, dtype, masked) == expected


@pytest.mark.parametrize(
    ("capability", "dtype", "masked", "expected"),
    [
        pytest.param((9, 0), torch.bfloat16, False, ("triton", "fa4", "torch"), id="sm90-bf16-measured"),
        pytest.param((9, 0), torch.float16, False, ("fa4", "sdpa", "triton", "torch"), id="sm90-fp16-unmeasured"),
        pytest.param((8, 0), torch.bfloat16, False, ("triton", "sdpa", "torch"), id="sm80-unmeasured"),
        pytest.param((9, 0), torch.bfloat16, True, ("triton", "torch"), id="sm90-masked-intervals"),
    ],
)
def test_auto_candidates_with_a_softcap(capability, dtype, masked, expected):
    """With a softcap (and one head dim) `auto` follows the capped kernels' measured order."""
    assert ringlse.blocks.auto_candidates(capability, dtype, masked, softcap=True) == expected


@pytest.mark.parametrize("head_dim", [36, 40, 80, 264], ids=lambda d: f"d{d}")
def test_fa4_head_dims_are_refused_by_name(head_dim):
    reason = ringlse.blocks.backend_unavailable_reason("fa4", "cuda", torch.bfloat16, head_dim=head_dim)
    assert reason is not None and f"got {head_dim}" in reason and "wrong dq" in reason


def test_sdpa_kernel_choice_is_not_sticky(monkeypatch):
    """A kernel that raised once is asked again on the next call: the choice depends on the call's
    inputs alone, so no rank of a ring switches kernels for good after one error."""
    calls = {"n": 0}

    def flaky_forward(q, k, v, causal, scale):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("transient")
        return block_sdpa._math_forward(q, k, v, causal, scale)

    flaky = block_sdpa.Kernel("flaky", flaky_forward, block_sdpa._math_backward, (torch.float32,))
    monkeypatch.setitem(block_sdpa.KERNELS, "flaky", flaky)
    q = torch.randn(1, 8, 2, 16)
    kw = dict(softmax_scale=0.25, causal=False, q_start=0, k_start=0)
    with block_sdpa.use_kernels("flaky", "math"):
        with pytest.warns(RuntimeWarning, match="flaky kernel rejected"):
            block_sdpa.SDPA_BLOCK_OP.forward(q, q, q, **kw)
        assert block_sdpa.last_kernels()["forward"] == "math"
        out, _ = block_sdpa.SDPA_BLOCK_OP.forward(q, q, q, **kw)
        assert block_sdpa.last_kernels()["forward"] == "flaky" and calls["n"] == 2
    assert_judged("out", out, reference_attention(q, q, q)[0], None, torch.float32)
