"""Triton block-attention kernels against the float64 reference, judged by CONVENTIONS.md §7.

CPU tests run the kernels under Triton's interpreter (conftest sets TRITON_INTERPRET=1 without CUDA),
in float16/float32 only (the interpreter gets bfloat16 dots wrong). GPU tests add bfloat16, every
supported head dim, larger shapes and NaN-poisoned buffers.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import ringlse  # noqa: E402
from ringlse.blocks.contract import Masks  # noqa: E402
from ringlse import reference_attention, update_out_and_lse  # noqa: E402
from ringlse.testing import assert_judged, naive_attention  # noqa: E402

fwd_mod = pytest.importorskip("ringlse.kernels.attention_fwd")
bwd_mod = pytest.importorskip("ringlse.kernels.attention_bwd")
from ringlse.kernels.attention_bwd import attention_backward, attention_delta  # noqa: E402
from ringlse.kernels.attention_common import mask_offset  # noqa: E402
from ringlse.kernels.attention_fwd import attention_forward  # noqa: E402
from ringlse.masks import BlockKind, block_kind  # noqa: E402

# the interpreter (CPU) emits a NumPy deprecation warning per scalar conversion
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _draw(b, sq, sk, h, hkv, d, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(b, sk, hkv, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(b, sk, hkv, d, generator=g).to(device=device, dtype=dtype)
    return q, k, v


def _check_forward(q, k, v, causal, q_start, k_start, scale=None):
    dtype = q.dtype
    d = q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    b, sq, h, _ = q.shape
    # poison the outputs so that any element the kernel fails to write shows up as NaN
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, sq), float("nan"), dtype=torch.float32, device=q.device)
    # classify the block as the kernels' callers do (the kernels run EMPTY blocks too, see
    # test_contract_*; here they take the raw launcher's poisoned buffers only when not EMPTY)
    kind = block_kind(sq, k.shape[1], q_start, k_start, causal)
    if kind is BlockKind.EMPTY:
        out, lse = attention_forward(q, k, v, softmax_scale=scale, causal=causal, q_start=q_start, k_start=k_start)
    else:
        # the raw launcher takes scale >= 0; attention_forward runs a negative scale on -q
        qq, s = (-q, -scale) if scale < 0 else (q, scale)
        partial = kind is BlockKind.PARTIAL
        fwd_mod._forward_impl(qq, k, v, out, lse, softmax_scale=s, causal=partial,
                              offset=mask_offset(partial, sq, k.shape[1], q_start, k_start), accum=False)
    ref_o, ref_l = reference_attention(q.double(), k.double(), v.double(), causal=causal, softmax_scale=scale,
                                       q_start=q_start, k_start=k_start)
    base_o, base_l = naive_attention(q, k, v, causal=causal, softmax_scale=scale, q_start=q_start, k_start=k_start)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert not torch.isposinf(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_l)), "rows that see no key must have lse -inf"
    assert (out[torch.isneginf(lse).transpose(1, 2)] == 0).all(), "rows that see no key must have out 0"
    assert_judged("out", out, ref_o, base_o, dtype)
    assert_judged("lse", lse, ref_l, base_l, dtype, is_lse=True)
    # the public launcher agrees with the poisoned-buffer run
    o2, l2 = attention_forward(q, k, v, softmax_scale=scale, causal=causal, q_start=q_start, k_start=k_start)
    torch.testing.assert_close(o2, out, rtol=0, atol=0)
    torch.testing.assert_close(l2, lse, rtol=0, atol=0)


def _grads(fn, q, k, v, go, gl, acc_dtype):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, l = fn(q, k, v)
    loss = (o.to(acc_dtype) * go.to(acc_dtype)).sum()
    loss = loss + (torch.where(torch.isfinite(l), l, torch.zeros_like(l)).to(acc_dtype) * gl.to(acc_dtype)).sum()
    loss.backward()
    return o, l, q.grad, k.grad, v.grad


def _check_autograd(q, k, v, causal, q_start, k_start, scale=None):
    """Gradients through ringlse.block_attention(backend='triton'), with gradients on out AND lse."""
    dtype = q.dtype
    g = torch.Generator(device="cpu").manual_seed(1)
    go = torch.randn(q.shape, generator=g).to(device=q.device, dtype=dtype)
    gl = torch.randn(q.shape[0], q.shape[2], q.shape[1], generator=g).to(device=q.device)
    kw = dict(causal=causal, softmax_scale=scale, q_start=q_start, k_start=k_start)
    ours = _grads(lambda a, b_, c: ringlse.block_attention(a, b_, c, backend="triton", **kw), q, k, v, go, gl, torch.float32)
    ref = _grads(lambda a, b_, c: reference_attention(a, b_, c, **kw), q.double(), k.double(), v.double(), go, gl,
                 torch.float64)
    if dtype == torch.float32:
        base = [None] * 5
    else:
        base = _grads(lambda a, b_, c: naive_attention(a, b_, c, **kw), q, k, v, go, gl, dtype)
    for name, o, r, bl in zip(("out", "lse", "dq", "dk", "dv"), ours, ref, base):
        assert not torch.isnan(o).any(), f"{name} has NaN"
        assert_judged(name, o, r, bl, dtype, is_lse=name == "lse")


# ---------------------------------------------------------------------------------------------------
# CPU (interpreter) and GPU: small shapes, fp16/fp32

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim)
SMALL = [
    pytest.param((1, 97, 97, 2, 2, 64), id="1x97x2x64"),
    pytest.param((2, 33, 33, 6, 2, 80), id="2x33x6of2x80-gqa"),
    pytest.param((1, 40, 75, 4, 1, 32), id="1x40x75x4of1x32-mqa"),
]
# (q_start, k_start) for causal blocks
OFFSETS = [
    pytest.param((0, 0), id="diagonal"),
    pytest.param((0, 23), id="top-rows-masked"),
    pytest.param((-7, 5), id="negative"),
    pytest.param((100, 0), id="all-visible"),
    pytest.param((0, 500), id="fully-masked"),
]


def test_float64_raises(device):
    q, k, v = _draw(1, 8, 8, 2, 2, 32, torch.float64, device)
    with pytest.raises(ValueError, match="float64"):
        attention_forward(q, k, v, softmax_scale=0.2, causal=False, q_start=0, k_start=0)
    acc = torch.zeros(q.shape, dtype=torch.float32, device=device)
    lse = torch.zeros(1, 2, 8, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="float64"):
        attention_backward(q, q, k, v, q, lse, lse, softmax_scale=0.2, causal=False, q_start=0, k_start=0,
                           dq_acc=acc, dk_acc=acc, dv_acc=acc)


def test_block_op_registered():
    op = ringlse.get_block_op("triton", "cuda" if torch.cuda.is_available() else "cpu")
    assert op.name == "triton"
    assert op.delta is attention_delta and op.caps.masks is Masks.INTERVALS  # forward/backward: the adapter over the kernels


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("shape", SMALL)
def test_forward_noncausal(shape, dtype, device):
    b, sq, sk, h, hkv, d = shape
    _check_forward(*_draw(b, sq, sk, h, hkv, d, dtype, device), causal=False, q_start=0, k_start=0)


@pytest.mark.parametrize("offsets", OFFSETS)
def test_forward_causal_offsets(offsets, device):
    q, k, v = _draw(2, 70, 90, 4, 2, 64, torch.float16, device, seed=3)
    _check_forward(q, k, v, causal=True, q_start=offsets[0], k_start=offsets[1])


def test_forward_negative_scale(device):
    q, k, v = _draw(1, 37, 41, 2, 1, 32, torch.float32, device, seed=4)
    _check_forward(q, k, v, causal=True, q_start=3, k_start=0, scale=-0.4)


def test_delta(device):
    g = torch.Generator(device="cpu").manual_seed(5)
    do = torch.randn(2, 45, 3, 80, generator=g).to(device=device, dtype=torch.float16)
    o = torch.randn(2, 45, 3, 80, generator=g).to(device=device, dtype=torch.float16)
    ref = (do.double() * o.double()).sum(-1).transpose(1, 2)
    delta = attention_delta(do, o)
    assert delta.shape == (2, 3, 45) and delta.dtype == torch.float32
    torch.testing.assert_close(delta.double(), ref, rtol=1e-5, atol=1e-4)


def _check_merge(q, k, v, causal, q_start, k_start, poison_rest: bool):
    """Merge a block into a random running state (some rows -inf) held in views of larger buffers."""
    b, sq, h, d = q.shape
    dtype = q.dtype
    dev = q.device
    g = torch.Generator(device="cpu").manual_seed(7)
    half = 5
    fill = float("nan") if poison_rest else 0.0
    obuf = torch.full((b, sq + half, h, d), fill, dtype=torch.float32, device=dev)
    lbuf = torch.full((b, h, sq + half), fill, dtype=torch.float32, device=dev)
    out_acc, lse_acc = obuf[:, half:], lbuf[:, :, half:]
    state_o = torch.randn(b, sq, h, d, generator=g).to(dev)
    state_l = (torch.randn(b, h, sq, generator=g) * 3).to(dev)
    state_l[:, :, ::3] = float("-inf")  # rows that have seen nothing yet (their out is ignored: weight 0)
    out_acc.copy_(state_o)
    lse_acc.copy_(state_l)
    ret = attention_forward(q, k, v, softmax_scale=d**-0.5, causal=causal, q_start=q_start, k_start=k_start,
                            out_acc=out_acc, lse_acc=lse_acc)
    assert ret[0] is out_acc and ret[1] is lse_acc
    ref_o, ref_l = reference_attention(q.double(), k.double(), v.double(), causal=causal, q_start=q_start, k_start=k_start)
    exp_o, exp_l = update_out_and_lse(state_o.double(), state_l.double(), ref_o, ref_l)
    base_o, base_l = naive_attention(q, k, v, causal=causal, q_start=q_start, k_start=k_start)
    bo, bl = update_out_and_lse(state_o, state_l, base_o, base_l.float())
    assert not torch.isnan(out_acc).any() and not torch.isnan(lse_acc).any()
    assert torch.equal(torch.isneginf(lse_acc), torch.isneginf(exp_l))
    assert_judged("out", out_acc, exp_o, bo, dtype)
    assert_judged("lse", lse_acc, exp_l, bl, dtype, is_lse=True)
    # nothing outside the views was touched
    if poison_rest:
        assert torch.isnan(obuf[:, :half]).all() and torch.isnan(lbuf[:, :, :half]).all()
    else:
        assert (obuf[:, :half] == 0).all() and (lbuf[:, :, :half] == 0).all()


@pytest.mark.parametrize(
    "dtype,causal,offsets",
    [
        pytest.param(torch.float16, True, (0, 20), id="fp16-causal-masked-rows"),
        pytest.param(torch.float32, False, (0, 0), id="fp32-full"),
        pytest.param(torch.float16, True, (0, 999), id="fp16-fully-masked-block"),
    ],
)
def test_forward_merge_into_state(dtype, causal, offsets, device):
    q, k, v = _draw(2, 41, 57, 4, 2, 64, dtype, device, seed=8)
    _check_merge(q, k, v, causal, *offsets, poison_rest=False)


@pytest.mark.parametrize(
    "shape,dtype,causal,offsets",
    [
        pytest.param((1, 97, 97, 2, 2, 64), torch.float16, False, (0, 0), id="1x97x2x64-fp16-full"),
        pytest.param((2, 33, 33, 6, 2, 80), torch.float16, True, (0, 0), id="2x33x6of2x80-fp16-diagonal"),
        pytest.param((1, 40, 75, 4, 1, 32), torch.float32, True, (-7, 5), id="1x40x75x4of1x32-fp32-negative"),
        pytest.param((1, 50, 50, 2, 1, 64), torch.float32, True, (0, 17), id="1x50x2of1x64-fp32-masked-rows"),
    ],
)
def test_backward_autograd(shape, dtype, causal, offsets, device):
    b, sq, sk, h, hkv, d = shape
    q, k, v = _draw(b, sq, sk, h, hkv, d, dtype, device, seed=9)
    _check_autograd(q, k, v, causal, *offsets)


def test_backward_negative_scale(device):
    q, k, v = _draw(1, 29, 35, 2, 1, 32, torch.float32, device, seed=10)
    _check_autograd(q, k, v, True, 6, 0, scale=-0.3)


def _check_backward_accumulates(q, k, v, causal, q_start, k_start, poison_rest: bool):
    """Raw launcher: gradients are ADDED into float32 views of larger (poisoned) buffers."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    dtype, dev = q.dtype, q.device
    scale = d**-0.5
    g = torch.Generator(device="cpu").manual_seed(11)
    do = torch.randn(q.shape, generator=g).to(device=dev, dtype=dtype)
    # the global out/lse; here the block is the whole attention
    out, lse = attention_forward(q, k, v, softmax_scale=scale, causal=causal, q_start=q_start, k_start=k_start)
    delta = attention_delta(do, out)
    fill = float("nan") if poison_rest else 0.0
    pad = 3
    dq_buf = torch.full((b, sq + pad, h, d), fill, device=dev)
    dk_buf = torch.full((b, sk + pad, hkv, d), fill, device=dev)
    dv_buf = torch.full((b, sk, hkv + 1, d), fill, device=dev)
    dq_acc, dk_acc, dv_acc = dq_buf[:, pad:], dk_buf[:, :sk], dv_buf[:, :, 1:]
    inits = [torch.randn(t.shape, generator=g).to(dev) for t in (dq_acc, dk_acc, dv_acc)]
    for acc, init in zip((dq_acc, dk_acc, dv_acc), inits):
        acc.copy_(init)
    attention_backward(do, q, k, v, out, lse, delta, softmax_scale=scale, causal=causal, q_start=q_start,
                       k_start=k_start, dq_acc=dq_acc, dk_acc=dk_acc, dv_acc=dv_acc)
    zero_gl = torch.zeros(b, h, sq, device=dev)
    kw = dict(causal=causal, q_start=q_start, k_start=k_start)
    ref = _grads(lambda a, b_, c: reference_attention(a, b_, c, **kw), q.double(), k.double(), v.double(), do,
                 zero_gl, torch.float64)
    base = [None] * 5 if dtype == torch.float32 else _grads(
        lambda a, b_, c: naive_attention(a, b_, c, **kw), q, k, v, do, zero_gl, dtype)
    for name, acc, init, r, bl in zip(("dq", "dk", "dv"), (dq_acc, dk_acc, dv_acc), inits, ref[2:], base[2:]):
        assert_judged(name, acc - init, r, bl, dtype)
    if poison_rest:
        assert torch.isnan(dq_buf[:, :pad]).all() and torch.isnan(dk_buf[:, sk:]).all()
        assert torch.isnan(dv_buf[:, :, :1]).all()


