"""A dense-mask oracle for windows and documents (CONVENTIONS.md §10), written pair by pair from the
rule, independently of ringlse (neither `ringlse.masks` nor `ringlse.reference`); with learnable sinks
(§3.1), logit softcapping and a V head dim of its own (§1)."""

from __future__ import annotations

import bisect
import math

import torch


def _visible(p: int, t: int, causal: bool, window: tuple[int, int], docs) -> bool:
    left, right = window
    if causal and t > p:
        return False
    if left >= 0 and t < p - left:
        return False
    if right >= 0 and t > p + right:
        return False
    if docs is not None and bisect.bisect_right(docs, t) != bisect.bisect_right(docs, p):
        return False
    return True


def oracle(q, k, v, q_pos, k_pos, causal, window, docs, sinks=None, *, softcap=0.0, scale=None):
    """Softmax attention with the mask built pair by pair from the rule; `(out, lse)`, float64.

    q `[b, sq, h, d]`, k `[b, sk, hkv, d]`, v `[b, sk, hkv, d_v]` at global positions `q_pos`, `k_pos`;
    scores `scale * q.k` (`scale` default `d ** -0.5`), with `softcap` > 0 capped to `softcap *
    tanh(score / softcap)` before the mask (Gemma 2). With `sinks` `[h]` (GPT-OSS's eager attention):
    one more score column per row, the sink, whose probability is dropped after the softmax; the lse
    includes it. A row that sees nothing (not even a sink) gives out 0 and lse -inf."""
    mask = torch.tensor([_visible(p, t, causal, window, docs) for p in q_pos for t in k_pos],
                        dtype=torch.bool).reshape(len(q_pos), len(k_pos))
    h, hkv = q.shape[2], k.shape[2]
    kr, vr = (x.double().repeat_interleave(h // hkv, dim=2) for x in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q.double(), kr) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        column = sinks.double()[None, :, None, None].expand(s.shape[0], h, s.shape[2], 1)
        s = torch.cat([s, column], dim=-1)
        mask = torch.cat([mask, torch.ones(len(q_pos), 1, dtype=torch.bool)], dim=1)
    empty = ~mask.any(1)  # [sq]
    m = s.amax(-1, keepdim=True) if s.shape[-1] else s.new_zeros(*s.shape[:-1], 1)  # no key and no sink
    m = m.detach().masked_fill(empty[:, None], 0.0)
    e = torch.exp(s - m)
    tot = e.sum(-1, keepdim=True)
    tot_safe = torch.where(empty[:, None], torch.ones_like(tot), tot)
    out = torch.einsum("bhij,bjhd->bihd", (e / tot_safe)[..., :len(k_pos)], vr)
    lse = torch.where(empty, torch.full_like(tot[..., 0], float("-inf")), (m + torch.log(tot_safe))[..., 0])
    return out, lse
