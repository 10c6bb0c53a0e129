"""torch.compile: `attention`, `block_attention`, `chunked_attention` and `ring_attention` compile with
fullgraph (one `torch.library` op per call: `ringlse.library`) and give the eager numbers, forward and
gradients. `aot_eager` runs the compiled graph with autograd through the ops' registered backward,
without spending CI time in a C++ compiler."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import compile_workers as cw
import ringlse
from dist_harness import run_ranks

EXACT = 1e-12  # float64, the same plan of block calls eager and compiled: equal up to summation order

CASES = [
    dict(fn="attention", kw=dict(causal=True), shape=(2, 37, 4, 2, 16)),
    dict(fn="attention", kw=dict(causal=True, window_size=(5, 0), cu_seqlens=[0, 10, 11, 37], return_lse=True),
         shape=(1, 37, 4, 2, 16)),
    dict(fn="block_attention", kw=dict(causal=True, q_start=40, k_start=31), shape=(1, 19, 2, 2, 80)),
    dict(fn="chunked_attention", kw=dict(causal=True, chunk_size=8, return_lse=True), shape=(1, 33, 3, 1, 16)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['fn']}-{'-'.join(c['kw'])}")
def test_compiled_single_device_equals_eager(case):
    b, s, h, hkv, d = case["shape"]
    torch.manual_seed(0)
    q = torch.randn(b, s, h, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, s, hkv, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    fn = getattr(ringlse, case["fn"])

    def run(q, k, v):
        res = fn(q, k, v, backend="torch", **case["kw"])
        outs = res if isinstance(res, tuple) else (res,)
        return outs

    def loss(outs):
        return sum(o.square().sum() if i == 0 else o.sum() for i, o in enumerate(outs))

    ref = run(q, k, v)
    ref_grads = torch.autograd.grad(loss(ref), (q, k, v))
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    got = torch.compile(run, backend=counter, fullgraph=True)(q, k, v)
    grads = torch.autograd.grad(loss(got), (q, k, v))
    assert counter.frame_count == 1
    for a, r in zip((*got, *grads), (*ref, *ref_grads)):
        assert a.shape == r.shape and a.dtype == r.dtype
        assert (a - r).abs().max().item() <= EXACT


def test_compiled_bad_input_raises_value_error():
    q = torch.randn(1, 8, 4, 16)
    with pytest.raises(ValueError, match="window"):
        torch.compile(lambda q: ringlse.attention(q, q, q, window_size=(-3, 0), backend="torch"),
                      backend="aot_eager", fullgraph=True)(q)


def test_ops_are_registered():
    for name in ("attend", "attend_backward", "ring", "ring_backward"):
        assert hasattr(torch.ops.ringlse, name)


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W{w}")
def test_compiled_ring_equals_eager(world, tmp_path):
    per_rank = run_ranks(cw.compiled_ring, world, tmp_path, timeout=300)
    for rank, r in enumerate(per_rank):
        for name in ("world", "subgroup"):
            assert r[name]["frames"] == 1, f"rank {rank} {name}: a graph break"
            assert r[name]["out"] <= EXACT and r[name]["grads"] <= EXACT, f"rank {rank} {name}: {r[name]}"
        assert "ranks disagree" in r["bad"] and "q shape" in r["bad"], r["bad"]
    assert len({r["bad"] for r in per_rank}) == 1  # the same message on every rank


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton", "sdpa"])
def test_compiled_attention_on_gpu_with_inductor(backend):
    """The op under inductor on CUDA: one graph, the eager numbers (the same kernels run)."""
    torch.manual_seed(0)
    q = torch.randn(2, 1025, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 1025, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))

    def run(q, k, v):
        return ringlse.attention(q * 1.0, k, v, causal=True, cu_seqlens=[0, 100, 1025], backend=backend)

    ref = run(q, k, v)
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    got = torch.compile(run, backend=counter, fullgraph=True)(q, k, v)
    grads = torch.autograd.grad(got.float().square().sum(), (q, k, v))
    assert counter.frame_count == 1
    assert torch.equal(got, ref)
    for a, b in zip(grads, ref_grads):
        assert (a.float() - b.float()).abs().max().item() <= 1e-2 * b.float().abs().max().item()
