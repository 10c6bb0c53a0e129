"""Input checks shared by every entry point: bad input fails here, with a message naming what is
wrong, before any kernel or collective runs."""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of lse and of running accumulators for inputs of `dtype` (CONVENTIONS.md §1, §3)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_flag(value: object, name: str, what: str) -> bool:
    """`value` if it is a bool; TypeError otherwise (`causal="yes"` must not pass as true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{what}: {name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_scale(softmax_scale: float | None, headdim: int, what: str) -> float:
    """The softmax scale: `headdim ** -0.5` by default, else `softmax_scale` as a finite float."""
    if softmax_scale is None:
        return headdim**-0.5
    scale = float(softmax_scale)
    if scale != scale or scale in (float("inf"), float("-inf")):
        raise ValueError(f"{what}: softmax_scale must be finite, got {softmax_scale!r}")
    return scale


def check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str) -> None:
    """TypeError unless q, k, v are tensors; ValueError unless they are on one device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{what}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str) -> None:
    """Raise ValueError unless q `[b, sq, h, d]`, k `[b, sk, hkv, d]`, v `[b, sk, hkv, d_v]` agree
    (CONVENTIONS.md §1; whether the backend takes `d_v != d` is `feature_refused`'s)."""
    check_tensors(q, k, v, what)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{what}: {name} must be [batch, seqlen, nheads, headdim], got shape {tuple(t.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{what}: dtype {q.dtype} is not supported (use one of {SUPPORTED_DTYPES})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{what}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, _, h, d = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"{what}: k and v must have the same shape but for the head dim, got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    if k.shape[0] != b:
        raise ValueError(f"{what}: batch of q ({b}) and k ({k.shape[0]}) differ")
    if k.shape[3] != d:
        raise ValueError(f"{what}: head dim of q ({d}) and k ({k.shape[3]}) differ")
    if k.shape[2] == 0 or h % k.shape[2]:
        raise ValueError(f"{what}: nheads ({h}) must be a multiple of nheads_kv ({k.shape[2]})")


# the registry's backends whose block ops take these (`Capabilities.softcap`, `.v_head_dim`); a test
# checks they agree with the ops
SOFTCAP_BACKENDS = ("torch", "triton", "fa4")
V_HEAD_DIM_BACKENDS = ("torch", "triton", "fa4")


def check_softcap(softcap: object, what: str) -> float:
    """`softcap` as a float: 0 (off) or positive and finite; ValueError (TypeError for a non-number)."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"{what}: softcap must be a float, got {type(softcap).__name__}")
    value = float(softcap)
    if not (value >= 0 and value != float("inf")):
        raise ValueError(f"{what}: softcap must be 0 (off) or positive and finite, got {softcap!r}")
    return value


def feature_refused(name: str, caps, softcap: float, d_qk: int, d_v: int) -> str | None:
    """Why the block op `name` with capabilities `caps` cannot take `softcap` (> 0: on) or a V head
    dim `d_v` other than `d_qk`, or None."""
    if softcap and not caps.softcap:
        return (f"softcap {softcap:g}: the {name!r} block op does not take softcap "
                f"(backends that take it: {', '.join(SOFTCAP_BACKENDS)})")
    if d_v != d_qk and not caps.v_head_dim:
        return (f"V head dim {d_v} differs from Q/K head dim {d_qk}: the {name!r} block op does not take it "
                f"(backends that take it: {', '.join(V_HEAD_DIM_BACKENDS)})")
    return None
