"""`reference_attention`, the float64 yardstick (CONVENTIONS.md §7), against an independent direct computation.

The direct computation below loops over batch and query heads, picks the K/V head of each query head
explicitly (`h // group`), builds its own mask from position vectors and uses `torch.softmax` /
`torch.logsumexp`: it shares no code with `ringlse` (not `visibility_mask`, not
`masked_softmax_and_lse`), so the two cannot be wrong in the same way.
"""

from __future__ import annotations

import pytest
import torch

from ringlse.reference import reference_attention

F64 = torch.float64


def rand(*shape: int, dtype: torch.dtype = F64, gen: torch.Generator | None = None) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def qkv(b, sq, sk, h, hkv, d, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return rand(b, sq, h, d, dtype=dtype, gen=gen), rand(b, sk, hkv, d, dtype=dtype, gen=gen), rand(
        b, sk, hkv, d, dtype=dtype, gen=gen
    )


def direct_attention(q, k, v, *, causal, scale, q_start, k_start):
    """Float64 attention, one (batch, query head) at a time; empty rows give out 0, lse -inf."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = h // hkv
    pos_q = q_start + torch.arange(sq, dtype=torch.int64)
    pos_k = k_start + torch.arange(sk, dtype=torch.int64)
    visible = pos_k[None, :] <= pos_q[:, None] if causal else torch.ones(sq, sk, dtype=torch.bool)
    out = torch.zeros(b, sq, h, d, dtype=F64)
    lse = torch.full((b, h, sq), float("-inf"), dtype=F64)
    live = visible.any(dim=1)
    for bi in range(b):
        for hh in range(h):
            kh = hh // group  # query head hh reads K/V head hh // group (flash-attn's GQA convention)
            s = (q[bi, :, hh].double() @ k[bi, :, kh].double().T) * scale
            s = s.masked_fill(~visible, float("-inf"))[live]
            lse[bi, hh, live] = torch.logsumexp(s, dim=1)
            out[bi, live, hh] = torch.softmax(s, dim=1) @ v[bi, :, kh].double()
    return out, lse


# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim)
SHAPES = [
    pytest.param((1, 1, 1, 1, 1, 8), id="tiny-1x1"),
    pytest.param((2, 97, 97, 4, 4, 16), id="mha-97"),
    pytest.param((1, 97, 33, 6, 2, 80), id="gqa3-97x33-d80"),
    pytest.param((2, 33, 97, 4, 1, 80), id="mqa-33x97-d80"),
    pytest.param((1, 1025, 40, 2, 1, 16), id="mqa-1025x40"),
    pytest.param((1, 17, 1025, 4, 2, 16), id="gqa2-17x1025"),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_direct_default_positions(shape, causal):
    b, sq, sk, h, hkv, d = shape
    q, k, v = qkv(*shape)
    out, lse = reference_attention(q, k, v, causal=causal)
    # default: softmax_scale = d ** -0.5 and, for causal, bottom-right alignment q_start = sk - sq
    exp_out, exp_lse = direct_attention(q, k, v, causal=causal, scale=d**-0.5, q_start=sk - sq, k_start=0)
    torch.testing.assert_close(out, exp_out)
    torch.testing.assert_close(lse, exp_lse)
    assert out.shape == (b, sq, h, d) and lse.shape == (b, h, sq)


@pytest.mark.parametrize(
    ("q_start", "k_start"),
    [
        pytest.param(0, 0, id="top-left"),
        pytest.param(20, 0, id="q-after"),
        pytest.param(0, 20, id="k-after-empty-rows"),
        pytest.param(1000, 1003, id="large-equal"),
        pytest.param(-5, 0, id="negative-q_start"),
        pytest.param(0, 500, id="all-empty"),
    ],
)
@pytest.mark.parametrize("shape", [pytest.param((2, 33, 41, 4, 2, 80), id="gqa-33x41-d80")])
def test_explicit_positions(shape, q_start, k_start):
    q, k, v = qkv(*shape, seed=1)
    out, lse = reference_attention(q, k, v, causal=True, q_start=q_start, k_start=k_start)
    exp_out, exp_lse = direct_attention(q, k, v, causal=True, scale=shape[-1] ** -0.5, q_start=q_start, k_start=k_start)
    torch.testing.assert_close(out, exp_out)
    torch.testing.assert_close(lse, exp_lse)


def test_bottom_right_default_with_k_start():
    q, k, v = qkv(1, 10, 30, 2, 1, 16, seed=2)
    # q_start=None aligns the ends: q_start = k_start + sk - sq
    a = reference_attention(q, k, v, causal=True, k_start=7)
    b = reference_attention(q, k, v, causal=True, q_start=7 + 30 - 10, k_start=7)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # and it differs from top-left alignment, so the default is really doing something
    c = reference_attention(q, k, v, causal=True, q_start=7, k_start=7)
    assert not torch.allclose(a[0], c[0])


def test_non_causal_ignores_positions():
    q, k, v = qkv(1, 9, 13, 2, 2, 16, seed=3)
    a = reference_attention(q, k, v)
    b = reference_attention(q, k, v, q_start=100, k_start=-40)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_softmax_scale():
    q, k, v = qkv(1, 11, 13, 4, 2, 80, seed=4)
    default = reference_attention(q, k, v)
    explicit = reference_attention(q, k, v, softmax_scale=80**-0.5)
    assert torch.equal(default[0], explicit[0]) and torch.equal(default[1], explicit[1])
    out, lse = reference_attention(q, k, v, softmax_scale=0.37, causal=True)
    exp_out, exp_lse = direct_attention(q, k, v, causal=True, scale=0.37, q_start=2, k_start=0)
    torch.testing.assert_close(out, exp_out)
    torch.testing.assert_close(lse, exp_lse)
    assert not torch.allclose(out, reference_attention(q, k, v, causal=True)[0])


def test_empty_rows_zero_out_neginf_lse_and_zero_grads():
    # keys start at 10, queries at 0: query rows 0..9 see nothing
    b, sq, sk, h, hkv, d = 2, 16, 12, 4, 2, 8
    q, k, v = (t.requires_grad_() for t in qkv(b, sq, sk, h, hkv, d, seed=5))
    out, lse = reference_attention(q, k, v, causal=True, q_start=0, k_start=10)
    assert torch.equal(out[:, :10], torch.zeros_like(out[:, :10]))
    assert torch.isneginf(lse[..., :10]).all() and torch.isfinite(lse[..., 10:]).all()
    # nonzero upstream gradients, also on the -inf lse entries: they must not produce NaN or inf
    gen = torch.Generator().manual_seed(6)
    g_out, g_lse = rand(*out.shape, gen=gen), rand(*lse.shape, gen=gen)
    dq, dk, dv = torch.autograd.grad((out, lse), (q, k, v), (g_out, g_lse))
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()
    assert torch.equal(dq[:, :10], torch.zeros_like(dq[:, :10]))
    # the live rows alone give the same gradients
    out2, lse2 = reference_attention(q[:, 10:], k, v, causal=True, q_start=10, k_start=10)
    dq2, dk2, dv2 = torch.autograd.grad((out2, lse2), (q, k, v), (g_out[:, 10:], g_lse[..., 10:]))
    torch.testing.assert_close(dq, dq2)
    torch.testing.assert_close(dk, dk2)
    torch.testing.assert_close(dv, dv2)


def test_all_rows_empty_grads_are_zero():
    q, k, v = (t.requires_grad_() for t in qkv(1, 5, 7, 2, 1, 8, seed=7))
    out, lse = reference_attention(q, k, v, causal=True, q_start=0, k_start=50)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    grads = torch.autograd.grad((out, lse), (q, k, v), (torch.randn_like(out), torch.randn_like(lse)))
    for g in grads:
        assert torch.equal(g, torch.zeros_like(g))


def test_zero_keys():
    # an empty key block (ring step or partition with no keys): every row is empty
    q, k, v = qkv(1, 4, 0, 2, 2, 8, seed=8)
    q.requires_grad_()
    out, lse = reference_attention(q, k, v)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    (dq,) = torch.autograd.grad((out, lse), (q,), (torch.randn_like(out), torch.randn_like(lse)))
    assert torch.equal(dq, torch.zeros_like(dq))


def test_gradcheck_with_empty_rows():
    b, sq, sk, h, hkv, d = 1, 5, 6, 2, 1, 3
    q, k, v = (t.requires_grad_() for t in qkv(b, sq, sk, h, hkv, d, seed=9))

    # q_start=0, k_start=2: rows 0, 1 are empty; their lse is -inf, which finite differences cannot
    # handle, so gradcheck sees the live part of lse (the -inf part is covered by the test above)
    def f(q, k, v):
        out, lse = reference_attention(q, k, v, causal=True, q_start=0, k_start=2)
        return out, lse[..., 2:]

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize(
    ("dtype", "lse_dtype"),
    [
        pytest.param(torch.float16, torch.float32, id="fp16"),
        pytest.param(torch.bfloat16, torch.float32, id="bf16"),
        pytest.param(torch.float32, torch.float32, id="fp32"),
        pytest.param(torch.float64, torch.float64, id="fp64"),
    ],
)
def test_dtypes(dtype, lse_dtype):
    q, k, v = qkv(2, 19, 23, 4, 2, 16, dtype=dtype, seed=10)
    out, lse = reference_attention(q, k, v, causal=True)
    assert out.dtype == dtype and lse.dtype == lse_dtype
    # whatever the input dtype, the math is float64 and only the result is rounded
    exp_out, exp_lse = direct_attention(q, k, v, causal=True, scale=16**-0.5, q_start=4, k_start=0)
    torch.testing.assert_close(out, exp_out.to(dtype))
    torch.testing.assert_close(lse, exp_lse.to(lse_dtype))


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "v_shape"),
    [
        pytest.param((1, 4, 2, 8), (2, 4, 2, 8), (2, 4, 2, 8), id="batch"),
        pytest.param((1, 4, 2, 8), (1, 4, 2, 16), (1, 4, 2, 16), id="headdim"),
        pytest.param((1, 4, 2, 8), (1, 4, 2, 8), (1, 5, 2, 8), id="k-v-differ"),
        pytest.param((1, 4, 6, 8), (1, 4, 4, 8), (1, 4, 4, 8), id="heads-not-divisible"),
        pytest.param((1, 4, 6, 8), (1, 4, 0, 8), (1, 4, 0, 8), id="zero-kv-heads"),
        pytest.param((4, 6, 8), (4, 6, 8), (4, 6, 8), id="3d"),
        pytest.param((1, 4, 2, 8), (1, 4, 2, 8, 1), (1, 4, 2, 8, 1), id="5d-kv"),
    ],
)
def test_shape_mismatch_raises(q_shape, k_shape, v_shape):
    with pytest.raises(ValueError, match="incompatible shapes"):
        reference_attention(torch.randn(q_shape), torch.randn(k_shape), torch.randn(v_shape))