@pytest.mark.parametrize(
    "dtype,causal,offsets",
    [
        pytest.param(torch.float16, True, (0, 30), id="fp16-causal-masked-rows"),
        pytest.param(torch.float32, False, (0, 0), id="fp32-full"),
    ],
)
def test_backward_accumulates_into_views(dtype, causal, offsets, device):
    q, k, v = _draw(1, 45, 61, 4, 2, 32, dtype, device, seed=12)
    _check_backward_accumulates(q, k, v, causal, *offsets, poison_rest=False)


def test_fused_dq_where_tma_indexes_the_accumulators():
    """On sm_90 the Hopper kernel adds dq in the dk/dv pass (dense blocks, causal or not, any offset, and
    interval masks) when TMA can index the three float32 accumulators."""
    bwd_hopper = pytest.importorskip("ringlse.kernels.attention_bwd_hopper")
    dq, dk = torch.zeros(1, 777, 8, 128), torch.zeros(1, 1500, 8, 128)
    fuses = bwd_hopper.hopper_fuses_dq
    assert fuses(dq, dk, dk)
    assert not fuses(dq, dk[:, :, :, :64], dk)
    assert not fuses(dq[..., :100], dk, dk)


def test_backward_empty_block_is_noop(device):
    # a causal block no query sees: callers must not pass it, but it adds exact zeros
    q, k, v = _draw(1, 16, 16, 2, 2, 32, torch.float16, device)
    acc = torch.randn(q.shape, device=device)
    before = acc.clone()
    lse = torch.zeros(1, 2, 16, device=device)
    attention_backward(q, q, k, v, q, lse, lse, softmax_scale=0.2, causal=True, q_start=0, k_start=100,
                       dq_acc=acc, dk_acc=torch.zeros_like(acc), dv_acc=torch.zeros_like(acc))
    assert torch.equal(acc, before)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_halves_add_up_bitwise(causal, device):
    """`dq_acc=None` runs the dk/dv kernel alone, `dk_acc=dv_acc=None` the dq kernel alone (the ring's
    dk/dv pieces): each gives, bit for bit, its part of the whole call, and leaves the other untouched."""
    q, k, v = _draw(1, 45, 61, 4, 2, 32, torch.float32, device, seed=13)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(14)).to(device)
    kw = dict(softmax_scale=0.2, causal=causal, q_start=30, k_start=0)
    out, lse = attention_forward(q, k, v, **kw)
    delta = attention_delta(do, out)
    whole = [torch.zeros(t.shape, device=device) for t in (q, k, v)]
    attention_backward(do, q, k, v, out, lse, delta, **kw, dq_acc=whole[0], dk_acc=whole[1], dv_acc=whole[2])
    dq = torch.zeros_like(whole[0])
    attention_backward(do, q, k, v, out, lse, delta, **kw, dq_acc=dq, dk_acc=None, dv_acc=None)
    dk, dv = torch.zeros_like(whole[1]), torch.zeros_like(whole[2])
    attention_backward(do, q, k, v, out, lse, delta, **kw, dq_acc=None, dk_acc=dk, dv_acc=dv)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), whole):
        assert torch.equal(got, want), name
    with pytest.raises(ValueError, match="both dk_acc and dv_acc"):
        attention_backward(do, q, k, v, out, lse, delta, **kw, dq_acc=dq, dk_acc=dk, dv_acc=None)


