"""The checks shared by tests/test_fa4.py (a stand-in with FlashAttention-4's signatures, on CPU) and
tests/test_fa4_gpu.py (the real FA4): a block op's out, lse and gradients against the float64 reference,
by CONVENTIONS.md §7."""

from __future__ import annotations

import torch

import ringlse
from ringlse.merge_states import merge_attn_states
from ringlse.reference import reference_attention
from ringlse.testing import assert_judged, naive_attention

F64 = torch.float64
HALF = (torch.float16, torch.bfloat16)


def _qkv(b, sq, sk, h, hkv, d, dtype, device, gen):
    def draw(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype).requires_grad_()

    return draw(b, sq, h, d), draw(b, sk, hkv, d), draw(b, sk, hkv, d)


def _loss(out, lse, dout, dlse):
    # lse enters the loss only where finite; empty rows have lse -inf and must get zero gradients
    loss = (out.to(dout.dtype) * dout).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * dlse).sum()
    return loss


def check_against_reference(run, b, sq, sk, h, hkv, d, dtype, device, *, lse_grad, seed, scale=None, **rule):
    """`run(q, k, v) -> (out, lse)` with autograd; out, lse, dq, dk, dv judged by CONVENTIONS.md §7
    against `reference_attention(..., **rule)` (float64: exactly, `assert_close`)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(b, sq, sk, h, hkv, d, dtype, device, gen)
    out, lse = run(q, k, v)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (b, h, sq) and lse.dtype == (F64 if dtype == F64 else torch.float32)
    assert not torch.isposinf(lse).any() and not torch.isnan(out).any()
    dout = torch.randn(out.shape, generator=gen).to(device=device, dtype=F64)
    dlse = torch.randn(lse.shape, generator=gen).to(device=device, dtype=F64) if lse_grad else None
    grads = torch.autograd.grad(_loss(out.double(), lse.double(), dout, dlse), (q, k, v))

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference_attention(q64, k64, v64, softmax_scale=scale, **rule)
    ref_grads = torch.autograd.grad(_loss(ref_out, ref_lse, dout, dlse), (q64, k64, v64))
    base = [None] * 5
    if dtype in HALF:
        qb, kb, vb = (x.detach().clone().requires_grad_() for x in (q, k, v))
        b_out, b_lse = naive_attention(qb, kb, vb, softmax_scale=scale, **rule)
        b_grads = torch.autograd.grad(_loss(b_out, b_lse, dout.to(dtype), dlse.to(dtype) if lse_grad else None),
                                      (qb, kb, vb))
        base = [b_out, b_lse, *b_grads]
    names = ("out", "lse", "dq", "dk", "dv")
    for name, got, ref, bl in zip(names, (out, lse, *grads), (ref_out, ref_lse, *ref_grads), base):
        if dtype == F64:
            torch.testing.assert_close(got, ref, msg=lambda m: f"{name}: {m}")
        else:
            assert_judged(name, got, ref, bl, dtype, is_lse=name == "lse")
    empty_rows = torch.isneginf(ref_lse).all(1)  # [b, sq]: rows that see no key (CONVENTIONS.md §2)
    if empty_rows.any():
        assert (out[empty_rows] == 0).all() and (grads[0][empty_rows] == 0).all()
        assert torch.isneginf(lse.transpose(1, 2)[empty_rows]).all()


def _block(op, causal, q_start, k_start, scale=None):
    def run(q, k, v):
        return ringlse.block_attention(q, k, v, causal=causal, q_start=q_start, k_start=k_start, softmax_scale=scale,
                                       backend=op)

    return run


def judge_merged_block(out_acc, lse_acc, state0, q, k, v, q_start, k_start, dtype):
    """A causal block at offsets merged into the running state `state0` (float64 copies of the
    accumulators before the call): `out_acc`/`lse_acc` against the float64 merge, by CONVENTIONS.md §7."""
    blk = reference_attention(q.double(), k.double(), v.double(), causal=True, q_start=q_start, k_start=k_start)
    ref_out, ref_lse = merge_attn_states([state0[0], blk[0]], [state0[1], blk[1]])
    nb = naive_attention(q, k, v, causal=True, q_start=q_start, k_start=k_start)
    base = merge_attn_states([state0[0], nb[0].double()], [state0[1], nb[1].double()])
    assert_judged("out", out_acc, ref_out, base[0], dtype)
    assert_judged("lse", lse_acc, ref_lse, base[1], dtype, is_lse=True)
