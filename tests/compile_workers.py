"""Rank functions for tests/test_compile.py: `ring_attention` compiled with fullgraph on gloo ranks."""

from __future__ import annotations

import torch


def compiled_ring(rank: int, world: int) -> dict:
    """Max abs differences compiled vs eager (out, lse, grads) of a ring over the world and over a
    subgroup (found by name inside the op), and the number of graphs dynamo made."""
    import torch._dynamo
    import torch._dynamo.testing
    import torch.distributed as dist

    import ringlse

    torch.manual_seed(rank)
    sub = dist.new_group(list(range(world)))
    q, k, v = (torch.randn(1, 2 * 7, 4, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    k2, v2 = k[:, :, :2].detach().requires_grad_(), v[:, :, :2].detach().requires_grad_()  # GQA 4/2
    docs = [0, 5, 6, 2 * 7 * world]

    def step(q, k, v, group):
        out, lse = ringlse.ring_attention(q, k, v, causal=True, group=group, cu_seqlens=docs, window_size=(9, 0),
                                          return_lse=True, backend="torch")
        return out, lse

    result = {}
    for name, group, kk, vv in (("world", None, k, v), ("subgroup", sub, k2, v2)):
        ref = step(q, kk, vv, group)
        ref_grads = torch.autograd.grad(ref[0].square().sum() + ref[1].sum(), (q, kk, vv))
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        got = torch.compile(step, backend=counter, fullgraph=True)(q, kk, vv, group)
        grads = torch.autograd.grad(got[0].square().sum() + got[1].sum(), (q, kk, vv))
        result[name] = dict(
            out=max((a - b).abs().max().item() for a, b in zip(got, ref)),
            grads=max((a - b).abs().max().item() for a, b in zip(grads, ref_grads)),
            frames=counter.frame_count)
    # bad input under compile: the op raises the same ValueError on every rank at run time
    bad = torch.randn(1, 2 * 7, 4, 16 if rank == 0 else 8, dtype=torch.float64)
    try:
        torch.compile(step, backend="aot_eager", fullgraph=True)(bad, bad, bad, None)
        result["bad"] = "no error"
    except ValueError as e:
        result["bad"] = str(e)
    return result


def compiled_ring_gpu(rank: int, world: int, backend: str) -> dict:
    """Compiled (inductor) vs eager ring on NCCL, bf16: the forward's difference, the gradients'
    difference and eager's own run-to-run gradient spread."""
    import torch._dynamo
    import torch._dynamo.testing

    import ringlse

    torch.manual_seed(rank)
    q, k, v = (torch.randn(1, 2048, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)

    def step(q, k, v):
        return ringlse.ring_attention(q, k, v, causal=True, backend=backend)

    def grads(out):
        return torch.autograd.grad(out, (q, k, v), dout)

    ref = step(q, k, v)
    eager = [grads(ref), grads(step(q, k, v))]
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    got = torch.compile(step, backend=counter, fullgraph=True)(q, k, v)
    compiled = grads(got)

    def diff(xs, ys):
        return max((a.float() - b.float()).abs().max().item() for a, b in zip(xs, ys))

    return dict(frames=counter.frame_count, out=(got.float() - ref.float()).abs().max().item(),
                grads=diff(compiled, eager[0]), spread=diff(eager[0], eager[1]))


def compiled_head_parallel(rank: int, world: int) -> dict:
    """`ring_attention(head_group=)` compiled (aot_eager, graph breaks allowed: its all-to-alls are
    collectives outside the ring's custom op) against eager on a 2 x 2 grid: max abs differences of out,
    lse and the gradients."""
    import torch._dynamo

    import ringlse
    from head_parallel_workers import grid

    ring, head = grid(2, 2)
    torch.manual_seed(rank)
    q, k, v = (torch.randn(1, 6, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    docs = [0, 5, 9, 6 * world]

    def step(q, k, v):
        return ringlse.ring_attention(q, k, v, causal=True, group=ring, head_group=head, cu_seqlens=docs,
                                      return_lse=True, backend="torch")

    ref = step(q, k, v)
    ref_grads = torch.autograd.grad(ref[0].square().sum() + ref[1].sum(), (q, k, v))
    torch._dynamo.reset()
    got = torch.compile(step, backend="aot_eager")(q, k, v)
    grads = torch.autograd.grad(got[0].square().sum() + got[1].sum(), (q, k, v))
    return dict(out=max((a - b).abs().max().item() for a, b in zip(got, ref)),
                grads=max((a - b).abs().max().item() for a, b in zip(grads, ref_grads)))
