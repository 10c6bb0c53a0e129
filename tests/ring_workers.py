"""Work run on every spawned rank by the ring tests (importable by spawned processes).

Each function builds the same full random inputs on every rank (same seed), shards them, runs the ring
forward and backward, gathers, and on rank 0 compares with the float64 reference on the full sequence.
"""

from __future__ import annotations

import torch

import ringlse
from ringlse.testing import judge, naive_attention


def _full_inputs(b, s, h, hkv, d, dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, s, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, s, hkv, d, generator=gen, dtype=torch.float64)
    dout = torch.randn(b, s, h, d, generator=gen, dtype=torch.float64)
    dlse = torch.randn(b, h, s, generator=gen, dtype=torch.float64)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)] + [dlse.to(device)]


def ring_run(q, k, v, dout, dlse, *, causal, layout, backend="torch", non_contiguous=False, use_lse_grad=False):
    """Shard, ring forward+backward, gather. Returns full (out, lse, dq, dk, dv)."""
    local = [ringlse.shard(t, layout) for t in (q, k, v, dout)]
    if non_contiguous:  # a [b, h, n, d] storage seen as [b, n, h, d]: strided inputs must work
        local[:3] = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in local[:3]]
    ql, kl, vl = (t.detach().requires_grad_() for t in local[:3])
    out, lse = ringlse.ring_attention(ql, kl, vl, causal=causal, layout=layout, return_lse=True, backend=backend)
    loss = (out.float() * local[3].float()).sum() if out.dtype != torch.float64 else (out * local[3]).sum()
    if use_lse_grad:
        loss = loss + (lse * ringlse.shard(dlse, layout, dim=2).to(lse.dtype)).sum()
    loss.backward()
    gather = lambda t, dim=1: ringlse.unshard(t.detach(), layout, dim=dim)
    return gather(out), gather(lse, 2), gather(ql.grad), gather(kl.grad), gather(vl.grad)


def reference_run(q, k, v, dout, dlse, *, causal, use_lse_grad=False, naive=False):
    """Full-sequence (out, lse, dq, dk, dv): float64 reference, or the naive in-dtype baseline."""
    # the reference sees float64 leaves, so its out and grads are not rounded back to the input dtype
    leaves = [(t.detach().clone() if naive else t.detach().double()).requires_grad_() for t in (q, k, v)]
    fn = naive_attention if naive else ringlse.reference_attention
    out, lse = fn(*leaves, causal=causal, q_start=0, k_start=0)
    loss = (out.double() * dout.double()).sum()
    if use_lse_grad:
        loss = loss + (lse.double() * dlse.double()).sum()
    loss.backward()
    return out.detach(), lse.detach(), *(t.grad for t in leaves)


NAMES = ("out", "lse", "dq", "dk", "dv")


def check_case(rank, world, case: dict) -> dict | None:
    """Run one case; rank 0 returns {'max_err': {...}, 'verdicts': [...]} (float64 cases assert_close)."""
    dtype = case["dtype"]
    q, k, v, dout, dlse = _full_inputs(case["b"], case["s"], case["h"], case["hkv"], case["d"], dtype, case["seed"])
    use_lse_grad = dtype == torch.float64
    ours = ring_run(q, k, v, dout, dlse, causal=case["causal"], layout=case["layout"],
                    non_contiguous=case.get("non_contiguous", False), use_lse_grad=use_lse_grad)
    if rank != 0:
        return None
    ref = reference_run(q, k, v, dout, dlse, causal=case["causal"], use_lse_grad=use_lse_grad)
    result = {"max_err": {}, "verdicts": []}
    if dtype == torch.float64:
        for name, a, b in zip(NAMES, ours, ref):
            torch.testing.assert_close(a, b, msg=lambda m: f"{name} {case}: {m}")
            result["max_err"][name] = (a - b).nan_to_num(0.0).abs().max().item()
        return result
    base = reference_run(q, k, v, dout, dlse, causal=case["causal"], naive=True)
    for name, a, r, bl in zip(NAMES, ours, ref, base):
        vd = judge(name, a, r, bl, dtype, is_lse=name == "lse")
        result["verdicts"].append((vd.name, vd.ok, str(vd)))
        result["max_err"][name] = vd.max_err
    return result


def battery(rank, world, cases: list[dict]) -> list:
    return [check_case(rank, world, c) for c in cases]


def expect_value_errors(rank, world, layout_bad_n: int) -> list[tuple[str, bool, str]]:
    """Each bad input must raise ValueError on every rank (and then the group still works)."""
    results = []

    def attempt(name, fn):
        try:
            fn()
        except ValueError as e:
            results.append((name, True, str(e)))
        else:
            results.append((name, False, "no error"))

    r = torch.randn
    # length that does not divide: zigzag needs an even local length
    attempt("zigzag odd local length", lambda: ringlse.ring_attention(
        r(1, layout_bad_n, 2, 8), r(1, layout_bad_n, 2, 8), r(1, layout_bad_n, 2, 8), causal=True, layout="zigzag"))
    attempt("dtype mismatch", lambda: ringlse.ring_attention(
        r(1, 4, 2, 8), r(1, 4, 2, 8, dtype=torch.float64), r(1, 4, 2, 8)))
    attempt("heads not divisible", lambda: ringlse.ring_attention(r(1, 4, 6, 8), r(1, 4, 4, 8), r(1, 4, 4, 8)))
    attempt("unknown layout", lambda: ringlse.ring_attention(r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8), layout="spiral"))
    attempt("unknown backend", lambda: ringlse.ring_attention(r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8), backend="nope"))
    # only rank 1 (or 0 for W=1) is wrong: the others must not hang in the ring
    bad_rank = min(1, world - 1)
    kd = torch.float16 if rank == bad_rank else torch.float32
    attempt("one rank bad dtype", lambda: ringlse.ring_attention(r(1, 4, 2, 8), r(1, 4, 2, 8).to(kd), r(1, 4, 2, 8).to(kd)))
    if world > 1:
        n = 8 if rank == 0 else 4
        attempt("ranks disagree on length", lambda: ringlse.ring_attention(r(1, n, 2, 8), r(1, n, 2, 8), r(1, n, 2, 8)))
        attempt("ranks disagree on causal", lambda: ringlse.ring_attention(
            r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8), causal=rank == 0, layout="contiguous"))
    attempt("shard length not divisible", lambda: ringlse.shard(r(1, 2 * world + 1, 2, 8), "zigzag"))
    # the group is still usable after all that
    x = torch.full((1,), float(rank))
    torch.distributed.all_reduce(x)
    results.append(("group usable after errors", x.item() == world * (world - 1) / 2, str(x.item())))
    return results


def shard_roundtrip(rank, world) -> bool:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 4 * world, 3, 5, generator=gen)
    for layout in ringlse.layouts.LAYOUTS:
        for dim in (1, 2) if layout != "zigzag" else (1,):
            y = x if dim == 1 else x.transpose(1, 2).contiguous()
            local = ringlse.shard(y, layout, dim=dim)
            assert local.shape[dim] == y.shape[dim] // world
            torch.testing.assert_close(ringlse.unshard(local, layout, dim=dim), y, rtol=0, atol=0)
    return True
