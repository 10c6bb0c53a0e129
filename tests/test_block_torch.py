"""The PyTorch block op (`TORCH_BLOCK_OP`) against the block-op contract in `ringlse/blockop.py`.

Forward with and without accumulators (strided views into larger, NaN-poisoned buffers), backward
into accumulators (the global `out`/`lse` of several key blocks), float64 exactly and fp32/bf16 by
CONVENTIONS.md §7.
"""

from __future__ import annotations

import pytest
import torch

from ringlse.blocks.contract import torch_delta
from ringlse.blocks.torch_math import TORCH_BLOCK_OP
from ringlse.reference import reference_attention
from ringlse.testing import assert_judged, naive_attention

F64 = torch.float64
OP = TORCH_BLOCK_OP


def qkv(b, sq, sk, h, hkv, d, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(*s, generator=gen, dtype=F64).to(dtype) for s in [(b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d)]
    )


def poisoned_view(shape, dtype, pad=(1, 2)):
    """A NaN-filled buffer larger than `shape` in every dim, and a non-contiguous view of `shape` into it."""
    big = torch.full([n + pad[0] + pad[1] for n in shape], float("nan"), dtype=dtype)
    view = big[tuple(slice(pad[0], pad[0] + n) for n in shape)]
    return big, view


def outside_still_nan(big, pad=(1, 2)):
    inside = torch.zeros_like(big, dtype=torch.bool)
    inside[tuple(slice(pad[0], n - pad[1]) for n in big.shape)] = True
    return torch.isnan(big[~inside]).all().item()


SHAPES = [
    pytest.param((1, 1, 1, 1, 1, 8), id="tiny"),
    pytest.param((2, 33, 33, 4, 4, 16), id="mha-33"),
    pytest.param((1, 97, 41, 6, 2, 80), id="gqa3-97x41-d80"),
    pytest.param((2, 25, 97, 4, 1, 80), id="mqa-25x97-d80"),
]
POSITIONS = [
    pytest.param(False, 0, 0, id="full"),
    pytest.param(True, 0, 0, id="causal-top-left"),
    pytest.param(True, 0, 1, id="causal-stripe-k1"),
    pytest.param(True, 30, 0, id="causal-q-after"),
    pytest.param(True, 0, 20, id="causal-empty-rows"),
    pytest.param(True, 0, 500, id="causal-all-empty"),
    pytest.param(True, 500, 0, id="causal-all-visible"),
]


