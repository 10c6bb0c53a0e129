"""Work run on every spawned rank by tests/test_head_parallel.py (importable by spawned processes).

Ranks form a U x R grid: global rank `r·U + u` is rank u of head group r and rank r of ring group u
(head groups hold neighbouring ranks, as the GPUs of one node would). Every rank creates every group,
head groups first, in the same order (`grid`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import ringlse
from mask_oracle import oracle
from ringlse.testing import RESULT_NAMES, random_inputs

# (U, R) -> (ring group, head group) of this rank, made once per process (a pool's ranks run many cases)
_GRIDS: dict[tuple[int, int], tuple] = {}


def grid(heads_ranks: int, ring_ranks: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """`(ring group, head group)` of this rank in a U x R grid of the world."""
    key = (heads_ranks, ring_ranks)
    if key not in _GRIDS:
        rank, world = dist.get_rank(), dist.get_world_size()
        assert world == heads_ranks * ring_ranks, (world, key)
        heads = [dist.new_group([r * heads_ranks + u for u in range(heads_ranks)]) for r in range(ring_ranks)]
        rings = [dist.new_group([r * heads_ranks + u for r in range(ring_ranks)]) for u in range(heads_ranks)]
        _GRIDS[key] = (rings[rank % heads_ranks], heads[rank // heads_ranks])
    return _GRIDS[key]


def _close(name: str, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """float64: `assert_close`; float32 (GPU ranks): CONVENTIONS.md §7's `1e-3 · max|ref|`, -inf where the
    oracle has it."""
    if dtype == torch.float64:
        torch.testing.assert_close(a, b)
        return
    a = a.double().cpu()
    assert torch.equal(a.isneginf(), b.isneginf()), f"{name}: -inf entries differ"
    finite = torch.isfinite(b)
    err = (a[finite] - b[finite]).abs().max().item()
    bound = 1e-3 * b[finite].abs().max().item()
    assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e}"


def match_oracle(rank, world, case: dict) -> list[str]:
    """One head-parallel ring call, forward and backward (lse gradient, and sinks where the case has
    them), gathered and compared with the dense float64 oracle on the full sequence; returns the failures
    (rank 0 compares; d sinks are summed over every rank first). float64 on CPU ranks; with `cuda` the
    case's `dtype` on GPU `rank` (NCCL ranks)."""
    ring, head = grid(case["U"], case["R"])
    s, h, hkv, layout = case["s"], case["h"], case["hkv"], case["layout"]
    dtype = case.get("dtype", torch.float64)
    device = torch.device("cuda", rank) if case.get("cuda") else torch.device("cpu")
    q, k, v, dout, dlse = random_inputs(case.get("b", 1), s, h, hkv, case.get("d", 8), torch.float64,
                                        seed=case["seed"])
    sinks = torch.randn(h, dtype=torch.float64, generator=torch.Generator().manual_seed(9)) \
        if case.get("sinks") else None
    causal, window, docs = case.get("causal", False), case.get("window", (-1, -1)), case.get("docs")
    part = dict(group=ring, head_group=head)
    placed = dict(part, cu_seqlens=docs)  # the balanced layout places tokens by the documents
    local = [ringlse.shard(t.to(device, dtype), layout, **placed) for t in (q, k, v, dout)]
    leaves = [t.requires_grad_() for t in local[:3]]
    s_leaf = sinks.to(device, dtype).clone().requires_grad_() if sinks is not None else None
    with_lse = case.get("return_lse", True)  # without it only out is differentiated (and the sinks need the lse)
    got = ringlse.ring_attention(*leaves, causal=causal, layout=layout, window_size=window, cu_seqlens=docs,
                                 backend=case.get("backend", "torch"), return_lse=with_lse, sinks=s_leaf, **part)
    out, lse = got if with_lse else (got, None)
    loss = (out * local[3]).sum()
    if with_lse:
        assert lse.shape == (q.shape[0], h, s // world), lse.shape
        loss = loss + (lse.nan_to_num(neginf=0.0) * ringlse.shard(dlse.to(device, lse.dtype), layout, dim=2,
                                                                  **placed)).sum()
    assert out.shape == local[0].shape, out.shape
    loss.backward()
    pairs = ((out, 1), (lse, 2), (leaves[0].grad, 1), (leaves[1].grad, 1), (leaves[2].grad, 1))
    ours = [ringlse.unshard(t.detach(), layout, dim=dim, **placed) for t, dim in pairs if t is not None]
    names = [n for n in RESULT_NAMES if with_lse or n != "lse"]
    dlse = dlse if with_lse else torch.zeros_like(dlse)
    if sinks is not None:
        d_sinks = s_leaf.grad.clone()
        dist.all_reduce(d_sinks)  # each rank's part is its own rows' (as the plain ring's)
        ours.append(d_sinks)
        names.append("dsinks")
    if rank != 0:
        return []
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if
                                                                     sinks is not None else [])
    r_out, r_lse = oracle(*ref_leaves[:3], range(s), range(s), causal, window, docs,
                         sinks=ref_leaves[3] if sinks is not None else None)
    ((r_out * dout).sum() + (r_lse.nan_to_num(neginf=0.0) * dlse).sum()).backward()
    failures = []
    refs = [r_out, *([r_lse] if with_lse else []), *(t.grad for t in ref_leaves)]
    for name, a, b in zip(names, ours, refs):
        try:
            _close(name, a, b.detach(), dtype)
        except AssertionError as e:
            failures.append(f"{case}: {name}: {str(e).splitlines()[0]}")
    return failures


