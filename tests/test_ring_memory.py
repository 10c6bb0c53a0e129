"""What the ring adds to a rank's memory: each rank's peak of live tensor bytes over the
forward and backward of `ring_attention` against the single-device `ringlse.attention` on the same
local shapes, on gloo ranks (`live_bytes.LiveBytes`: CPU keeps no allocator statistics), float32,
causal, W = 2, 3, 4, contiguous and zigzag, MHA, GQA and a V head dim other than Q/K's (MLA). The
bound allows two K/V blocks and the float32 accumulators; this version holds three K/V buffers and
three pieces of dk/dv messages (a quarter block of keys each), nothing that grows with W (the
accounting test), and stays within it. The GPU counterpart, with `torch.cuda.max_memory_allocated`, is
benchmarks/memory.py."""

from __future__ import annotations

import gc
import itertools
import math
from typing import NamedTuple

import pytest
import torch

import ringlse
from dist_harness import run_ranks
from live_bytes import LiveBytes
from ringlse.blocks.contract import BlockOp, Capabilities
from ringlse.blocks.torch_math import torch_block_backward, torch_block_forward
from ringlse.ring.backward import DKV_PIECES


class Shape(NamedTuple):
    b: int
    n: int  # tokens per rank
    h: int
    hkv: int
    d: int
    dv: int  # V's head dim


SHAPES = {"mha": Shape(1, 256, 4, 4, 32, 32), "gqa": Shape(1, 256, 4, 1, 32, 32), "mla": Shape(1, 256, 4, 2, 32, 16)}
LAYOUTS = ("contiguous", "zigzag")
F32 = 4  # bytes: inputs, accumulators and messages are all float32 here


def kv_block_bytes(s: Shape) -> int:
    """One K/V block as it travels: k and v of one rank, input dtype."""
    return s.b * s.n * s.hkv * (s.d + s.dv) * F32


def accumulator_bytes(s: Shape) -> int:
    """The ring's float32 accumulators: `out` and `lse` (forward); `dq`, `dk`, `dv` (backward)."""
    return (s.b * s.n * s.h * s.dv + s.b * s.h * s.n + s.b * s.n * s.h * s.d + s.b * s.n * s.hkv * (s.d + s.dv)) * F32


def message_bytes(s: Shape) -> int:
    """The float32 dk and dv of one K/V block, as they travel home."""
    return s.b * s.n * s.hkv * (s.d + s.dv) * 4


ROWS = 16  # query rows per call of the `torch` op below


def slack_bytes(s: Shape) -> int:
    """What the ring may add beyond the budget for reasons that are not its buffers: the op merges a
    block into `out_acc` through temporaries (weights, the weighted old and new states, `ROWS` rows
    at a time) that the single-device call, one block returned as it is, never makes, and the
    agreement's and plan's small tensors (a few KiB)."""
    return 4 * s.b * ROWS * s.h * (s.dv + 2) * F32 + 16 * 1024


def budget(s: Shape) -> int:
    """The bound on what the ring adds: two K/V blocks and the float32 accumulators."""
    return 2 * kv_block_bytes(s) + accumulator_bytes(s) + slack_bytes(s)


def _rows(n: int):
    return ((r0, min(n, r0 + ROWS)) for r0 in range(0, n, ROWS))


def _rows_forward(q, k, v, *, q_start, out_acc=None, lse_acc=None, **kw):
    """`torch_block_forward`, `ROWS` query rows at a time, so that its `[rows, keys]` scores stay far
    below a K/V block: the plain op's whole-block scores (several `b * h * n * n` float32 temporaries)
    are larger than everything the ring holds and would hide it in the peak."""
    b, sq, h, d = q.shape
    if out_acc is None:  # a lone call returns its state (the single-device path)
        out, lse = torch.empty((b, sq, h, v.shape[-1]), dtype=q.dtype), torch.empty((b, h, sq), dtype=torch.float32)
        for r0, r1 in _rows(sq):
            out[:, r0:r1], lse[:, :, r0:r1] = torch_block_forward(q[:, r0:r1], k, v, q_start=q_start + r0, **kw)
        return out, lse
    for r0, r1 in _rows(sq):
        torch_block_forward(q[:, r0:r1], k, v, q_start=q_start + r0, out_acc=out_acc[:, r0:r1],
                            lse_acc=lse_acc[:, :, r0:r1], **kw)
    return out_acc, lse_acc


def _rows_backward(dout, q, k, v, out, lse, delta, *, q_start, dq_acc, lse_grad=None, **kw):
    """`torch_block_backward`, `ROWS` query rows at a time (`lse_grad` is in `delta` already)."""
    for r0, r1 in _rows(q.shape[1]):
        rows = slice(r0, r1)
        torch_block_backward(dout[:, rows], q[:, rows], k, v, out[:, rows], lse[:, :, rows], delta[:, :, rows],
                             q_start=q_start + r0, dq_acc=None if dq_acc is None else dq_acc[:, rows], **kw)


ROWS_OP = BlockOp("torch-rows", _rows_forward, _rows_backward, Capabilities(split_backward=True, v_head_dim=True))


def _region(fn, q, k, v, dout) -> dict[str, int]:
    """Peak live bytes of the forward alone and of forward + backward of `fn(q, k, v)`, counted
    from zero at the start (the inputs and `dout` exist before and count nothing)."""
    for t in (q, k, v):
        t.grad = None
    gc.disable()  # a collection inside would free cyclic garbage at a moment that varies from run to run
    try:
        with LiveBytes() as m:
            out = fn(q, k, v)
            forward = m.peak
            out.backward(dout)
            total = m.peak
    finally:
        gc.enable()
    return dict(forward=forward, total=total)


