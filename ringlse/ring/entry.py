"""Ring attention (CONVENTIONS.md §6): exact attention over a sequence sharded across the ranks of a group.
This module plans a call: checks, the agreement between ranks, and the plan (`RingPlan`) that
`ringlse.ops` runs; the public function is `ringlse.ring.api.ring_attention`, the loops are
`ringlse.ring.forward` and `ringlse.ring.backward`.

Forward (`ringlse.ring.forward`), W steps: post the transfer of the next K/V block, attend the local
queries to the held one (collected as the op's accumulation says: merged into float32 accumulators
inside the op, or kept as parts merged once at the end), wait for the transfer. Backward
(`ringlse.ring.backward`) reuses the global `out`/`lse`, computes `delta` once, brings the K/V round
the ring again, keeps `dq` locally and sends each block's `dk`/`dv` straight to the block's owner
(`ringlse.ring.dkv_return`). The rank's own block hides the first transfer (and, split in two by keys
in the backward, the last one). The block op is a parameter, so the same loops run on gloo/CPU and
NCCL/GPU. How blocks move (`ringlse.ring.kv_transport`): where a window or documents leave steps or
rows unread by every rank, only the rows read go, straight from owner to reader (`kv_route`).

Faults (README "Failure behaviour"): every wait is bounded (`timeout=`, else the group's) and a
failed or late one raises `RuntimeError` naming the phase, the ring step and the peer it waited for
(`RingComm.wait`); nothing is returned unless every block arrived.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ringlse.blocks import get_block_op
from ringlse.blocks.accumulate import GradInputs
from ringlse.blocks.contract import BlockOp, Masks
from ringlse.checks import check_flag, check_qkv, check_scale
from ringlse.masks import Rule, check_docs, check_window
from ringlse.ring.agreement import Agreement, AgreementRow, describe_row
from ringlse.ring.backward import ring_backward
from ringlse.ring.call import RingCall, Transport
from ringlse.ring.comm import RingComm
from ringlse.ring.forward import ring_forward
from ringlse.ring.layout import LAYOUT_NAMES, Layout, check_layout, default_layout, layout_of
from ringlse.ring.plan import kv_route, step_plans
from ringlse.ring.pull import use_copy_engines


class RingPlan:
    """One ring call: forward and backward over the blocks as they come round (`AttentionPlan`)."""

    def __init__(self, call: RingCall, check: Agreement):
        self.call, self.check = call, check

    @property
    def op(self) -> BlockOp:
        return self.call.op

    def forward(self, q, k, v):
        return ring_forward(self.call, q, k, v, self.check)

    def backward(self, dout, q, k, v, out, lse, delta, lse_grad):
        comm = self.call.comm
        comm.check_usable()  # another call on the group may have failed since the forward
        with comm.guard("backward"):
            return ring_backward(self.call, GradInputs(dout, q, out, lse, delta, lse_grad), k, v)


def check_local(q: torch.Tensor, k: torch.Tensor, comm: RingComm) -> None:
    """ValueError unless q and k/v hold the same positions and live on the device kind of `comm`'s
    group (what a ring, and a head group's all-to-all, need of each rank's tensors)."""
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"ring_attention: local q and k/v lengths differ ({q.shape[1]} vs {k.shape[1]}); "
                         "each rank must hold the same positions of q, k and v")
    if comm.backend == "nccl" and q.device.type != "cuda":
        raise ValueError(f"ring_attention: the NCCL group needs CUDA tensors, got {q.device}")
    if comm.backend == "gloo" and q.device.type != "cpu":
        raise ValueError(f"ring_attention: the gloo group needs CPU tensors, got {q.device}")


def _local_rule(q, k, v, layout: str, causal, window_size, cu_seqlens, return_lse, comm: RingComm
                ) -> tuple[Rule | None, Layout | None, str | None]:
    """Everything a rank can check alone, the visibility rule and the layout with what it needs to
    place tokens (`layout_of`), with any error as a message instead of an exception, so that every
    rank still reaches the agreement collective and raises together."""
    try:
        check_qkv(q, k, v, "ring_attention")
        check_flag(causal, "causal", "ring_attention")
        check_flag(return_lse, "return_lse", "ring_attention")
        window = check_window(window_size, "ring_attention")
        docs = check_docs(cu_seqlens, q.shape[1] * comm.world, "ring_attention")
        check_local(q, k, comm)
        placed = layout_of(layout, docs, q.shape[1] * comm.world, "ring_attention")
        check_layout(placed, q.shape[1] * comm.world, comm.world)
    except (ValueError, TypeError) as e:
        return None, None, str(e)
    return Rule(causal, window, docs), placed, None


def check_timeout(timeout) -> datetime.timedelta | None:
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


def ring_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal, softmax_scale, group, layout,
              return_lse, window_size, cu_seqlens, backend, timeout, agree: bool = True,
              local_error: str | None = None, softcap: float = 0.0, head_split: tuple[int, int] = (0, 1)) -> RingPlan:
    """The `AttentionPlan` of one `ring_attention` call (arguments as there), after every check.

    With `agree` (the forward), every rank compares its inputs with the others' (`ValueError` on
    every rank on a mismatch, before any K/V moves); `local_error` is a problem found with this rank's
    options before the plan (`RingSpec.error`'s message), raised the same way. `agree=False` rebuilds the plan of a call whose forward already agreed, for a backward run
    apart from it. `head_split`: this rank's (rank, size) in a head group (`ringlse.ring.head_parallel`),
    which the ranks of the ring must share. Its keywords are `ring_attention`'s public options (more than
    ten: the call's options, which `ringlse.ops` passes through from a `RingSpec`)."""
    comm = RingComm.for_group(group)
    comm.check_usable()
    layout = default_layout(causal is True) if layout is None else layout
    rule, placed, error = _local_rule(q, k, v, layout, causal, window_size, cu_seqlens, return_lse, comm) \
        if layout in LAYOUT_NAMES else (None, None, f"unknown layout {layout!r}; choose one of {LAYOUT_NAMES}")
    if local_error:
        error = local_error
    try:  # every rank of an NCCL group, whatever its inputs: the first call per group is collective
        transport = Transport.COPY_ENGINE if use_copy_engines(comm) else Transport.P2P
    except ValueError as e:
        transport, error = Transport.P2P, error or str(e)
    try:
        limit = check_timeout(timeout)
    except ValueError as e:
        limit, error = None, error or str(e)
    scale, op = None, None
    if error is None:
        try:
            scale = check_scale(softmax_scale, q.shape[-1], "ring_attention")
            # as on one device: documents are cut into plain calls for ops without intervals, windows
            # need intervals or an op taking them as a rule; `auto` and the strided layout take intervals
            windowed, strided = rule.window != (-1, -1), placed == "stripe"
            op = get_block_op(backend, q.device, q.dtype, head_dim=q.shape[-1], softcap=softcap,
                              masked=not rule.plain and (backend == "auto" or strided), window=windowed,
                              v_head_dim=v.shape[-1])
            if not rule.plain and op.caps.masks is not Masks.INTERVALS and (strided or (
                    windowed and op.caps.masks is not Masks.WINDOW)):
                raise ValueError(f"ring_attention: windows and documents in the {placed!r} layout need a backend "
                                 f"that takes intervals; the {op.name!r} block op does not")
        except (ValueError, TypeError) as e:
            error = str(e)
    row = AgreementRow.invalid() if error is not None else AgreementRow.of_call(
        q, k, v, causal, layout, scale, return_lse, transport is Transport.COPY_ENGINE, rule, softcap, head_split)
    if agree:
        check = comm.post_agreement(row.to_row(), error, limit, describe_row)
        if error is not None:
            check()  # raises on every rank; the others raise in their check() below
    else:
        if error is not None:
            raise ValueError(error)
        check = Agreement(lambda: True, lambda: None)
    plans, peer_plans = step_plans(placed, comm.rank, comm.world, q.shape[1], rule, op.caps.masks)
    route = kv_route(placed, comm.world, q.shape[1], rule, op.caps.masks)
    call = RingCall(op, scale, comm, plans, peer_plans, route, transport, return_lse, comm.transfer_limit(limit),
                    softcap)
    return RingPlan(call, check)