def test_attention_api_bottom_right(device):
    # sq != sk aligns bottom-right (CONVENTIONS.md §4); through the autograd wrapper
    q, k, v = _draw(1, 30, 70, 2, 2, 64, torch.float16, device, seed=13)
    out, lse = ringlse.attention(q, k, v, causal=True, return_lse=True, backend="triton")
    ref_o, ref_l = reference_attention(q.double(), k.double(), v.double(), causal=True)
    base_o, base_l = naive_attention(q, k, v, causal=True)
    assert_judged("out", out, ref_o, base_o, torch.float16)
    assert_judged("lse", lse, ref_l, base_l, torch.float16, is_lse=True)


# (batch, seqlen, nheads, nheads_kv, headdim, dtype, masks): the same call twice must give the same bits
DETERMINISM = [
    pytest.param((2, 97, 4, 2, 64, torch.float16, {}), id="2x97x4of2x64-fp16-causal"),
    pytest.param((1, 75, 2, 1, 32, torch.float32, dict(window_size=(9, 0), cu_seqlens=[0, 30, 31, 75])),
                 id="1x75x2of1x32-fp32-window-docs"),
]
DETERMINISM_GPU = [
    pytest.param((2, 1025, 8, 2, 128, torch.bfloat16, {}), id="2x1025x8of2x128-bf16-causal"),
    pytest.param((1, 3000, 4, 4, 64, torch.bfloat16, {}), id="1x3000x4x64-bf16-causal"),
    pytest.param((1, 2049, 8, 2, 128, torch.bfloat16, dict(window_size=(300, 0), cu_seqlens=[0, 700, 701, 2049])),
                 id="1x2049x8of2x128-bf16-window-docs"),
]