def rank_peaks(rank: int, world: int, cases: list[tuple[str, str]]) -> list[dict]:
    """Per case `(shape id, layout)`: this rank's peaks of the ring and of single-device attention."""
    results = []
    for shape_id, layout in cases:
        s = SHAPES[shape_id]
        gen = torch.Generator().manual_seed(100 * rank + len(results))
        q = torch.randn(s.b, s.n, s.h, s.d, generator=gen).requires_grad_()
        k = torch.randn(s.b, s.n, s.hkv, s.d, generator=gen).requires_grad_()
        v = torch.randn(s.b, s.n, s.hkv, s.dv, generator=gen).requires_grad_()
        dout = torch.randn(s.b, s.n, s.h, s.dv, generator=gen)

        def ring(q, k, v):
            return ringlse.ring_attention(q, k, v, causal=True, layout=layout, backend=ROWS_OP)

        def single(q, k, v):
            return ringlse.attention(q, k, v, causal=True, backend=ROWS_OP)

        with LiveBytes():  # warm-up: the comm, the step plans, and lazy imports on the first call under the
            ring(q, k, v).backward(dout)  # mode, which leave the call's frames in reference cycles
        results.append(dict(ring=_region(ring, q, k, v, dout), single=_region(single, q, k, v, dout)))
    return results


CASES = list(itertools.product(SHAPES, LAYOUTS))
# What this version's ring holds beyond the single-device call, in the backward (its peak): the
# packed own K/V block and two receive buffers (one at W = 2), and three pieces of float32 dk/dv
# messages (one being built, one on its way home, one arriving), each of at most n / DKV_PIECES keys
# from W = 3 on, whole blocks at W = 2 (one remote step). Before, whole blocks' messages travelled at
# every W (5-6 K/V blocks in all for MHA at W >= 3, over the bound), and before that every block's
# stayed until the end.
KV_BUFFERS = {2: 2}  # by W; 3 from W = 3 on
DKV_MESSAGES = {2: 3}  # by W, in blocks; 3 / DKV_PIECES from W = 3 on


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """`measured(W)`: per rank, per case of `CASES`, the peaks of `rank_peaks`; one spawn per W."""
    cache: dict[int, list] = {}

    def get(world: int) -> list:
        if world not in cache:
            cache[world] = run_ranks(rank_peaks, world, tmp_path_factory.mktemp(f"w{world}"), CASES, timeout=120)
        return cache[world]
    return get


def _over(measured, world: int, bound) -> list[str]:
    """Every (rank, case) whose added peak exceeds `bound(shape, world)`, with its figures."""
    failures = []
    for rank, results in enumerate(measured(world)):
        for (shape_id, layout), r in zip(CASES, results):
            s = SHAPES[shape_id]
            added = r["ring"]["total"] - r["single"]["total"]
            line = (f"W={world} rank {rank} {shape_id} {layout}: ring {r['ring']}, single {r['single']} bytes: "
                    f"+{added} = {added / kv_block_bytes(s):.2f} K/V blocks (bound {bound(s, world)})")
            print(line)
            if added > bound(s, world):
                failures.append(line)
    return failures


@pytest.mark.parametrize("world", [2, 3, 4], ids=lambda w: f"W{w}")
def test_ring_holds_no_more_than_its_buffers_and_messages(world, measured):
    """The accounting above, whatever W: K/V buffers, dk/dv messages, the slack; the float32
    accumulators are the results themselves for float32 inputs, as in the single-device call."""
    def bound(s: Shape, w: int) -> int:
        messages = DKV_MESSAGES.get(w, 3 / DKV_PIECES) * message_bytes(s)
        return int(KV_BUFFERS.get(w, 3) * kv_block_bytes(s) + messages) + slack_bytes(s)
    failures = _over(measured, world, bound)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, 3, 4], ids=lambda w: f"W{w}")
def test_ring_adds_at_most_two_kv_blocks_and_its_accumulators(world, measured):
    """The bound: two K/V blocks and the float32 accumulators (`out`, `lse`, `dq`, `dk`, `dv`)."""
    failures = _over(measured, world, lambda s, w: budget(s))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2], ids=lambda w: f"W{w}")
def test_the_counter_sees_inside_the_ring(world, measured):
    """The ring's forward holds at least one K/V block more than the single-device call (a received
    block): were the ops inside ringlse's custom ops unseen, both would count only their outputs."""
    for rank, results in enumerate(measured(world)):
        for (shape_id, layout), r in zip(CASES, results):
            added = r["ring"]["forward"] - r["single"]["forward"]
            assert added >= kv_block_bytes(SHAPES[shape_id]), (rank, shape_id, layout, r)


def test_live_bytes_counts_storages_once_until_freed():
    """The counter on toy cases: views and in-place ops count nothing, tensors from before the region
    count nothing, a storage counts until its last view goes, and autograd's saved tensors count
    until the backward frees them."""
    outside = torch.randn(1000)
    with LiveBytes() as m:
        a = torch.empty(1000)
        b = a + 1
        view = b[10:].view(-1)
        a.add_(1)
        del a
        c = outside * 2
        outside.mul_(1)
        outside[5:].fill_(0)
    assert (m.peak, m.live) == (8000, 8000)
    del b
    assert m.live == 8000  # `view` still holds b's storage
    del view, c
    assert m.live == 0
    x = torch.randn(256, 256, requires_grad=True)
    block = math.prod(x.shape) * F32
    with LiveBytes() as m:
        y = x.exp()  # saved for the backward
        z = (y * 2).sum()  # the product goes at once
        del y
        assert m.live == block + 4
        z.backward()  # the saved result, its gradient and x.grad at once
    assert m.peak == 3 * block + 4 + 4 and m.live == block + 4  # x.grad and z remain
