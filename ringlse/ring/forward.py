"""The ring's forward pass (CONVENTIONS.md §6): W steps; at each, the held K/V block is attended while
the next one travels (`ringlse.ring.kv_transport`), and the block's state goes into the call's state
the way the op collects it (`BlockOp.accumulation`: merged into float32 accumulators inside the op, or
kept as parts merged once at the end)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ringlse.blocks.calls import BlockCall
from ringlse.checks import lse_dtype
from ringlse.ring.agreement import Agreement
from ringlse.ring.call import RingCall
from ringlse.ring.kv_transport import KV, kv_transport


def ring_forward(call: RingCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, check: Agreement
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out, lse)` of this rank's queries: `out` in q's dtype when the op returns its states as parts,
    else the float32 accumulator the op merged into (callers cast).

    The packing of K/V is queued first. If by then every rank's part of the agreement is in, `check()`
    returns at once and block 1's transfer is posted before the own block is queued, so the transfer
    overlaps the own block (its launch costs host time: posted after it, a whole first block arrived
    up to 0.8 ms after the own block ended on 4xH200). Otherwise the own block is queued first, so the
    GPU works while this rank waits for the others."""
    op, comm = call.op, call.comm
    state = op.accumulation.state(op, (*q.shape[:3], v.shape[-1]), lse_dtype(q.dtype), q.device)
    moves = kv_transport(call, k, v)

    def attend(plan: Sequence[BlockCall], kv: KV | None) -> None:
        for c in plan:
            state.add(q[:, c.q0:c.q1], kv[0][:, c.k0:c.k1], kv[1][:, c.k0:c.k1], c.q0, c.q1,
                      c.args(call.scale, call.softcap))

    own_first = not check.ready()
    if own_first:
        with comm.guard("forward"):  # the others go on once our row is in: a failure here strands them
            attend(call.plans[0], (k, v))
    try:
        check()  # every rank raises here on bad or mismatched inputs, before any K/V moves
    except BaseException:  # ValueError: the ranks agreed to stop; RuntimeError: a rank did not answer
        moves.abandon()
        raise
    with comm.guard("forward"):
        for s, held in moves.blocks("forward"):
            if s > 0 or not own_first:
                attend(call.plans[s], held)
    return state.result(q.dtype)
