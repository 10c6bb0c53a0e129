"""Ring attention (CONVENTIONS.md §6): exact attention over a sequence sharded across the ranks of a group.

Forward, W steps: post the exchange of the current K/V (one packed buffer) with the ring neighbours,
attend the local queries to the held K/V (merging into float32 accumulators inside the block op, or,
for ops that return their states as tensors, keeping them as parts merged once at the end), wait,
swap buffers. Backward (`ringlse.ring.backward`) reuses the global `out`/`lse`, computes `delta`
once, brings the K/V round the ring again, keeps `dq` locally and sends each block's `dk`/`dv`
straight to the block's owner (CONVENTIONS.md §6 lets partial sums travel the ring instead; sending
parts home costs the same transfers, needs no float32 accumulator per hop, and lets bf16 kernel
outputs travel as they are). The rank's own block hides the first transfer (and, split in two by
keys in the backward, the last one). The block op is a parameter, so the same loop runs on gloo/CPU
and NCCL/GPU. How blocks move (`ringlse.ring.transport`): where a window or documents leave steps or
rows unread by every rank, only the rows read go, straight from owner to reader (`kv_route`).

Faults (README "Failure behaviour"): every wait is bounded (`timeout=`, else the group's) and a
failed or late one raises `RuntimeError` naming the phase, the ring step and the peer it waited for
(`RingComm.wait`); nothing is returned unless every block arrived.
"""

from __future__ import annotations

import datetime
import hashlib
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ringlse import library
from ringlse.blocks import get_block_op
from ringlse.blocks.contract import BlockOp, StateRows, planned_attention
from ringlse.checks import SUPPORTED_DTYPES, check_flag, check_qkv, check_scale, lse_dtype
from ringlse.masks import Rule, check_docs, check_window
from ringlse.merge import StateMerge
from ringlse.ring.agreement import Agreement
from ringlse.ring.comm import RingComm
from ringlse.ring.backward import ring_backward
from ringlse.ring.plan import LAYOUTS, Route, check_layout, default_layout, kv_route, step_plans
from ringlse.ring.pull import use_copy_engines
from ringlse.ring.transport import held_blocks, own_kv


