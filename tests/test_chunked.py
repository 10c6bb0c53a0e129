"""chunked_attention: K/V in chunks merged by lse equals attention on all keys, forward and gradients."""

import pytest
import torch

import ringlse
from ringlse.testing import attention_with_grads, judge_all

SHAPES = [  # (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, chunk)
    pytest.param((1, 1, 1, 1, 1, 8, 1), id="single"),
    pytest.param((2, 97, 97, 6, 2, 80, 13), id="gqa-97-d80"),
    pytest.param((1, 33, 130, 4, 1, 32, 64), id="mqa-longer-k"),
    pytest.param((1, 130, 33, 2, 2, 16, 7), id="longer-q"),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_chunked_float64_exact(shape, causal):
    b, sq, sk, h, hkv, d, chunk = shape
    g = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(b, sq, h, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, sk, hkv, d, generator=g, dtype=torch.float64) for _ in "kv")
    dout = torch.randn(b, sq, h, d, generator=g, dtype=torch.float64)
    dlse = torch.randn(b, h, sq, generator=g, dtype=torch.float64)
    ours = attention_with_grads(
        lambda *t: ringlse.chunked_attention(*t, causal=causal, chunk_size=chunk, return_lse=True),
        q, k, v, dout, dlse, upcast=False)
    ref = attention_with_grads(ringlse.reference_attention, q, k, v, dout, dlse, upcast=True, causal=causal)
    for name, a, r in zip(("out", "lse", "dq", "dk", "dv"), ours, ref):
        torch.testing.assert_close(a, r, msg=lambda m: f"{name}: {m}")
    if causal and sq > sk:  # bottom-right alignment leaves the first rows with no key
        assert torch.isneginf(ours[1][:, :, : sq - sk]).all() and (ours[0][:, : sq - sk] == 0).all()


def test_chunked_bf16_by_design_rule():
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, 200, 4, 64, generator=g).bfloat16() for _ in range(4))
    ours = attention_with_grads(lambda *t: ringlse.chunked_attention(*t, causal=True, chunk_size=48, return_lse=True),
                                q, k, v, dout, upcast=False)
    for vd in judge_all(ours, q, k, v, dout, causal=True):
        assert vd.ok, str(vd)


def test_chunked_rejects_bad_chunk_size():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="chunk_size"):
        ringlse.chunked_attention(q, q, q, chunk_size=0)