@pytest.mark.parametrize(("causal", "q_start", "k_start"), POSITIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_float64_exact(shape, causal, q_start, k_start):
    q, k, v = qkv(*shape)
    out, lse = OP.forward(q, k, v, softmax_scale=0.3, causal=causal, q_start=q_start, k_start=k_start)
    ref_out, ref_lse = reference_attention(q, k, v, causal=causal, softmax_scale=0.3, q_start=q_start, k_start=k_start)
    assert out.dtype == F64 and lse.dtype == F64
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize(
    ("causal", "q_start", "split"),
    [
        pytest.param(False, 0, 17, id="full"),
        pytest.param(True, 0, 17, id="causal-second-part-masked-for-early-rows"),
        pytest.param(True, -8, 17, id="causal-rows-empty-everywhere"),
        pytest.param(True, 64, 0, id="start-from-empty-state"),
    ],
)
@pytest.mark.parametrize("shape", [pytest.param((2, 33, 41, 6, 2, 80), id="gqa3-33x41-d80")])
def test_forward_into_accumulator_views(shape, causal, q_start, split):
    b, sq, sk, h, hkv, d = shape
    q, k, v = qkv(*shape, seed=1)
    scale = d**-0.5
    big_o, out_acc = poisoned_view((b, sq, h, d), F64)
    big_l, lse_acc = poisoned_view((b, h, sq), F64)
    # the running state: keys [0, split) (an empty key range gives the empty state (0, -inf))
    o0, l0 = reference_attention(q, k[:, :split], v[:, :split], causal=causal, q_start=q_start, k_start=0)
    out_acc.copy_(o0)
    lse_acc.copy_(l0)
    res = OP.forward(
        q, k[:, split:], v[:, split:], softmax_scale=scale, causal=causal, q_start=q_start, k_start=split,
        out_acc=out_acc, lse_acc=lse_acc,
    )
    assert res[0] is out_acc and res[1] is lse_acc
    ref_out, ref_lse = reference_attention(q, k, v, causal=causal, q_start=q_start, k_start=0)
    torch.testing.assert_close(out_acc, ref_out)
    torch.testing.assert_close(lse_acc, ref_lse)
    assert not torch.isnan(out_acc).any()
    assert outside_still_nan(big_o) and outside_still_nan(big_l)


def _grads_by_blocks(q, k, v, dout, out, lse, parts, *, causal, q_start, scale, acc_dtype, k_start=0, repeat=1):
    """dq, dk, dv from the block op's backward over the key `parts` (key 0 at `k_start`), into
    NaN-padded views."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    big_q, dq = poisoned_view((b, sq, h, d), acc_dtype)
    big_k, dk = poisoned_view((b, sk, hkv, d), acc_dtype)
    big_v, dv = poisoned_view((b, sk, hkv, d), acc_dtype)
    for t in (dq, dk, dv):
        t.zero_()
    delta = torch_delta(dout, out)
    for _ in range(repeat):
        for a, e in parts:
            OP.backward(
                dout, q, k[:, a:e], v[:, a:e], out, lse, delta, softmax_scale=scale, causal=causal,
                q_start=q_start, k_start=k_start + a, dq_acc=dq, dk_acc=dk[:, a:e], dv_acc=dv[:, a:e],
            )
    assert outside_still_nan(big_q) and outside_still_nan(big_k) and outside_still_nan(big_v)
    return dq, dk, dv


@pytest.mark.parametrize(
    ("causal", "q_start", "parts"),
    [
        pytest.param(False, 0, [(0, 41)], id="full-one-block"),
        pytest.param(False, 0, [(30, 41), (0, 30)], id="full-two-blocks"),
        pytest.param(True, 8, [(0, 10), (10, 25), (25, 41)], id="causal-bottom-right-three"),
        pytest.param(True, -5, [(0, 7), (7, 41)], id="causal-empty-rows"),
    ],
)
@pytest.mark.parametrize("shape", [pytest.param((2, 33, 41, 6, 2, 80), id="gqa3-33x41-d80")])
def test_backward_float64_exact_and_accumulates(shape, causal, q_start, parts):
    b, sq, sk, h, hkv, d = shape
    q, k, v = (t.requires_grad_() for t in qkv(*shape, seed=2))
    dout = torch.randn(b, sq, h, d, dtype=F64, generator=torch.Generator().manual_seed(3))
    scale = 0.2
    out, lse = reference_attention(q, k, v, causal=causal, q_start=q_start, softmax_scale=scale)
    ref = torch.autograd.grad(out, (q, k, v), dout)
    args = dict(causal=causal, q_start=q_start, scale=scale, acc_dtype=F64)
    qd, kd, vd, od, ld = (t.detach() for t in (q, k, v, out, lse))
    grads = _grads_by_blocks(qd, kd, vd, dout, od, ld, parts, **args)
    for name, g, r in zip("qkv", grads, ref):
        torch.testing.assert_close(g, r, msg=lambda m, name=name: f"d{name}: {m}")
    # accumulators accumulate: running every block twice doubles every gradient
    grads2 = _grads_by_blocks(qd, kd, vd, dout, od, ld, parts, repeat=2, **args)
    for name, g, r in zip("qkv", grads2, ref):
        torch.testing.assert_close(g, 2 * r, msg=lambda m, name=name: f"2 x d{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("causal", "q_start", "k_start"), [POSITIONS[0], POSITIONS[3], POSITIONS[4]])
@pytest.mark.parametrize("shape", [pytest.param((1, 97, 97, 4, 2, 80), id="gqa2-97-d80")])
def test_low_precision_by_design_rule(shape, causal, q_start, k_start, dtype):
    b, sq, sk, h, hkv, d = shape
    q, k, v = qkv(*shape, dtype=dtype, seed=4)
    dout = torch.randn(b, sq, h, d, generator=torch.Generator().manual_seed(5), dtype=F64).to(dtype)
    scale = d**-0.5
    pos = dict(causal=causal, q_start=q_start, k_start=k_start)

    out, lse = OP.forward(q, k, v, softmax_scale=scale, **pos)
    assert out.dtype == dtype and lse.dtype == torch.float32
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference_attention(q64, k64, v64, **pos)
    ref_grads = torch.autograd.grad(ref_out, (q64, k64, v64), dout.double())

    grads = _grads_by_blocks(q, k, v, dout, out, lse, [(0, sk)], scale=scale, acc_dtype=torch.float32, **pos)
    if dtype == torch.bfloat16:
        qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
        base_out, base_lse = naive_attention(qb, kb, vb, **pos)
        base_grads = torch.autograd.grad(base_out, (qb, kb, vb), dout)
    else:
        base_out = base_lse = None
        base_grads = (None, None, None)
    assert_judged("out", out, ref_out, base_out, dtype)
    assert_judged("lse", lse, ref_lse, base_lse, dtype, is_lse=True)
    for name, g, r, bg in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads):
        assert_judged(name, g, r, bg, dtype)


def test_low_precision_accumulators():
    """bf16 blocks merged into float32 accumulators stay within the rule for the whole sequence."""
    b, sq, sk, h, hkv, d = 1, 64, 96, 4, 1, 80
    q, k, v = qkv(b, sq, sk, h, hkv, d, dtype=torch.bfloat16, seed=6)
    big_o, out_acc = poisoned_view((b, sq, h, d), torch.float32)
    big_l, lse_acc = poisoned_view((b, h, sq), torch.float32)
    out_acc.zero_()
    lse_acc.fill_(float("-inf"))
    for a, e in [(0, 32), (32, 64), (64, 96)]:
        OP.forward(q, k[:, a:e], v[:, a:e], softmax_scale=d**-0.5, causal=True, q_start=32, k_start=a,
                   out_acc=out_acc, lse_acc=lse_acc)
    ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double(), causal=True, q_start=32)
    base_out, base_lse = naive_attention(q, k, v, causal=True, q_start=32)
    assert_judged("out", out_acc, ref_out, base_out, torch.bfloat16)
    assert_judged("lse", lse_acc, ref_lse, base_lse, torch.bfloat16, is_lse=True)
    assert outside_still_nan(big_o) and outside_still_nan(big_l)
