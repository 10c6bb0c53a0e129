"""Public single-device API: `ringlse.block_attention` and `ringlse.attention` on CPU (backend "torch"
and "auto"), forward and gradients against the float64 reference, gradients through lse, empty
blocks and input validation."""

from __future__ import annotations

import pytest
import torch

import ringlse
from ringlse.blocks.torch_math import TORCH_BLOCK_OP
from ringlse.reference import reference_attention
from ringlse.testing import assert_judged, naive_attention

F64 = torch.float64
BACKENDS = ["torch", "auto"]


def rand(*shape, dtype=F64, gen=None):
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)


def qkv(b, sq, sk, h, hkv, d, dtype=F64, seed=0, grad=True):
    gen = torch.Generator().manual_seed(seed)
    ts = [rand(*s, dtype=dtype, gen=gen) for s in [(b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d)]]
    return [t.requires_grad_(grad) for t in ts]


def upstream(b, sq, h, d, dtype=F64, seed=100):
    gen = torch.Generator().manual_seed(seed)
    return rand(b, sq, h, d, dtype=dtype, gen=gen), rand(b, h, sq, dtype=torch.float64, gen=gen)


def test_auto_is_torch_on_cpu():
    assert ringlse.get_block_op("auto", "cpu") is TORCH_BLOCK_OP
    assert "torch" in ringlse.available_backends("cpu")


@pytest.mark.parametrize("fn", ["block_attention", "attention"])
def test_validation_errors(fn):
    f = getattr(ringlse, fn)
    q, k, v = (t.detach() for t in qkv(1, 8, 8, 4, 2, 16, dtype=torch.float32, seed=7))
    with pytest.raises(ValueError, match="share a dtype"):
        f(q, k.half(), v.half())
    with pytest.raises(ValueError, match="multiple of nheads_kv"):
        f(q, k[:, :, :1].expand(1, 8, 3, 16), v[:, :, :1].expand(1, 8, 3, 16))
    with pytest.raises(ValueError, match=r"must be \[batch, seqlen, nheads, headdim\]"):
        f(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="not supported"):
        f(q.int(), k.int(), v.int())
    with pytest.raises(ValueError, match="head dim"):
        f(q, k[..., :8], v[..., :8])
    with pytest.raises(ValueError, match="same shape"):
        f(q, k, v[:, :4])
    # a V head dim other than Q/K's (MLA) is computed where the backend takes it, else named as such
    out = f(q, k, v[..., :8])
    assert (out[0] if isinstance(out, tuple) else out).shape == (1, 8, 4, 8)
    with pytest.raises(ValueError, match=r"V head dim 8 differs from Q/K head dim 16.*take it: torch, triton"):
        f(q, k, v[..., :8], backend="sdpa")
    with pytest.raises(ValueError, match="batch"):
        f(q, k.expand(2, 8, 2, 16), v.expand(2, 8, 2, 16))
    with pytest.raises(ValueError, match="not available|unknown backend"):
        f(q, k, v, backend="no-such-backend")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        f(q, k, v, backend="sdpa")
    with pytest.raises(TypeError, match="torch.Tensor"):
        f(q, k.numpy(), v)
    # a real CPU/CUDA mismatch needs a GPU; the "meta" device shows the check runs before any math
    with pytest.raises(ValueError, match="one device"):
        f(q, k.to("meta"), v.to("meta"))


SHAPES = [
    pytest.param((1, 1, 1, 1, 1, 8), id="tiny"),
    pytest.param((2, 97, 97, 4, 2, 80), id="gqa2-97-d80"),
    pytest.param((1, 33, 97, 3, 1, 16), id="mqa-33x97"),
    pytest.param((1, 97, 33, 4, 4, 16), id="mha-97x33"),
]
POSITIONS = [
    pytest.param(False, 0, 0, id="full"),
    pytest.param(True, 0, 0, id="causal-diag"),
    pytest.param(True, 40, 3, id="causal-q-after"),
    pytest.param(True, 0, 10, id="causal-empty-rows"),
]


@pytest.mark.parametrize(("causal", "q_start", "k_start"), POSITIONS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_block_attention_float64_forward_and_grads(shape, backend, causal, q_start, k_start):
    b, sq, sk, h, hkv, d = shape
    q, k, v = qkv(*shape, seed=1)
    g_out, g_lse = upstream(b, sq, h, d)
    pos = dict(causal=causal, q_start=q_start, k_start=k_start)
    out, lse = ringlse.block_attention(q, k, v, backend=backend, **pos)
    ref_out, ref_lse = reference_attention(q, k, v, **pos)
    assert out.dtype == F64 and lse.dtype == F64
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    # gradient through out and lse at once (also into -inf lse entries of empty rows)
    grads = torch.autograd.grad((out, lse), (q, k, v), (g_out, g_lse), retain_graph=True)
    ref_grads = torch.autograd.grad((ref_out, ref_lse), (q, k, v), (g_out, g_lse), retain_graph=True)
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g, r, msg=lambda m, name=name: f"d{name}: {m}")
    # and through each alone
    for i, gs in enumerate([(g_out, None), (None, g_lse)]):
        outs = [t for t, g in zip((out, lse), gs) if g is not None]
        refs = [t for t, g in zip((ref_out, ref_lse), gs) if g is not None]
        gg = [g for g in gs if g is not None]
        grads = torch.autograd.grad(outs, (q, k, v), gg, retain_graph=True)
        # lse alone does not depend on v: the reference graph has no path there, ours returns zeros
        ref_grads = torch.autograd.grad(refs, (q, k, v), gg, retain_graph=True, materialize_grads=True)
        for name, g, r in zip("qkv", grads, ref_grads):
            torch.testing.assert_close(g, r, msg=lambda m, name=name, i=i: f"d{name} ({'out' if i == 0 else 'lse'} only): {m}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_attention_float64_bottom_right(shape, backend, causal):
    b, sq, sk, h, hkv, d = shape
    q, k, v = qkv(*shape, seed=2)
    g_out, _ = upstream(b, sq, h, d)
    out = ringlse.attention(q, k, v, causal=causal, backend=backend, softmax_scale=0.25)
    # the reference's default q_start=None is the bottom-right alignment
    ref_out, ref_lse = reference_attention(q, k, v, causal=causal, softmax_scale=0.25)
    torch.testing.assert_close(out, ref_out)
    out2, lse2 = ringlse.attention(q, k, v, causal=causal, backend=backend, softmax_scale=0.25, return_lse=True)
    torch.testing.assert_close(out2, ref_out)
    torch.testing.assert_close(lse2, ref_lse)
    grads = torch.autograd.grad(out, (q, k, v), g_out)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), g_out)
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g, r, msg=lambda m, name=name: f"d{name}: {m}")


