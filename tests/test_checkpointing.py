"""The attention ops under activation checkpointing (torch.utils.checkpoint, non-reentrant, as FSDP2 training
applies it per decoder layer): forward and gradients equal the same call without it. The recomputed forward
saves fresh tensors, and the backward may unpack each saved tensor only once."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import ringlse

CASES = [  # (batch, seqlen, q heads, kv heads, head dim)
    pytest.param((1, 97, 4, 2, 16), id="gqa-97"),
    pytest.param((2, 64, 2, 2, 80), id="b2-d80"),
]


def _grads(fn, q, k, v, dout, sinks):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    out = fn(*leaves)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("shape", CASES)
@pytest.mark.parametrize("entry", ["attention", "ring_attention"])
def test_checkpointed_call_equals_plain(shape, entry):
    b, s, h, hkv, d = shape
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(b, s, h, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, s, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(h, generator=g, dtype=torch.float64)
    call = getattr(ringlse, entry)
    layout = {"layout": "contiguous"} if entry == "ring_attention" else {}  # any length, one rank

    def fn(q_, k_, v_, sinks_):
        return call(q_, k_, v_, causal=True, sinks=sinks_, backend="torch", **layout)

    plain = _grads(fn, q, k, v, dout, sinks)
    checkpointed = _grads(lambda *t: checkpoint(fn, *t, use_reentrant=False), q, k, v, dout, sinks)
    for a, c in zip(plain, checkpointed):
        # the same float64 computation run twice: equal to rounding
        torch.testing.assert_close(c, a, rtol=0, atol=1e-12)
