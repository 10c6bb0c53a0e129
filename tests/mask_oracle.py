"""A dense-mask oracle for windows and documents (CONVENTIONS.md §10), written pair by pair from the
rule, independently of ringlse (neither `ringlse.masks` nor `ringlse.reference`)."""

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


def oracle(q, k, v, q_pos, k_pos, causal, window, docs, sinks=None):
    """Softmax attention with the mask built pair by pair from the rule; `(out, lse)`, float64. With
    `sinks` `[h]` (GPT-OSS's eager attention): one more score column per row, the sink, whose
    probability is dropped after the softmax; the lse includes it."""
    mask = torch.tensor([_visible(p, t, causal, window, docs) for p in q_pos for t in k_pos],
                        dtype=torch.bool).reshape(len(q_pos), len(k_pos))
    h, hkv = q.shape[2], k.shape[2]
    kr, vr = (x.double().repeat_interleave(h // hkv, dim=2) for x in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q.double(), kr) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        column = sinks.double()[None, :, None, None].expand(s.shape[0], h, s.shape[2], 1)
        s = torch.cat([s, column], dim=-1)
        mask = torch.cat([mask, torch.ones(len(q_pos), 1, dtype=torch.bool)], dim=1)
    empty = ~mask.any(1)  # [sq]
    m = s.amax(-1, keepdim=True).detach().masked_fill(empty[:, None], 0.0)
    e = torch.exp(s - m)
    tot = e.sum(-1, keepdim=True)
    tot_safe = torch.where(empty[:, None], torch.ones_like(tot), tot)
    out = torch.einsum("bhij,bjhd->bihd", (e / tot_safe)[..., :len(k_pos)], vr)
    lse = torch.where(empty, torch.full_like(tot[..., 0], float("-inf")), (m + torch.log(tot_safe))[..., 0])
    return out, lse