def _bitwise_runs(case, device):
    """Two causal forward + backward runs of `attention(backend="triton")` on the same inputs: every
    output, lse and gradient bitwise equal (each dk/dv program owns its key tile, each dq
    program its query tile, and adds it once, by a load-add-store or a TMA reduce-add, never racing
    atomics; launch configs are picked first-fit)."""
    b, s, h, hkv, d, dtype, masks = case
    q, k, v = _draw(b, s, s, h, hkv, d, dtype, device, seed=s)
    go = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    runs = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = ringlse.attention(*leaves, causal=True, return_lse=True, backend="triton", **masks)
        ((out.float() * go.float()).sum() + lse.nan_to_num(neginf=0.0).sum()).backward()
        runs.append([out, lse, *(t.grad for t in leaves)])
    for name, a, b_ in zip(("out", "lse", "dq", "dk", "dv"), *runs):
        assert torch.equal(a, b_), f"{name} differs between two runs: max {(a - b_).abs().max().item():.3e}"


@pytest.mark.parametrize("case", DETERMINISM)
def test_runs_are_bitwise_equal(case, device):
    _bitwise_runs(case, device)


@pytest.mark.gpu
@pytest.mark.parametrize("case", DETERMINISM_GPU)
def test_gpu_runs_are_bitwise_equal(case):
    _bitwise_runs(case, "cuda")