def test_attention_causal_more_queries_than_keys_has_empty_rows():
    # bottom-right: 97 queries, 33 keys -> the first 64 query rows see no key
    q, k, v = qkv(1, 97, 33, 4, 2, 16, seed=3)
    out, lse = ringlse.attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out[:, :64], torch.zeros_like(out[:, :64]))
    assert torch.isneginf(lse[..., :64]).all() and torch.isfinite(lse[..., 64:]).all()
    g_out, g_lse = upstream(1, 97, 4, 16)
    dq, dk, dv = torch.autograd.grad((out, lse), (q, k, v), (g_out, g_lse))
    assert torch.equal(dq[:, :64], torch.zeros_like(dq[:, :64]))
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_low_precision_by_design_rule(dtype, causal):
    shape = (1, 97, 97, 4, 2, 80)
    b, sq, sk, h, hkv, d = shape
    q, k, v = qkv(*shape, dtype=dtype, seed=4)
    g_out = upstream(b, sq, h, d, dtype=dtype)[0]
    out, lse = ringlse.block_attention(q, k, v, causal=causal, q_start=10)
    assert out.dtype == dtype and lse.dtype == torch.float32
    grads = torch.autograd.grad(out, (q, k, v), g_out)
    assert all(g.dtype == dtype for g in grads)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference_attention(q64, k64, v64, causal=causal, q_start=10)
    ref_grads = torch.autograd.grad(ref_out, (q64, k64, v64), g_out.double())
    if dtype == torch.float32:
        base_out = base_lse = None
        base_grads = (None,) * 3
    else:
        base_out, base_lse = naive_attention(q, k, v, causal=causal, q_start=10)
        base_grads = torch.autograd.grad(base_out, (q, k, v), g_out)
    assert_judged("out", out, ref_out, base_out, dtype)
    assert_judged("lse", lse, ref_lse, base_lse, dtype, is_lse=True)
    for name, g, r, bg in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads):
        assert_judged(name, g, r, bg, dtype)


@pytest.mark.parametrize("how", ["merge_attn_states", "update_out_and_lse"])
@pytest.mark.parametrize(
    ("q_start", "parts"),
    [
        pytest.param(64, [(0, 30), (30, 60), (60, 97)], id="three-blocks"),
        pytest.param(0, [(50, 97), (0, 50)], id="masked-block-reversed"),
        pytest.param(-5, [(0, 1), (1, 97)], id="empty-rows"),
    ],
)
def test_gradients_flow_through_lse_of_merged_blocks(q_start, parts, how):
    """Blocks computed separately and merged give exactly the gradients of one attention call:
    the merge weights depend on each block's lse, so this only holds if lse backpropagates."""
    b, sq, sk, h, hkv, d = 1, 33, 97, 6, 2, 80
    q, k, v = qkv(b, sq, sk, h, hkv, d, seed=5)
    g_out, g_lse = upstream(b, sq, h, d)
    blocks = [
        ringlse.block_attention(q, k[:, a:e], v[:, a:e], causal=True, q_start=q_start, k_start=a) for a, e in parts
    ]
    if how == "merge_attn_states":
        out, lse = ringlse.merge_attn_states([o for o, _ in blocks], [x for _, x in blocks])
    else:
        out = lse = None
        for bo, bl in blocks:
            out, lse = ringlse.update_out_and_lse(out, lse, bo, bl)
    ref_out, ref_lse = reference_attention(q, k, v, causal=True, q_start=q_start)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    loss = (out * g_out).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * g_lse).sum()
    ref_loss = (ref_out * g_out).sum() + (torch.where(torch.isfinite(ref_lse), ref_lse, 0.0) * g_lse).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g, r, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["fp32", "fp64"])
@pytest.mark.parametrize(
    ("sq", "sk", "q_start", "k_start"),
    [
        pytest.param(16, 16, 0, 16, id="keys-after-queries"),
        pytest.param(97, 33, 0, 1000, id="far-keys"),
        pytest.param(5, 0, 0, 0, id="no-keys"),
    ],
)
def test_empty_block(sq, sk, q_start, k_start, dtype):
    q, k, v = qkv(2, sq, sk, 4, 2, 16, dtype=dtype, seed=6)
    out, lse = ringlse.block_attention(q, k, v, causal=True, q_start=q_start, k_start=k_start)
    assert out.dtype == dtype and lse.dtype == (F64 if dtype == F64 else torch.float32)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    g_out, g_lse = upstream(2, sq, 4, 16, dtype=dtype)
    grads = torch.autograd.grad((out, lse), (q, k, v), (g_out, g_lse.to(lse.dtype)))
    for g in grads:
        assert torch.equal(g, torch.zeros_like(g))