def refusal(rank, world, case: dict) -> dict:
    """What this rank raises for a call that must be refused on every rank (`case["bad"]`): heads that do
    not divide over U, or one rank's dtype; then whether a good call still works on the same groups."""
    ring, head = grid(case["U"], case["R"])
    h, hkv, n = case["h"], case["hkv"], 4
    dtype = torch.float32 if case["bad"] == "dtype" and rank == case.get("bad_rank", 1) else torch.float64
    q, k, v = torch.randn(1, n, h, 8, dtype=torch.float64), *(torch.randn(1, n, hkv, 8, dtype=dtype) for _ in range(2))
    try:
        ringlse.ring_attention(q, k, v, group=ring, head_group=head, backend="torch")
    except Exception as e:  # noqa: BLE001 - the type and text are the result
        got = dict(type=type(e).__name__, message=str(e))
    else:
        got = dict(type=None, message="")
    q, k, v = (torch.randn(1, n, 6, 8, dtype=torch.float64) for _ in range(3))
    out = ringlse.ring_attention(q, k, v, group=ring, head_group=head, backend="torch")
    got["after"] = tuple(out.shape)
    return got


def roundtrip(rank, world, grids: list[tuple[int, int]]) -> bool:
    """`unshard(shard(x)) == x` bit for bit for every layout, dims 1 and 2, in each U x R grid; and a
    rank's piece is the contiguous U-th of its ring part."""
    x = torch.randn(2, 4 * world, 3, 5, generator=torch.Generator().manual_seed(7))
    for heads_ranks, ring_ranks in grids:
        ring, head = grid(heads_ranks, ring_ranks)
        u = dist.get_rank(head)
        for layout in ringlse.ring.LAYOUTS:
            for dim in (1, 2) if layout != "zigzag" else (1,):
                y = x if dim == 1 else x.transpose(1, 2).contiguous()
                local = ringlse.shard(y, layout, dim=dim, group=ring, head_group=head)
                part = ringlse.shard(y, layout, dim=dim, group=ring)
                n = local.shape[dim]
                assert n * world == y.shape[dim]
                torch.testing.assert_close(local, part.narrow(dim, u * n, n), rtol=0, atol=0)
                back = ringlse.unshard(local, layout, dim=dim, group=ring, head_group=head)
                torch.testing.assert_close(back, y, rtol=0, atol=0)
    return True


def crossed_groups(rank, world) -> dict:
    """Groups that are no grid: head groups {0, 1}, {2, 3} but rings {0, 3}, {1, 2}, so the ranks of a
    ring hold different head blocks (ring {0, 3}: blocks 0 and 1): what each rank raises."""
    heads = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    rings = [dist.new_group([0, 3]), dist.new_group([1, 2])]
    head, ring = heads[rank // 2], rings[0 if rank in (0, 3) else 1]
    q = torch.randn(1, 4, 4, 8, dtype=torch.float64)
    try:
        ringlse.ring_attention(q, q, q, group=ring, head_group=head, backend="torch")
    except Exception as e:  # noqa: BLE001 - the type and text are the result
        return dict(type=type(e).__name__, message=str(e))
    return dict(type=None, message="")


def dead_rank(rank, world, victim: int, timeout: float) -> dict:
    """In a 2 x 2 grid rank `victim` exits before the call; what every survivor gets (`ring_workers._outcome`)."""
    import os

    from ring_workers import _outcome

    ring, head = grid(2, 2)
    q = torch.randn(1, 4, 4, 8, dtype=torch.float64, requires_grad=True)
    dist.barrier()  # everyone has joined every group before the victim goes
    if rank == victim:
        os._exit(0)
    return _outcome(lambda: ringlse.ring_attention(q, q, q, group=ring, head_group=head, backend="torch",
                                                   timeout=timeout).sum().backward())


def match_oracle_cases(rank, world, cases: list[dict]) -> list[str]:
    """`match_oracle` over several cases in one spawn (GPU ranks start slowly)."""
    return [f for case in cases for f in match_oracle(rank, world, case)]
