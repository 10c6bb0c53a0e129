"""Ring attention (DESIGN §6): exact attention over a sequence sharded across the ranks of a group.

Forward, W steps: post the exchange of the current K/V (one packed buffer) with the ring neighbours,
attend the local queries to the held K/V (merging into float32 accumulators inside the block op),
wait, swap buffers. Backward reuses the global `out`/`lse`, computes `delta` once, accumulates `dq`
locally and lets partial `dk`/`dv` sums travel one hop behind their K/V until they arrive home,
where the rank's own block, split in two, hides the first and the last transfer. The block op is
a parameter, so the same loop runs on gloo/CPU and NCCL/GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringlse.backends import get_block_op
from ringlse.blockop import BlockOp
from ringlse.layouts import LAYOUTS, BlockCall, check_layout, default_layout, plan_step
from ringlse.positions import BlockKind, block_kind
from ringlse.reference import lse_dtype
from ringlse.ring_comm import RingComm
from ringlse.validation import SUPPORTED_DTYPES, check_qkv

_KV_TAG, _DKV_TAG = 1, 2


def _plans(layout: str, comm: RingComm, n: int, causal: bool) -> list[list[BlockCall]]:
    """plans[s]: the block calls of step s, whose K/V came from rank (rank - s) mod W."""
    return [plan_step(layout, comm.rank, (comm.rank - s) % comm.world, comm.world, n, causal) for s in range(comm.world)]


def _ring_forward(q, k, v, op: BlockOp, scale: float, comm: RingComm, plans, check) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 0 (the own block) is queued before `check()` waits for the ranks' agreement, and the
    first K/V transfer waits only for the packed K/V, so neither the agreement nor the first
    transfer leaves the GPU idle."""
    b, n, h, d = q.shape
    acc = lse_dtype(q.dtype)
    out = torch.zeros((b, n, h, d), dtype=acc, device=q.device)
    lse = torch.full((b, h, n), float("-inf"), dtype=acc, device=q.device)
    kv = torch.stack([k, v])  # one contiguous buffer per step: a single send and a single receive
    kv_next = torch.empty_like(kv)
    ready = None
    if kv.device.type == "cuda" and comm.world > 1:
        ready = torch.cuda.Event()
        ready.record()

    def attend(plan, kv):
        for c in plan:
            op.forward(
                q[:, c.q0:c.q1], kv[0, :, c.k0:c.k1], kv[1, :, c.k0:c.k1], softmax_scale=scale,
                causal=c.causal, q_start=c.q_start, k_start=c.k_start,
                out_acc=out[:, c.q0:c.q1], lse_acc=lse[:, :, c.q0:c.q1],
            )

    attend(plans[0][:1], kv)
    check()  # every rank raises here on bad or mismatched inputs, before any K/V moves
    works = comm.exchange(kv, kv_next, _KV_TAG, ready=ready) if comm.world > 1 else []
    attend(plans[0][1:], kv)
    for s in range(1, comm.world):
        comm.wait(works)
        kv, kv_next = kv_next, kv  # K/V of rank (rank - s) mod W
        works = comm.exchange(kv, kv_next, _KV_TAG) if s + 1 < comm.world else []
        attend(plans[s], kv)
    return out, lse


def _split_rows(plan: list[BlockCall], m: int) -> tuple[list[BlockCall], list[BlockCall]]:
    """The calls of `plan` restricted to local query rows `[0, m)` and `[m, n)`, keys trimmed to what
    those rows can see (a causal piece may become full or vanish)."""
    halves: tuple[list[BlockCall], list[BlockCall]] = ([], [])
    for c in plan:
        for half, (a, b) in zip(halves, ((c.q0, min(c.q1, m)), (max(c.q0, m), c.q1))):
            if a >= b:
                continue
            q_start = c.q_start + (a - c.q0)
            k1 = c.k1
            if c.causal:  # row i sees local key j iff k_start + j <= q_start + i
                k1 = min(k1, c.k0 + max(0, q_start + (b - a) - c.k_start))
            kind = block_kind(b - a, k1 - c.k0, q_start, c.k_start, c.causal)
            if kind is BlockKind.EMPTY:
                continue
            partial = kind is BlockKind.PARTIAL
            half.append(BlockCall(a, b, c.k0, k1, partial, q_start if partial else 0, c.k_start if partial else 0))
    return halves