# ---------------------------------------------------------------------------------------------------
# GPU: bf16, every head dim, larger shapes, poisoned buffers

HEAD_DIMS = [32, 64, 80, 96, 128, 256]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", HEAD_DIMS, ids=[f"d{d}" for d in HEAD_DIMS])
def test_gpu_head_dims_bf16(d, causal):
    q, k, v = _draw(2, 1025, 1025, 4, 2, d, torch.bfloat16, "cuda", seed=d)
    _check_forward(q, k, v, causal=causal, q_start=0, k_start=0)
    _check_autograd(q, k, v, causal, 0, 0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape,causal,offsets",
    [
        pytest.param((1, 777, 1500, 8, 8, 128), True, (0, 300), id="777x1500x8x128-masked-rows"),
        pytest.param((2, 513, 300, 8, 2, 64), True, (-100, 50), id="513x300x8of2x64-negative"),
        pytest.param((1, 1000, 1000, 4, 4, 96), False, (0, 0), id="1000x4x96-full"),
    ],
)
def test_gpu_fp16(shape, causal, offsets):
    b, sq, sk, h, hkv, d = shape
    q, k, v = _draw(b, sq, sk, h, hkv, d, torch.float16, "cuda", seed=21)
    _check_forward(q, k, v, causal=causal, q_start=offsets[0], k_start=offsets[1])
    _check_autograd(q, k, v, causal, *offsets)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_long_4k(causal):
    q, k, v = _draw(1, 4096, 4096, 8, 2, 128, torch.bfloat16, "cuda", seed=22)
    _check_forward(q, k, v, causal=causal, q_start=0, k_start=0)
    _check_autograd(q, k, v, causal, 0, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("offsets", OFFSETS)
def test_gpu_causal_offsets_bf16(offsets):
    q, k, v = _draw(2, 600, 900, 8, 2, 128, torch.bfloat16, "cuda", seed=23)
    _check_forward(q, k, v, causal=True, q_start=offsets[0] * 8, k_start=offsets[1] * 8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal,offsets", [(True, (0, 200)), (False, (0, 0)), (True, (0, 5000))],
                         ids=["masked-rows", "full", "fully-masked"])
def test_gpu_merge_poisoned(dtype, causal, offsets):
    q, k, v = _draw(2, 1000, 1300, 8, 4, 128, dtype, "cuda", seed=24)
    _check_merge(q, k, v, causal, *offsets, poison_rest=True)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("causal,offsets", [(True, (0, 150)), (False, (0, 0))], ids=["masked-rows", "full"])
def test_gpu_backward_accumulates_poisoned(d, causal, offsets):
    q, k, v = _draw(2, 700, 1111, 8, 2, d, torch.bfloat16, "cuda", seed=25)
    _check_backward_accumulates(q, k, v, causal, *offsets, poison_rest=True)


@pytest.mark.gpu
def test_gpu_fp32_tf32():
    q, k, v = _draw(1, 600, 600, 4, 2, 64, torch.float32, "cuda", seed=26)
    _check_forward(q, k, v, causal=True, q_start=0, k_start=0)
    _check_autograd(q, k, v, True, 0, 0)
