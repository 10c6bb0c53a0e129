"""Edges of the public API found by trying it as a user would: flags that must be bools, backends
chosen by dtype, backends listed only where they can run, fake (meta) tensors."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch

import ringlse


def _qkv(dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 12, 4, 8, generator=gen, dtype=dtype).to(device)
    k = torch.randn(1, 12, 2, 8, generator=gen, dtype=dtype).to(device)
    return q, k, torch.randn_like(k)


CALLS = {
    "attention": lambda q, k, v, **kw: ringlse.attention(q, k, v, **kw),
    "block_attention": lambda q, k, v, **kw: ringlse.block_attention(q, k, v, **kw),
    "chunked_attention": lambda q, k, v, **kw: ringlse.chunked_attention(q, k, v, chunk_size=5, **kw),
    "ring_attention": lambda q, k, v, **kw: ringlse.ring_attention(q, k, v, **kw),  # one rank, no group
}


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("causal", ["yes", 1, None], ids=["str", "int", "none"])
def test_causal_must_be_a_bool(name, causal):
    with pytest.raises((TypeError, ValueError), match="causal must be a bool"):
        CALLS[name](*_qkv(), causal=causal)


@pytest.mark.parametrize("name", list(CALLS))
def test_nonfinite_softmax_scale_is_refused(name):
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        CALLS[name](*_qkv(), softmax_scale=float("nan"))


def test_auto_picks_a_backend_that_computes_the_dtype():
    # on CUDA, float64 is computed by the torch op only (triton and sdpa take bf16/fp16/fp32)
    assert ringlse.get_block_op("auto", "cuda", torch.float64).name == "torch"
    assert ringlse.get_block_op("auto", "cpu", torch.float64).name == "torch"
    assert "triton" not in ringlse.available_backends("cuda", torch.float64)


@pytest.mark.parametrize(("backend", "dtype"), [("triton", torch.float64), ("sdpa", torch.float64),
                                                ("flash", torch.float32)], ids=["triton-f64", "sdpa-f64", "flash-f32"])
def test_a_backend_that_cannot_compute_the_dtype_raises_before_work(backend, dtype):
    with pytest.raises(ValueError, match=f"{backend} does not compute {dtype}"):
        ringlse.get_block_op(backend, "cuda", dtype)


def test_backend_must_be_a_name_or_a_block_op():
    with pytest.raises(TypeError, match="backend must be a name or a BlockOp"):
        ringlse.attention(*_qkv(), backend=3)


def test_flash_is_not_listed_when_only_flashattention_4_is_installed(monkeypatch):
    """flash-attn 4 installs `flash_attn.cute` without flash-attn 2's interface: the `flash` backend
    (which speaks flash-attn 2) must say so instead of being listed and failing at the first call."""
    from ringlse.blocks import backend_unavailable_reason

    fake = types.ModuleType("flash_attn")
    fake.__path__ = []  # a package without flash_attn_interface
    fake.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    cute = types.ModuleType("flash_attn.cute")
    cute.__spec__ = importlib.machinery.ModuleSpec("flash_attn.cute", None)
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.delitem(sys.modules, "flash_attn.flash_attn_interface", raising=False)
    import ringlse.blocks as registry

    registry._flash_attn_2_missing.cache_clear()
    try:
        reason = backend_unavailable_reason("flash", "cuda", torch.bfloat16)
    finally:
        registry._flash_attn_2_missing.cache_clear()
    assert reason is not None and "flash-attn 2 is not installed" in reason and "FlashAttention-4" in reason
    assert "flash" not in ringlse.available_backends("cpu")


def test_fake_tensors_pass_through_attention():
    """torch.compile traces with fake tensors: nothing on the way may read a value (`.item()`)."""
    q, k, v = (t.to("meta") for t in _qkv())
    out, lse = ringlse.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == q.shape and out.device.type == "meta"
    assert lse.shape == (1, 4, 12) and lse.dtype == torch.float32
    out = ringlse.chunked_attention(q, k, v, causal=True, chunk_size=5)
    assert out.shape == q.shape
