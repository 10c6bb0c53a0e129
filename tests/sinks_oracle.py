"""A dense oracle for attention with sinks, written from the definition (GPT-OSS's eager attention: the
sink logit is one more column of every row's scores, its probability dropped), independently of
ringlse: the mask pair by pair (`mask_oracle._visible`), then one softmax over scores and sink."""

from __future__ import annotations

import math

import torch

from mask_oracle import _visible


def sink_oracle(q, k, v, q_pos, k_pos, causal, window, docs, sinks):
    """`(out, lse)` float64 with sinks `[h]` (the lse includes the sink)."""
    mask = torch.tensor([_visible(p, t, causal, window, docs) for p in q_pos for t in k_pos],
                        dtype=torch.bool).reshape(len(q_pos), len(k_pos))
    h, hkv = q.shape[2], k.shape[2]
    kr, vr = (x.double().repeat_interleave(h // hkv, dim=2) for x in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q.double(), kr) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask, float("-inf"))
    column = sinks.double()[None, :, None, None].expand(s.shape[0], h, s.shape[2], 1)
    full = torch.cat([s, column], dim=-1)
    m = full.amax(-1, keepdim=True).detach()
    e = torch.exp(full - m)
    tot = e.sum(-1, keepdim=True)
    out = torch.einsum("bhij,bjhd->bihd", e[..., :-1] / tot, vr)
    return out, (m + torch.log(tot))[..., 0]
