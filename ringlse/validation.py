"""Input checks shared by every entry point: bad input fails here, with a message naming what is
wrong, before any kernel or collective runs."""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str) -> None:
    """Raise ValueError unless q `[b, sq, h, d]`, k/v `[b, sk, hkv, d]` agree (DESIGN §1)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{what}: {name} must be [batch, seqlen, nheads, headdim], got shape {tuple(t.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{what}: dtype {q.dtype} is not supported (use one of {SUPPORTED_DTYPES})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{what}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{what}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"{what}: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, _, h, d = q.shape
    if k.shape[0] != b:
        raise ValueError(f"{what}: batch of q ({b}) and k ({k.shape[0]}) differ")
    if k.shape[3] != d:
        raise ValueError(f"{what}: head dim of q ({d}) and k ({k.shape[3]}) differ")
    if k.shape[2] == 0 or h % k.shape[2]:
        raise ValueError(f"{what}: nheads ({h}) must be a multiple of nheads_kv ({k.shape[2]})")