def _ring_forward(q, k, v, op: BlockOp, scale: float, comm: RingComm, plans, peer_plans, route: Route,
                  check: Agreement, pull: bool, limit: datetime.timedelta | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out, lse)`: out in q's dtype when the op returns its states as parts (merged once at the
    end), else the float32 accumulator the op merged into.

    The packing of K/V is queued first. If by then every rank's part of the agreement is in, `check()`
    returns at once and block 1's transfer is posted before the own block is queued, so the transfer
    overlaps the own block (its launch costs host time: posted after it, a whole first block arrived
    up to 0.8 ms after the own block ended on 4xH200; NOTES.md). Otherwise the own block is queued
    first, so the GPU works while this rank waits for the others."""
    acc = lse_dtype(q.dtype)
    states = StateMerge(q.shape, acc, q.device) if op.forward_parts is not None else None
    rows = StateRows(q.shape, acc, q.device) if states is None else None
    kv_own, bufs, ready, pulled = own_kv(comm, k, v, pull, plans, route) if comm.world > 1 else (None, [], None, None)

    def attend(plan, kv):
        for c in plan:
            qc, kc, vc = q[:, c.q0:c.q1], kv[0][:, c.k0:c.k1], kv[1][:, c.k0:c.k1]
            block = dict(softmax_scale=scale, **c.block_args())
            if states is not None:
                for part in op.forward_parts(qc, kc, vc, **block):
                    states.add(part, c.q0)
            else:
                rows.add(op, qc, kc, vc, c.q0, c.q1, **block)

    own_first = not check.ready()
    if own_first:
        with comm.guard("forward"):  # the others go on once our row is in: a failure here strands them
            attend(plans[0], (k, v))
    try:
        check()  # every rank raises here on bad or mismatched inputs, before any K/V moves
    except BaseException:  # ValueError: the ranks agreed to stop; RuntimeError: a rank did not answer
        if pulled is not None:
            pulled.finish()
        raise
    with comm.guard("forward"):
        for s, held in held_blocks(comm, (k, v), kv_own, bufs, ready, plans, peer_plans, route, pulled,
                                    "forward", limit):
            if s > 0 or not own_first:
                attend(plans[s], held)
    return states.result(q.dtype) if states is not None else rows.result()


class _RingPlan:
    """One ring call: forward and backward over the blocks as they come round (`AttentionPlan`)."""

    def __init__(self, op: BlockOp, scale: float, comm: RingComm, plans, peer_plans, route: Route, with_lse: bool,
                 pull: bool, check: Agreement, limit: datetime.timedelta | None):
        self.op, self.scale, self.comm, self.plans, self.peer_plans = op, scale, comm, plans, peer_plans
        self.route, self.with_lse, self.pull, self.check, self.limit = route, with_lse, pull, check, limit

    def forward(self, q, k, v):
        return _ring_forward(q, k, v, self.op, self.scale, self.comm, self.plans, self.peer_plans, self.route,
                             self.check, self.pull, self.limit)

    def backward(self, dout, q, k, v, out, lse, delta, lse_grad):
        self.comm.check_usable()  # another call on the group may have failed since the forward
        with self.comm.guard("backward"):
            return ring_backward(dout, q, k, v, out, lse, delta, lse_grad, self.op, self.scale, self.comm,
                                  self.plans, self.peer_plans, self.route, self.with_lse, self.pull, self.limit)


_LAYOUT_CODES = {name: i for i, name in enumerate(LAYOUTS)}
_DTYPE_CODES = {dt: i for i, dt in enumerate(SUPPORTED_DTYPES)}


def _local_rule(q, k, v, layout: str, causal, window_size, cu_seqlens, return_lse, comm: RingComm
                ) -> tuple[Rule | None, str | None]:
    """Everything a rank can check alone, and the visibility rule, with any error as a message
    instead of an exception, so that every rank still reaches the agreement collective and raises
    together."""
    try:
        check_qkv(q, k, v, "ring_attention")
        check_flag(causal, "causal", "ring_attention")
        check_flag(return_lse, "return_lse", "ring_attention")
        window = check_window(window_size, "ring_attention")
        docs = check_docs(cu_seqlens, q.shape[1] * comm.world, "ring_attention")
        if q.shape[1] != k.shape[1]:
            raise ValueError(f"ring_attention: local q and k/v lengths differ ({q.shape[1]} vs {k.shape[1]}); "
                             "each rank must hold the same positions of q, k and v")
        check_layout(layout, q.shape[1] * comm.world, comm.world)
        if comm.backend == "nccl" and q.device.type != "cuda":
            raise ValueError(f"ring_attention: the NCCL group needs CUDA tensors, got {q.device}")
        if comm.backend == "gloo" and q.device.type != "cpu":
            raise ValueError(f"ring_attention: the gloo group needs CPU tensors, got {q.device}")
    except (ValueError, TypeError) as e:
        return None, str(e)
    return Rule(causal, window, docs), None


def _check_timeout(timeout) -> datetime.timedelta | None:
    """`timeout` as a positive `timedelta` (None stays None: the group's); ValueError otherwise."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ValueError(f"ring_attention: timeout must be a datetime.timedelta or seconds, got "
                         f"{type(timeout).__name__} {timeout!r}")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"ring_attention: timeout must be positive and finite, got {timeout!r}")
    try:
        return datetime.timedelta(seconds=seconds)
    except OverflowError:
        raise ValueError(f"ring_attention: timeout {timeout!r} is too large for a datetime.timedelta") from None


_META_FIELDS = ("q shape", "k/v shape", "dtype", "causal", "layout", "softmax_scale", "return_lse",
                "K/V transport", "window_size", "documents")


def _describe(meta: Sequence[int]) -> dict[str, str]:
    """The agreement row of `ring_attention` as named fields, for a disagreement's message."""
    if meta[0] < 0:
        return {name: "(invalid)" for name in _META_FIELDS}
    dtype = SUPPORTED_DTYPES[meta[8]] if 0 <= meta[8] < len(SUPPORTED_DTYPES) else meta[8]
    layout = LAYOUTS[meta[10]] if 0 <= meta[10] < len(LAYOUTS) else meta[10]
    values = (tuple(meta[0:4]), tuple(meta[4:8]), dtype, bool(meta[9]), layout, f"{meta[11] / 2**30:.6g}",
              bool(meta[12]), "copy engines" if meta[13] else "point-to-point", tuple(meta[14:16]),
              "none" if meta[16] == 0 else f"{meta[16]} boundaries (digest {meta[17]:014x})")
    return {name: str(value) for name, value in zip(_META_FIELDS, values)}


def _rule_code(rule: Rule | None) -> list[int]:
    """Integers for the agreement that differ when two ranks' windows or documents differ."""
    if rule is None:
        return [-2, -2, -1, 0]
    docs = rule.docs or ()
    digest = hashlib.blake2b(repr(docs).encode(), digest_size=7).digest()
    return [*rule.window, len(docs), int.from_bytes(digest, "little")]


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
    window_size: tuple[int, int] = (-1, -1),
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    backend: str | BlockOp = "auto",
    timeout: datetime.timedelta | float | None = None,
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
        window_size: `(left, right)` at global positions, -1 unbounded (CONVENTIONS.md §10).
        cu_seqlens: document boundaries over the *global* sequence `[0, ..., S]`, the same on every
            rank; documents need no divisibility and may cross ranks in any layout. Windows and
            documents need a backend that takes intervals (`ringlse.available_backends(device,
            masked=True)`; `auto` picks one).
        backend: block op: `auto` (`triton` on CUDA, `torch` on CPU), `triton`, `sdpa`, `flash`, `torch`,
            or a `BlockOp`.
        timeout: the longest any one wait of this call (the agreement, each K/V transfer, each dk/dv
            message, forward and backward) may take, as a `datetime.timedelta` or seconds; default:
            the process group's timeout. On NCCL an explicit one makes the host wait for each
            transfer (`Work.wait(timeout)`); without it the NCCL watchdog enforces the group's.

    Returns:
        This rank's `out` `[batch, n, nheads, headdim]` (q's dtype), or `(out, lse)`. Differentiable:
        autograd returns exact `dq`, `dk`, `dv` for the local shards.

    Raises:
        ValueError: on every rank, before any K/V moves, when a rank's inputs are invalid (shapes,
            dtypes, devices, divisibility, timeout) or the ranks disagree on shapes/dtype/options;
            the same text on every rank, naming every rank's problem.
        RuntimeError: when a rank dies or stalls: every surviving rank, within the timeout, naming
            the phase, the ring step and the peer it waited for; and at once on a group where an
            earlier ring call failed (README "Failure behaviour").
    """
    if isinstance(backend, str) and torch.compiler.is_compiling():  # one `ringlse::ring` op (`ringlse.library`)
        out, lse = library.ring_op(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group,
                                   layout=default_layout(causal is True) if layout is None else layout,
                                   window_size=window_size, cu_seqlens=cu_seqlens, backend=backend, timeout=timeout)
        return (out, lse) if return_lse else out
    ring = ring_plan(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, layout=layout,
                     return_lse=return_lse, window_size=window_size, cu_seqlens=cu_seqlens, backend=backend,
                     timeout=timeout)
    out, lse = planned_attention(q, k, v, ring)
    return (out, lse) if return_lse else out


def ring_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal, softmax_scale, group, layout,
              return_lse, window_size, cu_seqlens, backend, timeout, agree: bool = True) -> _RingPlan:
    """The `AttentionPlan` of one `ring_attention` call (arguments as there), after every check.

    With `agree` (the forward), every rank compares its inputs with the others' (`ValueError` on
    every rank on a mismatch, before any K/V moves). `agree=False` rebuilds the plan of a call whose
    forward already agreed, for a backward run apart from it (the `torch.library` op's)."""
    comm = RingComm.for_group(group)
    comm.check_usable()
    layout = default_layout(causal is True) if layout is None else layout
    rule, error = _local_rule(q, k, v, layout, causal, window_size, cu_seqlens, return_lse, comm) \
        if layout in LAYOUTS else (None, f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    try:  # every rank of an NCCL group, whatever its inputs: the first call per group is collective
        pull = use_copy_engines(comm)
    except ValueError as e:
        pull, error = False, error or str(e)
    try:
        limit = _check_timeout(timeout)
    except ValueError as e:
        limit, error = None, error or str(e)
    scale = None
    if error is None:
        try:
            scale = check_scale(softmax_scale, q.shape[-1], "ring_attention")
            op = get_block_op(backend, q.device, q.dtype, masked=not rule.plain, head_dim=q.shape[-1])
            if not rule.plain and not op.takes_intervals:
                raise ValueError(f"ring_attention: windows and documents need a backend that takes intervals; "
                                 f"the {op.name!r} block op does not")
        except (ValueError, TypeError) as e:
            error = str(e)
    shapes = [*q.shape, *k.shape] if error is None else [-1] * 8
    meta = [*shapes, _DTYPE_CODES.get(q.dtype, -1) if error is None else -1, int(causal is True),
            _LAYOUT_CODES.get(layout, -1), round((scale or 0.0) * 2**30), int(return_lse is True), int(pull),
            *_rule_code(rule if error is None else None)]
    if agree:
        check = comm.post_agreement(meta, error, limit, _describe)
        if error is not None:
            check()  # raises on every rank; the others raise in their check() below
    else:
        if error is not None:
            raise ValueError(error)
        check = Agreement(lambda: True, lambda: None)
    plans, peer_plans = step_plans(layout, comm.rank, comm.world, q.shape[1], rule)
    route = kv_route(layout, comm.world, q.shape[1], rule)
    return _RingPlan(op, scale, comm, plans, peer_plans, route, return_lse, pull, check, comm.transfer_limit(limit))
