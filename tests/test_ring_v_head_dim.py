"""A V head dim other than Q/K's (DeepSeek-style MLA: q, k `[..., d_qk]`, v and out `[..., d_v]`) through
the ring (issue 54): gloo rings of W = 1..4, every layout, causal / window / documents, GQA and MQA,
sinks and softcap, forward and backward (dq, dk, dv, d sinks), against the float64 oracles written
independently of ringlse (`mask_oracle.oracle`, with sinks and softcap).

Backend `torch` in float64 (exact: `assert_close`'s float64 defaults), and `triton` under the CPU
interpreter in float32 (CONVENTIONS.md §7's float32 bound, `1e-3 * max|ref|`). The shapes are small and
awkward (d_qk 24, d_v 16) and cover each K/V transport a gloo ring has: whole blocks from neighbour to
neighbour (no mask but causal), rows straight from owner to reader (short windows), a batch of two
sequences (one message per K/V and sequence), and from W = 3 a step's dk/dv sent home in pieces of keys
(72 local keys, cut at 64)."""

from __future__ import annotations

import pytest
import torch

import ringlse
from dist_harness import run_ranks
from mask_oracle import oracle

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Triton interpreter's

F64 = torch.float64
NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")


def _inputs(c: dict, s: int):
    """Full `q, k, v, dout, dlse, sinks` of case `c` over `s` tokens (float64; the same on every rank)."""
    g = torch.Generator().manual_seed(c["seed"])
    b, h, hkv, d, dv = c["b"], c["h"], c["hkv"], c["d"], c["dv"]
    shapes = ((b, s, h, d), (b, s, hkv, d), (b, s, hkv, dv), (b, s, h, dv), (b, h, s), (h,))
    q, k, v, dout, dlse, sinks = (torch.randn(shape, generator=g, dtype=F64) for shape in shapes)
    return q * 1.5, k, v, dout, dlse, sinks * 2


def _loss(out, lse, dout, dlse):
    return (out.double() * dout).sum() + (lse.double().nan_to_num(neginf=0.0) * dlse).sum()


