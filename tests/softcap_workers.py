"""The oracle of tests/test_softcap_dv.py (logit softcapping, a V head dim of its own) and its gloo ring
workers (spawned by `dist_harness.run_ranks`).

The oracle is `mask_oracle.oracle`, written independently of ringlse: float64 scores `scale * q.k` (scale
`d_qk ** -0.5` by default), capped to `softcap * tanh(s / softcap)`, masked pair by pair from global
positions (causal, window `(left, right)`, documents), softmax with the natural-log lse over the capped
scores; a row that sees no key gives out 0 and lse -inf, and nothing NaN backward.
"""

from __future__ import annotations

import torch

import mask_oracle
import ringlse
from ring_workers import _outcome
from ringlse.testing import random_inputs


def oracle(q, k, v, q_pos, k_pos, *, causal=False, window=(-1, -1), docs=None, softcap=0.0, scale=None):
    """`(out, lse)` of `[b, sq, h, d]`, `[b, sk, hkv, d]`, `[b, sk, hkv, dv]` at global positions: the one
    oracle of masks, sinks and softcap (`mask_oracle.oracle`), with its options as keywords."""
    return mask_oracle.oracle(q, k, v, q_pos, k_pos, causal, window, docs, softcap=softcap, scale=scale)


def ring_cases(rank, world, cases: list[dict]) -> list[str]:
    """Softcapped rings (gloo, float64, torch block op) against the oracle, forward and backward, every
    layout; returns the failures."""
    failures = []
    for c in cases:
        s = c["s"]
        q, k, v, dout, dlse = random_inputs(1, s, 4, 2, 8, torch.float64, seed=c["seed"])
        kw = dict(causal=c["causal"], window_size=c.get("window", (-1, -1)), cu_seqlens=c.get("docs"),
                  softcap=c["softcap"])
        local = [ringlse.shard(t, c["layout"]) for t in (q, k, v, dout)]
        ql, kl, vl = (t.detach().requires_grad_() for t in local[:3])
        out, lse = ringlse.ring_attention(ql, kl, vl, layout=c["layout"], return_lse=True, backend="torch", **kw)
        loss = (out * local[3]).sum() + (lse.nan_to_num(neginf=0.0) * ringlse.shard(dlse, c["layout"], dim=2)).sum()
        loss.backward()
        ours = [ringlse.unshard(t.detach(), c["layout"], dim=d)
                for t, d in ((out, 1), (lse, 2), (ql.grad, 1), (kl.grad, 1), (vl.grad, 1))]
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        r_out, r_lse = oracle(*leaves, range(s), range(s), causal=c["causal"], window=c.get("window", (-1, -1)),
                              docs=c.get("docs"), softcap=c["softcap"])
        ((r_out * dout).sum() + (r_lse.nan_to_num(neginf=0.0) * dlse).sum()).backward()
        for name, a, r in zip(("out", "lse", "dq", "dk", "dv"), ours, [r_out, r_lse, *(t.grad for t in leaves)]):
            try:
                torch.testing.assert_close(a, r.detach())
            except AssertionError as e:
                failures.append(f"rank {rank} {c}: {name}: {str(e).splitlines()[0]}")
    return failures


def ring_refusals(rank, world) -> list[str]:
    """The messages every rank gets for a backend without softcap, a V head dim of its own, a negative
    softcap and ranks that disagree on softcap (none may hang)."""
    from ringlse.blocks.sdpa import SDPA_BLOCK_OP

    q = torch.randn(1, 4, 2, 8)
    v16 = torch.randn(1, 4, 2, 16)
    calls = (dict(softcap=2.0, backend=SDPA_BLOCK_OP), dict(v=v16, backend=SDPA_BLOCK_OP), dict(softcap=-1.0),
             dict(softcap=1.0 + rank))
    outcomes = [_outcome(ringlse.ring_attention, q, q, kw.pop("v", q), **kw) for kw in calls]
    return [o.get("message", "no error") for o in outcomes]
