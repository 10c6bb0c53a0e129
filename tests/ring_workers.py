"""Work run on every spawned rank by the ring tests (importable by spawned processes).

Each function builds the same full random inputs on every rank (same seed), shards them, runs the ring
forward and backward, gathers, and on rank 0 compares with the float64 reference on the full sequence.
"""

from __future__ import annotations

import torch

import ringlse
from ringlse.testing import RESULT_NAMES as NAMES
from ringlse.testing import attention_with_grads, judge_all, random_inputs, ring_with_grads


GROWTH_BAR = 1.25  # CONVENTIONS.md §7: the error at W = 4 at most 1.25x the error at W = 1


def growth_failures(many: dict, one: dict, world: int) -> list[str]:
    """What breaks CONVENTIONS.md §7 between rank 0's results of one case at W = `world` and at W = 1: a result
    outside its bound at either size, or an RMS error more than `GROWTH_BAR` times W = 1's (RMS, not
    max: see the module docstring of `ringlse.testing`). Max errors are shown alongside."""
    bad = [f"W={w}: {text}" for w, r in ((world, many), (1, one)) for _, ok, text in r["verdicts"] if not ok]
    for name in NAMES:
        a, b = many["rms_err"][name], one["rms_err"][name]
        # + 1e-6: a float32 lse of ~8 is rounded by up to 5e-7; errors at that level are no growth
        if a > GROWTH_BAR * b + 1e-6:
            bad.append(f"{name}: rms W={world} {a:.3e} vs W=1 {b:.3e} ({a / b:.3f}x); max {many['max_err'][name]:.3e} "
                       f"vs {one['max_err'][name]:.3e}")
    return bad


def check_case(rank, world, case: dict) -> dict | None:
    """Run one case; rank 0 returns {'max_err': {...}, 'rms_err': {...}, 'verdicts': [...]} (float64 cases
    assert_close).

    On an NCCL group the inputs live on this rank's GPU and `case["backend"]` picks the block op."""
    dtype = case["dtype"]
    nccl = torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    q, k, v, dout, dlse = random_inputs(case["b"], case["s"], case["h"], case["hkv"], case["d"], dtype, case["seed"], device)
    # the lse gradient is exercised where exactness is checked (float64), unless a case says otherwise;
    # without one the differentiated call returns out alone (bf16 gradient messages for `sdpa`)
    with_dlse = case.get("lse_grad", dtype == torch.float64)
    dlse = dlse if with_dlse else None
    backend = case.get("backend", "torch")
    if backend == "sdpa_cpu":  # the sdpa op's CPU kernels: the parts path of the ring without a GPU
        from ringlse.blocks.sdpa import SDPA_BLOCK_OP as backend
    ours = ring_with_grads(q, k, v, dout, dlse, causal=case["causal"], layout=case["layout"], backend=backend,
                           non_contiguous=case.get("non_contiguous", False),
                           return_lse=case.get("return_lse", with_dlse))
    if rank != 0:
        return None
    result = {"max_err": {}, "rms_err": {}, "verdicts": []}
    if dtype == torch.float64:
        ref = attention_with_grads(ringlse.reference_attention, q, k, v, dout, dlse, upcast=True,
                                   causal=case["causal"], q_start=0, k_start=0)
        for name, a, b in zip(NAMES, ours, ref):
            torch.testing.assert_close(a, b, msg=lambda m: f"{name} {case}: {m}")
            diff = (a - b).nan_to_num(0.0).abs()
            result["max_err"][name] = diff.max().item()
            result["rms_err"][name] = diff.square().mean().sqrt().item()
        return result
    for vd in judge_all(ours, q, k, v, dout, causal=case["causal"]):
        result["verdicts"].append((vd.name, vd.ok, str(vd)))
        result["max_err"][vd.name] = vd.max_err
        result["rms_err"][vd.name] = vd.rms_err
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

    # CUDA tensors on an NCCL group (rank r on GPU r), CPU tensors on gloo
    device = f"cuda:{torch.cuda.current_device()}" if torch.distributed.get_backend() == "nccl" else "cpu"

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, dtype=dtype, device=device)
    # length that does not divide: zigzag needs an even local length
    attempt("zigzag odd local length", lambda: ringlse.ring_attention(
        r(1, layout_bad_n, 2, 8), r(1, layout_bad_n, 2, 8), r(1, layout_bad_n, 2, 8), causal=True, layout="zigzag"))
    attempt("dtype mismatch", lambda: ringlse.ring_attention(
        r(1, 4, 2, 8), r(1, 4, 2, 8, dtype=torch.float64), r(1, 4, 2, 8)))
    attempt("heads not divisible", lambda: ringlse.ring_attention(r(1, 4, 6, 8), r(1, 4, 4, 8), r(1, 4, 4, 8)))
    attempt("unknown layout", lambda: ringlse.ring_attention(r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8), layout="spiral"))
    attempt("window below -1", lambda: ringlse.ring_attention(
        r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8), window_size=(-3, 0)))
    attempt("documents not ending at S", lambda: ringlse.ring_attention(
        r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8), cu_seqlens=[0, 4 * world - 1]))
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
        docs = [0, 2, 4 * world] if rank == 0 else [0, 3, 4 * world]
        attempt("ranks disagree on documents", lambda: ringlse.ring_attention(
            r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8), causal=True, layout="stripe", cu_seqlens=docs,
            backend="torch"))
    attempt("shard length not divisible", lambda: ringlse.shard(r(1, 2 * world + 1, 2, 8), "zigzag"))
    # the group is still usable after all that
    x = torch.full((1,), float(rank), device=device)
    torch.distributed.all_reduce(x)
    results.append(("group usable after errors", x.item() == world * (world - 1) / 2, str(x.item())))
    return results