def _reference(c: dict, s: int, q, k, v, dout, dlse, sinks) -> list[torch.Tensor]:
    """`out, lse, dq, dk, dv[, d sinks]` of the oracle over the whole sequence."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = oracle(*leaves[:3], range(s), range(s), c["causal"], c["window"], c["docs"],
                      sinks=leaves[3] if c["sinks"] else None, softcap=c["softcap"])
    _loss(out, lse, dout, dlse).backward()
    grads = [t.grad for t in leaves[:3]] + ([leaves[3].grad] if c["sinks"] else [])
    return [out.detach(), lse.detach(), *grads]


def ring_cases(rank: int, world: int, cases: list[dict]) -> list[str]:
    """Each case as a ring on this rank against the oracle (on every rank); returns the failures."""
    import torch.distributed as dist

    failures = []
    for c in cases:
        s, layout, dtype = c["n"] * world, c["layout"], c["dtype"]
        q, k, v, dout, dlse, sinks = _inputs(c, s)
        local = [ringlse.shard(t, layout).to(dtype) for t in (q, k, v)]
        leaves = [t.requires_grad_() for t in local] + ([sinks.to(dtype).requires_grad_()] if c["sinks"] else [])
        out, lse = ringlse.ring_attention(
            *leaves[:3], causal=c["causal"], layout=layout, window_size=c["window"], cu_seqlens=c["docs"],
            softcap=c["softcap"], sinks=leaves[3] if c["sinks"] else None, backend=c["backend"], return_lse=True)
        _loss(out, lse, ringlse.shard(dout, layout), ringlse.shard(dlse, layout, dim=2)).backward()
        ours = [ringlse.unshard(t.detach().double(), layout, dim=dim)
                for t, dim in ((out, 1), (lse, 2), (leaves[0].grad, 1), (leaves[1].grad, 1), (leaves[2].grad, 1))]
        if c["sinks"]:
            d_sinks = leaves[3].grad.double()
            dist.all_reduce(d_sinks)  # each rank's rows' part
            ours.append(d_sinks)
        ref = _reference(c, s, q, k, v, dout, dlse, sinks)
        for name, a, r in zip(NAMES, ours, ref):
            if a.shape != r.shape:
                failures.append(f"rank {rank} {c['id']}: {name}: shape {tuple(a.shape)} != {tuple(r.shape)}")
            elif dtype == F64:
                try:
                    torch.testing.assert_close(a, r)
                except AssertionError as e:
                    failures.append(f"rank {rank} {c['id']}: {name}: {str(e).splitlines()[0]}")
            else:  # CONVENTIONS.md §7, float32: max|ours - ref| <= 1e-3 max|ref|, -inf where the oracle has it
                finite = torch.isfinite(r)
                err = (a[finite] - r[finite]).abs().max()
                bound = 1e-3 * r[finite].abs().max()
                if not (err <= bound and torch.equal(a.isneginf(), r.isneginf())):
                    failures.append(f"rank {rank} {c['id']}: {name}: max error {float(err):.3e} > {float(bound):.3e}")
    return failures


def _case(id_, layout, causal, window=(-1, -1), docs=None, *, n, sinks=False, softcap=0.0, b=1, h=4, hkv=2,
          d=24, dv=16, backend="torch", dtype=F64, seed=0) -> dict:
    return dict(id=id_, layout=layout, causal=causal, window=window, docs=docs, n=n, sinks=sinks, softcap=softcap,
                b=b, h=h, hkv=hkv, d=d, dv=dv, backend=backend, dtype=dtype, seed=seed)


def cases_for(world: int) -> list[dict]:
    """The cases of a ring of `world` ranks: every layout and mask, cheapest first (local lengths even for
    zigzag; documents and windows crossing shard boundaries)."""
    n = 6
    s = n * world
    cases = [
        _case("zigzag-causal-sinks", "zigzag", True, n=n, sinks=True, seed=1),
        _case("contiguous-documents-b2", "contiguous", False, docs=[0, 5, s], n=n, b=2, seed=2),
        _case("stripe-window-documents-sinks", "stripe", True, (3, 0), [0, 1, s // 2 + 1, s], n=n, sinks=True,
              seed=3),
        _case("contiguous-window-mqa-b2-sinks", "contiguous", True, (2, 0), n=n, b=2, hkv=1, sinks=True, seed=4),
        _case("zigzag-window-documents", "zigzag", False, (2, 3), [0, s // 2 + 1, s], n=n, seed=5),
        _case("stripe-softcap", "stripe", True, n=n, softcap=0.8, d=12, dv=20, seed=6),
    ]
    if world >= 3:  # dk/dv in pieces of keys (72 local keys: cut at 64)
        cases.append(_case("zigzag-causal-pieces-sinks", "zigzag", True, n=72, h=2, hkv=1, d=12, dv=8, sinks=True,
                           seed=7))
    return cases


@pytest.mark.parametrize("world", [1, 2, 3, 4], ids=lambda w: f"W{w}")
def test_ring_matches_the_oracle(world, tmp_path):
    import test_ring_v_head_dim  # the spawned ranks import the workers by this name

    failures = [f for fs in run_ranks(test_ring_v_head_dim.ring_cases, world, tmp_path, cases_for(world),
                                      timeout=240) for f in fs]
    assert not failures, "\n".join(failures[:10])


# the triton block op under the CPU interpreter, float32 (its bf16 dot is wrong there: CONVENTIONS.md §7)
TRITON_CASES = [
    _case("triton-zigzag-causal-sinks", "zigzag", True, n=8, h=2, hkv=1, sinks=True, backend="triton",
          dtype=torch.float32, seed=8),
    _case("triton-contiguous-window-documents", "contiguous", True, (3, 0), [0, 5, 16], n=8, h=2, hkv=1,
          backend="triton", dtype=torch.float32, seed=9),
]


def test_triton_ring_matches_the_oracle(tmp_path):
    pytest.importorskip("triton")
    import test_ring_v_head_dim

    failures = [f for fs in run_ranks(test_ring_v_head_dim.ring_cases, 2, tmp_path, TRITON_CASES, timeout=240)
                for f in fs]
    assert not failures, "\n".join(failures[:10])

