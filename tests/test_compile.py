"""torch.compile: `attention`, `block_attention`, `chunked_attention`, `varlen_attention` and
`ring_attention` compile with fullgraph (one autograd.Function over one `torch.library` op per call,
`ringlse.ops`, the path eager calls take too) and give the eager results bit for bit, forward and
gradients. `aot_eager` runs the compiled graph without spending CI time in a C++ compiler; one case
runs under inductor."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import compile_workers as cw
import ringlse
from dist_harness import run_ranks

EXACT = 0.0  # the same op and the same plan of block calls, eager and compiled: bit for bit

CASES = [
    dict(fn="attention", kw=dict(causal=True), shape=(2, 37, 4, 2, 16)),
    dict(fn="attention", kw=dict(causal=True, window_size=(5, 0), cu_seqlens=[0, 10, 11, 37], return_lse=True),
         shape=(1, 37, 4, 2, 16)),
    dict(fn="block_attention", kw=dict(causal=True, q_start=40, k_start=31), shape=(1, 19, 2, 2, 80)),
    dict(fn="chunked_attention", kw=dict(causal=True, chunk_size=8, return_lse=True), shape=(1, 33, 3, 1, 16)),
    dict(fn="attention", kw=dict(causal=True, cu_seqlens=[0, 20, 37], backend="triton"), shape=(1, 37, 2, 1, 16),
         dtype=torch.float32),
    dict(fn="attention", kw=dict(causal=True), shape=(1, 29, 2, 2, 16), compiler="inductor"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join([c["fn"], *c["kw"], c.get("compiler", "")]))
def test_compiled_single_device_equals_eager(case):
    b, s, h, hkv, d = case["shape"]
    dtype = case.get("dtype", torch.float64)
    torch.manual_seed(0)
    q = torch.randn(b, s, h, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, s, hkv, d, dtype=dtype, requires_grad=True) for _ in range(2))
    fn = getattr(ringlse, case["fn"])
    kw = {"backend": "torch", **case["kw"]}

    def run(q, k, v):
        res = fn(q, k, v, **kw)
        outs = res if isinstance(res, tuple) else (res,)
        return outs

    def loss(outs):
        return sum(o.square().sum() if i == 0 else o.sum() for i, o in enumerate(outs))

    ref = run(q, k, v)
    ref_grads = torch.autograd.grad(loss(ref), (q, k, v))
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(case.get("compiler", "aot_eager"))
    got = torch.compile(run, backend=counter, fullgraph=True)(q, k, v)
    grads = torch.autograd.grad(loss(got), (q, k, v))
    assert counter.frame_count == 1
    for a, r in zip((*got, *grads), (*ref, *ref_grads)):
        assert a.shape == r.shape and a.dtype == r.dtype
        assert torch.equal(a, r)


def test_compiled_varlen_equals_eager():
    torch.manual_seed(0)
    q = torch.randn(30, 4, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(25, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))

    def run(q, k, v):
        return ringlse.varlen_attention(q, k, v, [0, 10, 30], [0, 5, 25], causal=True, return_lse=True)

    ref = run(q, k, v)
    got = torch.compile(run, backend="aot_eager", fullgraph=True)(q, k, v)
    for a, r in zip((*got, *torch.autograd.grad(got[0].sum() + got[1].sum(), (q, k, v))),
                    (*ref, *torch.autograd.grad(ref[0].sum() + ref[1].sum(), (q, k, v)))):
        assert torch.equal(a, r)


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
            assert r[name]["out"] == EXACT and r[name]["grads"] == EXACT, f"rank {rank} {name}: {r[name]}"
        assert "ranks disagree" in r["bad"] and "q shape" in r["bad"], r["bad"]
    assert len({r["bad"] for r in per_rank}) == 1  # the same message on every rank


def test_compiled_head_parallel_ring_equals_eager(tmp_path):
    """Head parallelism x ring (2 x 2) under torch.compile: the eager results bit for bit."""
    for rank, r in enumerate(run_ranks(cw.compiled_head_parallel, 4, tmp_path, timeout=300)):
        assert r["out"] == EXACT and r["grads"] == EXACT, (rank, r)


def _spread(runs) -> float:
    """The largest difference between repeated eager runs (0 for deterministic kernels)."""
    return max((a.float() - b.float()).abs().max().item() for x, y in zip(runs, runs[1:]) for a, b in zip(x, y))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton", "sdpa", "fa4"])
def test_compiled_attention_on_gpu_with_inductor(backend):
    """The op under inductor on CUDA: one graph, the eager forward bit for bit (the same kernels run);
    gradients bit for bit too where the backend's backward is deterministic (eager twice agrees), else
    within eager's own run-to-run spread."""
    if backend not in ringlse.available_backends("cuda", torch.bfloat16) and backend != "auto":
        pytest.skip(f"{backend} is not available here")
    torch.manual_seed(0)
    q = torch.randn(2, 1025, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 1025, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)

    def run(q, k, v):
        return ringlse.attention(q, k, v, causal=True, cu_seqlens=[0, 100, 1025], backend=backend)

    def grads(out):
        return torch.autograd.grad(out, (q, k, v), dout)

    ref = run(q, k, v)
    eager = [grads(ref), grads(run(q, k, v))]
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    got = torch.compile(run, backend=counter, fullgraph=True)(q, k, v)
    assert counter.frame_count == 1
    assert torch.equal(got, ref)
    spread = _spread(eager)
    compiled = grads(got)
    for a, b in zip(compiled, eager[0]):
        assert (a.float() - b.float()).abs().max().item() <= spread, (backend, spread)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["triton", "sdpa", "fa4"])
def test_compiled_ring_on_two_gpus_equals_eager(backend, tmp_path):
    """`ring_attention` compiled (inductor) on 2 GPUs over NCCL: the eager forward bit for bit, gradients
    bit for bit where eager repeats itself exactly, else within eager's own spread."""
    if backend not in ringlse.available_backends("cuda", torch.bfloat16):
        pytest.skip(f"{backend} is not available here")
    for rank, r in enumerate(run_ranks(cw.compiled_ring_gpu, 2, tmp_path, backend, backend="nccl", timeout=300)):
        assert r["frames"] == 1 and r["out"] == 0.0, (rank, r)
        assert r["grads"] <= r["spread"], (rank, r)
