"""The ring's backward pass (CONVENTIONS.md §6): K/V come round again (`ringlse.ring.kv_transport`), dq
stays local, and each block's dk/dv go straight home to its owner (`ringlse.ring.dkv_return`), in
pieces of keys where the op allows it, so what a rank holds stays bounded whatever W (two K/V blocks
and the float32 accumulators). CONVENTIONS.md §6 lets partial sums travel the ring instead; sending
them home costs the same transfers, needs no float32 accumulator per hop, and lets bf16 kernel outputs
travel as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ringlse.blocks.accumulate import GradInputs, GradTarget
from ringlse.blocks.calls import BlockCall
from ringlse.checks import lse_dtype
from ringlse.kv_pack import KVPack
from ringlse.merge import PartSum
from ringlse.ring.call import RingCall
from ringlse.ring.dkv_return import messages_of, dkv_return
from ringlse.ring.kv_transport import KV, kv_transport
from ringlse.ring.plan import key_pieces, piece_size, split_keys

# Ops with `split_backward` send a remote step's float32 dk/dv home in pieces of at most
# n / DKV_PIECES keys, each sent while the next is built: three pieces are alive at once (one being
# built, one each way in flight) instead of three blocks'. Their dq is computed once per step, over all
# keys (pieces with their dq cost 8-10% at W = 2 on 2xH100, without it 3-4%), unless the op adds dq in
# its dk/dv pass (`Capabilities.dq_with_dkdv`: the Hopper kernel), which costs nothing more piece by piece.
DKV_PIECES = 4


@dataclass(frozen=True)
class Pieces:
    """How a remote step's gradients are cut. From W = 3, ops with `split_backward` compute dk/dv in
    pieces of keys and dq once per step (`dq_apart`), or with each piece where the op adds it in its
    dk/dv pass; otherwise whole steps: at W = 2 the one remote step's messages fit the memory bound
    whole and pieces cost 3-4% there (2xH100), and cutting the calls of ops that return parts would add
    rounded dq parts (their messages are often in the input dtype)."""

    n: int
    split: bool
    dq_apart: bool

    @classmethod
    def of(cls, call: RingCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Pieces:
        caps = call.op.caps
        split = caps.split_backward and call.comm.world >= 3
        with_dkdv = split and caps.dq_with_dkdv is not None and (
            caps.dq_with_dkdv(q, k, v, softcap=call.softcap) if call.softcap else caps.dq_with_dkdv(q, k, v))
        return cls(q.shape[1], split, split and not with_dkdv)

    def cut(self, plan: Sequence[BlockCall]) -> list[list[BlockCall]]:
        """The calls whose messages travel together, lowest keys first."""
        if self.split:
            return key_pieces(plan, self.n, DKV_PIECES)
        return [list(plan)] if plan else []


def ring_backward(call: RingCall, g: GradInputs, k: torch.Tensor, v: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of this rank's shards, in the input dtype.

    Each rank attends its queries to every K/V block as the blocks come round the ring (as in the
    forward) and sends the dk/dv it computed for block j straight to rank j, piece by piece of keys
    (`Pieces`), which adds each message into its float32 dk/dv once its own next piece is built (in
    order; so at most three pieces' messages are alive, whatever W). Rank j's own block is computed in
    two halves of its keys (`split_keys`): the diagonal square (second half) while the first K/V
    transfer is in flight, the first half (three times the work) while the last gradients go home; an
    own block of masked calls, which stays whole, runs last.
    """
    q, comm, acc = g.q, call.comm, call.op.accumulation
    pack = KVPack.of(k, v)  # a dk/dv message's shapes: dv has V's head dim
    dq, dk, dv = (PartSum(t.shape, lse_dtype(q.dtype), t.device) for t in (q, k, v))

    def add(calls: Sequence[BlockCall], kv: KV, dq_into: PartSum | None, dk_into: PartSum | None,
            dv_into: PartSum | None, key0: int = 0) -> None:
        for c in calls:
            acc.add_grads(call.op, g, c, kv, c.args(call.scale, call.softcap),
                          dq_into and GradTarget(dq_into, c.q0, c.q1),
                          dk_into and GradTarget(dk_into, c.k0 - key0, c.k1 - key0),
                          dv_into and GradTarget(dv_into, c.k0 - key0, c.k1 - key0))

    def build(messages, kv: KV, with_dq: bool, into: torch.Tensor | None) -> list[torch.Tensor]:
        """Our messages' dk/dv (in `into` where given), dq added locally where `with_dq`."""
        built = []
        for m in messages:
            dk_m, dv_m = acc.message(pack.rows(m.k1 - m.k0), m.dtype, q.device, into)
            add(m.calls, kv, dq if with_dq else None, dk_m, dv_m, m.k0)
            built += [dk_m.result(m.dtype), dv_m.result(m.dtype)]
        return built

    if comm.world == 1:
        add(call.plans[0], (k, v), dq, dk, dv)
        return dq.result(q.dtype), dk.result(k.dtype), dv.result(v.dtype)
    keys_low, keys_high = split_keys(call.plans[0], q.shape[1] // 2)
    # the own block's part run first and its part run last; a masked own block stays whole (`split_keys`)
    # and, where this rank sends dk/dv home, runs last, while those messages travel (run first, nothing
    # hid the last ones); a rank that sends none runs it first, while the host walks the empty steps
    sends = any(call.plans[1:])
    own_first, own_last = (keys_high, keys_low) if keys_low or not sends else ([], keys_high)
    moves = kv_transport(call, k, v)
    pieces = Pieces.of(call, q, k, v)
    returns = dkv_return(call, k, v, pieces.split, piece_size(q.shape[1], DKV_PIECES))
    try:
        for s, kv in moves.blocks("backward"):
            if s == 0:
                add(own_first, (k, v), dq, dk, dv)
                continue
            # rank (rank + s) mod W attends to our K/V at its step s: its calls say what comes back, piece
            # by piece as ours go (both ends cut the same plan the same way, so messages pair in order)
            dst, src = (comm.rank - s) % comm.world, (comm.rank + s) % comm.world
            mine, theirs = pieces.cut(call.plans[s]), pieces.cut(call.peer_plans[s])
            for i in range(max(len(mine), len(theirs))):
                ours = messages_of(call, mine[i] if i < len(mine) else [], q, k)
                built = build(ours, kv, not pieces.dq_apart, returns.slot(i, ours, s))
                sent = returns.send(i, dst, ours, built)
                del built
                returns.settle(dk, dv)  # the previous piece's transfers ran while this one was built
                returns.post(i, s, dst, sent, src, messages_of(call, theirs[i] if i < len(theirs) else [], q, k))
                del sent  # the return holds what was sent until it settles
            if pieces.dq_apart:  # the last piece's messages travel meanwhile
                add(call.plans[s], kv, dq, None, None)
        add(own_last, (k, v), dq, dk, dv)
        returns.settle(dk, dv)
        returns.finish()
    except BaseException:
        returns.release()  # none of our streams may wait on for a peer that is gone
        raise
    return dq.result(q.dtype), dk.result(k.dtype), dv.result(v.dtype)