def _ring_backward(dout, q, k, v, out, lse, delta, lse_grad, op: BlockOp, scale: float, comm: RingComm, plans):
    """dq, dk, dv of this rank's shards.

    The partial dk/dv of K/V block j travel j+1 -> j+2 -> ... -> j-1 -> j, each holder adding its
    part, one hop behind the K/V. Block j's own part is computed at home, in two halves of its query
    rows: the first while the first K/V exchange is in flight, the second while the partial sums make
    their last hop home, so neither transfer waits on an idle GPU.
    """
    acc = lse_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv_own = torch.stack([k, v])
    dkv_home = torch.zeros(kv_own.shape, dtype=acc, device=q.device)

    def attend(plan, kv, dkv):
        for c in plan:
            op.backward(
                dout[:, c.q0:c.q1], q[:, c.q0:c.q1], kv[0, :, c.k0:c.k1], kv[1, :, c.k0:c.k1],
                out[:, c.q0:c.q1], lse[:, :, c.q0:c.q1], None if delta is None else delta[:, :, c.q0:c.q1],
                softmax_scale=scale,
                causal=c.causal, q_start=c.q_start, k_start=c.k_start,
                dq_acc=dq[:, c.q0:c.q1], dk_acc=dkv[0, :, c.k0:c.k1], dv_acc=dkv[1, :, c.k0:c.k1],
                lse_grad=None if lse_grad is None else lse_grad[:, :, c.q0:c.q1],
            )

    if comm.world == 1:
        attend(plans[0], kv_own, dkv_home)
        return dq, dkv_home[0], dkv_home[1]
    own_first, own_last = _split_rows(plans[0], q.shape[1] // 2)
    kv_bufs = [torch.empty_like(kv_own) for _ in range(2)]
    kv_works = comm.exchange(kv_own, kv_bufs[1], _KV_TAG)
    attend(own_first, kv_own, dkv_home)
    # two buffers for the partial dk/dv a step adds (one may still be in flight to rank+1) and one
    # that receives the partial sums of the K/V we hold next from rank-1
    dkv_bufs = [torch.empty(kv_own.shape, dtype=acc, device=q.device) for _ in range(2)]
    dkv_recv = torch.empty_like(dkv_bufs[0])
    dkv_works: list = []
    for s in range(1, comm.world):
        comm.wait(kv_works)
        kv = kv_bufs[s % 2]  # K/V of rank (rank - s) mod W
        kv_works = comm.exchange(kv, kv_bufs[(s + 1) % 2], _KV_TAG) if s + 1 < comm.world else []
        dkv = dkv_bufs[s % 2]
        dkv.zero_()
        attend(plans[s], kv, dkv)
        if s > 1:
            # what earlier holders of this K/V added arrived while we computed; add it after
            comm.wait(dkv_works)
            dkv += dkv_recv
        dkv_works = comm.exchange(dkv, dkv_recv, _DKV_TAG)
    attend(own_last, kv_own, dkv_home)
    comm.wait(dkv_works)  # the other W-1 ranks' parts of our own K/V's gradients
    dkv_home += dkv_recv
    return dq, dkv_home[0], dkv_home[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, op: BlockOp, scale: float, comm: RingComm, plans, check):
        ctx.set_materialize_grads(False)  # an unused lse gets None, not a zero gradient
        out_acc, lse = _ring_forward(q, k, v, op, scale, comm, plans, check)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (op, scale, comm, plans)
        return out, lse

    @staticmethod
    def backward(ctx, g_out, g_lse):
        q, k, v, out, lse = ctx.saved_tensors
        op, scale, comm, plans = ctx.args
        g_out, delta, lse_grad = op.backward_inputs(g_out, g_lse, out)
        dq, dk, dv = _ring_backward(g_out, q, k, v, out, lse, delta, lse_grad, op, scale, comm, plans)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


_LAYOUT_CODES = {name: i for i, name in enumerate(LAYOUTS)}
_DTYPE_CODES = {dt: i for i, dt in enumerate(SUPPORTED_DTYPES)}


def _local_error(q, k, v, layout: str, comm: RingComm) -> str | None:
    """Everything a rank can check alone, as a message instead of an exception, so that every rank
    still reaches the agreement collective and raises together."""
    try:
        check_qkv(q, k, v, "ring_attention")
        if q.shape[1] != k.shape[1]:
            raise ValueError(f"ring_attention: local q and k/v lengths differ ({q.shape[1]} vs {k.shape[1]}); "
                             "each rank must hold the same positions of q, k and v")
        check_layout(layout, q.shape[1] * comm.world, comm.world)
        if comm.backend == "nccl" and q.device.type != "cuda":
            raise ValueError(f"ring_attention: the NCCL group needs CUDA tensors, got {q.device}")
        if comm.backend == "gloo" and q.device.type != "cpu":
            raise ValueError(f"ring_attention: the gloo group needs CPU tensors, got {q.device}")
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    layout: str | None = None,
    return_lse: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention over a sequence sharded across the ranks of `group`.

    Args:
        q: this rank's queries `[batch, n, nheads, headdim]` (n = S / W tokens, placed by `layout`).
        k, v: this rank's keys/values `[batch, n, nheads_kv, headdim]` (same positions as q; GQA/MQA
            without repeating K/V).
        causal: causal mask over global positions.
        softmax_scale: defaults to `headdim ** -0.5`.
        group: process group (default: the world; without torch.distributed, a single rank).
        layout: `zigzag` (default when causal), `contiguous` (default otherwise) or `stripe`; use
            `ringlse.shard` to split a full sequence the same way.
        return_lse: also return lse `[batch, nheads, n]` (float32; float64 for float64 inputs).
        backend: block op: `auto` (`triton` on CUDA, `torch` on CPU), `triton`, `sdpa`, `flash`, `torch`.

    Returns:
        This rank's `out` `[batch, n, nheads, headdim]` (q's dtype), or `(out, lse)`. Differentiable:
        autograd returns exact `dq`, `dk`, `dv` for the local shards.

    Raises:
        ValueError: on every rank, before any K/V moves, when a rank's inputs are invalid (shapes,
            dtypes, devices, divisibility) or the ranks disagree on shapes/dtype/options.
    """
    comm = RingComm(group)
    layout = default_layout(causal) if layout is None else layout
    error = _local_error(q, k, v, layout, comm) if layout in LAYOUTS else f"unknown layout {layout!r}; choose one of {LAYOUTS}"
    scale = None
    if error is None:
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
        try:
            op = get_block_op(backend, q.device)
        except ValueError as e:
            error = str(e)
    shapes = [*q.shape, *k.shape] if error is None else [-1] * 8
    meta = [*shapes, _DTYPE_CODES.get(q.dtype, -1) if error is None else -1, int(causal),
            _LAYOUT_CODES.get(layout, -1), round((scale or 0.0) * 2**30)]
    check = comm.post_agreement(meta, error)
    if error is not None:
        check()  # raises on every rank; the others raise in their check() below
    plans = _plans(layout, comm, q.shape[1], causal)
    out, lse = _RingAttention.apply(q, k, v, op, scale, comm, plans, check)
    return (out, lse) if return_lse else out