def shard_roundtrip(rank, world) -> bool:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 4 * world, 3, 5, generator=gen)
    for layout in ringlse.ring.LAYOUTS:
        for dim in (1, 2) if layout != "zigzag" else (1,):
            y = x if dim == 1 else x.transpose(1, 2).contiguous()
            local = ringlse.shard(y, layout, dim=dim)
            assert local.shape[dim] == y.shape[dim] // world
            torch.testing.assert_close(ringlse.unshard(local, layout, dim=dim), y, rtol=0, atol=0)
    return True


def subgroup_rings(rank, world) -> bool:
    """Two independent rings over the sub-groups {0, 2} and {1, 3}: point-to-point peers are the
    group's neighbours mapped to global ranks, and each ring is exact (float64)."""
    dist = torch.distributed
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group
    group = groups[rank % 2]
    q, k, v, dout, dlse = random_inputs(1, 24, 4, 2, 16, torch.float64, seed=40 + rank % 2)
    for causal, layout in ((True, "zigzag"), (False, "stripe")):
        ours = ring_with_grads(q, k, v, dout, dlse, causal=causal, layout=layout, backend="torch", group=group)
        ref = attention_with_grads(ringlse.reference_attention, q, k, v, dout, dlse, upcast=True,
                                   causal=causal, q_start=0, k_start=0)
        for name, a, b in zip(NAMES, ours, ref):
            torch.testing.assert_close(a, b, msg=lambda m: f"rank {rank} {name} {layout}: {m}")
    return True


def nan_inputs_finish(rank, world) -> bool:
    """NaN/inf inputs are the caller's problem, but every rank must still get through the ring."""
    q, k, v = (torch.randn(1, 8, 2, 8) for _ in range(3))
    if rank == 0:
        q[0, 0, 0, 0] = float("nan")
        k[0, 1, 1, 1] = float("inf")
    out = ringlse.ring_attention(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), causal=True)
    out.sum().backward()
    return True


def masked_rings(rank, world, cases: list[dict]) -> list[str]:
    """Rings with windows and documents (global boundaries crossing ranks) against the dense-mask
    oracle, float64, forward and backward; returns the failures."""
    from mask_oracle import oracle

    failures = []
    for c in cases:
        s = c["s"]
        q, k, v, dout, dlse = random_inputs(1, s, 4, 2, 8, torch.float64, seed=c["seed"])
        kw = dict(causal=c["causal"], window_size=c["window"], cu_seqlens=c["docs"])
        local = [ringlse.shard(t, c["layout"]) for t in (q, k, v, dout)]
        ql, kl, vl = (t.detach().requires_grad_() for t in local[:3])
        out, lse = ringlse.ring_attention(ql, kl, vl, layout=c["layout"], return_lse=True, backend="torch", **kw)
        loss = (out * local[3]).sum() + (lse.nan_to_num(neginf=0.0) * ringlse.shard(dlse, c["layout"], dim=2)).sum()
        loss.backward()
        ours = [ringlse.unshard(t.detach(), c["layout"], dim=d)
                for t, d in ((out, 1), (lse, 2), (ql.grad, 1), (kl.grad, 1), (vl.grad, 1))]
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        r_out, r_lse = oracle(*leaves, range(s), range(s), c["causal"], c["window"], c["docs"])
        ((r_out * dout).sum() + (r_lse.nan_to_num(neginf=0.0) * dlse).sum()).backward()
        for name, a, b in zip(NAMES, ours, [r_out, r_lse, *(t.grad for t in leaves)]):
            try:
                torch.testing.assert_close(a, b.detach())
            except AssertionError as e:
                failures.append(f"rank {rank} {c}: {name}: {str(e).splitlines()[0]}")
    return failures
