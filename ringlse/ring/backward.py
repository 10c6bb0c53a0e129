"""The ring's backward pass (`ring_backward`), CONVENTIONS.md §6: K/V come round again, dq stays local,
and each block's dk/dv go straight home to its owner, in pieces of keys where the op allows it, so
what a rank holds stays bounded whatever W (issue 31's memory bound: two K/V blocks and the float32
accumulators). The loop and the forward are `ringlse.ring.loop`.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch

from ringlse.blocks.contract import BlockCall, BlockOp
from ringlse.checks import lse_dtype
from ringlse.merge import PartSum, sum_parts
from ringlse.ring.comm import RingComm
from ringlse.ring.plan import Route, key_pieces, split_keys
from ringlse.ring.transport import DKV_TAG, held_blocks, own_kv

# Ops with `split_backward` send a remote step's float32 dk/dv home in pieces of at most
# n / DKV_PIECES keys, each sent while the next is built: three pieces are alive at once (one being
# built, one each way in flight) instead of three blocks' (issue 31's memory bound; NOTES.md). Their
# dq is computed once per step, over all keys (pieces with their dq cost 8-10% at W = 2 on 2xH100,
# without it 3-4%, `dkv_pieces-2xNVIDIA_H100_80GB_HBM3.json`), unless the op adds dq in its dk/dv pass
# (`BlockOp.dq_with_dkdv`: the Hopper kernel), which costs nothing more piece by piece.
DKV_PIECES = 4


def message_dtype(op: BlockOp, call: BlockCall, q: torch.Tensor, k: torch.Tensor, with_lse: bool) -> torch.dtype:
    """The dtype a block call's dk/dv parts travel home in. Both ends derive it from the plan and the
    agreed inputs, so a receiver knows every message's size and dtype without being told.

    An op that returns parts gives a full block without GQA group sums and without an lse-gradient
    term (possible only when the lse is returned) as one kernel output in the input dtype: sent as it
    is, exact. Anything else is summed (or accumulated) in float32 and travels so."""
    if op.backward_parts is not None and not call.causal and q.shape[2] == k.shape[2] and not with_lse:
        return k.dtype
    return lse_dtype(q.dtype)


def ring_backward(dout, q, k, v, out, lse, delta, lse_grad, op: BlockOp, scale: float, comm: RingComm, plans,
                  peer_plans, route: Route, with_lse: bool, pull: bool, limit: datetime.timedelta | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of this rank's shards, in the input dtype.

    Each rank attends its queries to every K/V block as the blocks come round the ring (as in the
    forward) and sends the dk/dv it computed for block j straight to rank j (from W = 3, piece by
    piece of keys where the op allows: `DKV_PIECES`), which adds each message into its float32 dk/dv
    once the next piece is built (in order; so at most three pieces' messages are alive, whatever W).
    Ops that return their gradients as tensors
    (`backward_parts`: cuDNN, flash-attn) send those as they are, so no float32 accumulator is ever
    read and rewritten per block; ops that accumulate in-kernel add into float32 buffers that are sent
    instead. Rank j's own block is computed in two halves of its keys (`split_keys`): the first while
    the first K/V transfer is in flight, the second while the last gradients are on their way home.
    """
    acc = lse_dtype(q.dtype)
    b, n, h, d = q.shape
    hkv = k.shape[2]
    dq, dk, dv = PartSum(q.shape, acc, q.device), PartSum(k.shape, acc, k.device), PartSum(v.shape, acc, v.device)

    def call_args(c: BlockCall, kv: torch.Tensor) -> tuple[tuple, dict]:
        rows = slice(c.q0, c.q1)
        args = (dout[:, rows], q[:, rows], kv[0][:, c.k0:c.k1], kv[1][:, c.k0:c.k1], out[:, rows], lse[:, :, rows],
                None if delta is None else delta[:, :, rows])
        kw = dict(softmax_scale=scale, **c.block_args(),
                  lse_grad=None if lse_grad is None else lse_grad[:, :, rows])
        return args, kw

    def attend_own(plan: Sequence[BlockCall]) -> None:
        for c in plan:
            args, kw = call_args(c, (k, v))
            if op.backward_parts is None:
                op.backward(*args, **kw, dq_acc=dq.accumulator()[:, c.q0:c.q1],
                            dk_acc=dk.accumulator()[:, c.k0:c.k1], dv_acc=dv.accumulator()[:, c.k0:c.k1])
                continue
            g = op.backward_parts(*args, **kw)
            for total, parts, offset in ((dq, g.dq, c.q0), (dk, g.dk, c.k0), (dv, g.dv, c.k0)):
                for p in parts:
                    total.add(p, offset)

    def attend_remote(plan: Sequence[BlockCall], kv: torch.Tensor, with_dq: bool) -> list[torch.Tensor]:
        """Attend to a held K/V block; returns the dk, dv messages for its owner, per call (`with_dq`
        False: dk/dv alone, in pieces; `remote_dq` then adds dq)."""
        messages = []
        for c in plan:
            args, kw = call_args(c, kv)
            shape = (b, c.k1 - c.k0, hkv, d)
            if op.backward_parts is None:
                dkv = torch.zeros((2, *shape), dtype=acc, device=q.device)
                op.backward(*args, **kw, dq_acc=dq.accumulator()[:, c.q0:c.q1] if with_dq else None,
                            dk_acc=dkv[0], dv_acc=dkv[1])
                messages += [dkv[0], dkv[1]]
                continue
            g = op.backward_parts(*args, **kw)
            for p in g.dq:
                dq.add(p, c.q0)
            dtype = message_dtype(op, c, q, k, with_lse)
            messages += [sum_parts(shape, g.dk, dtype, q.device, acc), sum_parts(shape, g.dv, dtype, q.device, acc)]
        return messages

    def remote_dq(plan: Sequence[BlockCall], kv: torch.Tensor) -> None:
        """dq of a held K/V block, each call whole, for an op with `split_backward`."""
        for c in plan:
            args, kw = call_args(c, kv)
            op.backward(*args, **kw, dq_acc=dq.accumulator()[:, c.q0:c.q1], dk_acc=None, dv_acc=None)

    if comm.world == 1:
        attend_own(plans[0])
        return dq.result(q.dtype), dk.result(k.dtype), dv.result(v.dtype)
    # the diagonal square (second half of keys) hides the first transfer, the block's first half of
    # keys (three times the work) the gradients' last transfers home
    own_last, own_first = split_keys(plans[0], n // 2)
    kv_own, bufs, ready, pulled = own_kv(comm, k, v, pull, plans, route)
    # dk/dv messages: those of one piece in flight (transfers, what was sent, what comes in, by call)
    # while the next piece is built; waited for once it is built, so the transfers hide behind it and
    # what is alive stays three pieces, whatever W (`DKV_PIECES`); what came in goes into float32 dk/dv.
    in_flight: tuple[list, list[torch.Tensor], list[tuple[BlockCall, torch.Tensor, torch.Tensor]]] | None = None

    def settle() -> None:
        nonlocal in_flight
        if in_flight is None:
            return
        works, _, received = in_flight
        in_flight = None  # the sent tensors go with it
        comm.wait(works, "backward", limit)
        for c, dk_part, dv_part in received:  # in step and piece order: the same sums on every run
            dk.accumulator()[:, c.k0:c.k1] += dk_part
            dv.accumulator()[:, c.k0:c.k1] += dv_part

    def incoming(c: BlockCall) -> list[torch.Tensor]:
        """Buffers for the dk, dv that the peer's call `c` on our K/V sends home."""
        dtype = message_dtype(op, c, q, k, with_lse)
        return [torch.empty((b, c.k1 - c.k0, hkv, d), dtype=dtype, device=q.device) for _ in range(2)]

    # pieces of keys for ops with `split_backward` (dk/dv per piece, dq once per step) from W = 3 on,
    # whole steps otherwise: at W = 2 the one remote step's messages fit the bound whole, and pieces
    # cost 3-4% there (2xH100); cutting the calls of ops that return parts would add rounded dq parts
    # (their messages are often in the input dtype)
    split = op.split_backward and comm.world >= 3
    # dq with each piece where the op adds it in its dk/dv pass (nothing computed twice); otherwise once
    # per step, in a pass of its own
    dq_per_piece = split and op.dq_with_dkdv is not None and op.dq_with_dkdv(q, k, v)

    def pieces(plan: Sequence[BlockCall]) -> list[list[BlockCall]]:
        """The calls whose messages travel together."""
        if split:
            return key_pieces(plan, n, DKV_PIECES)
        return [list(plan)] if plan else []

    for s, kv in held_blocks(comm, (k, v), kv_own, bufs, ready, plans, peer_plans, route, pulled, "backward",
                              limit):
        if s == 0:
            attend_own(own_first)
            continue
        # rank (rank + s) mod W attends to our K/V at its step s: its calls say what comes back, piece
        # by piece as ours go (both ends cut the same plan the same way, so messages pair in order)
        mine, theirs = pieces(plans[s]), pieces(peer_plans[s])
        for i in range(max(len(mine), len(theirs))):
            sent = attend_remote(mine[i], kv, with_dq=not split or dq_per_piece) if i < len(mine) else []
            settle()  # the previous piece's transfers ran while this one was built
            received = [(c, *incoming(c)) for c in theirs[i]] if i < len(theirs) else []
            recvs = [t for _, dk_part, dv_part in received for t in (dk_part, dv_part)]
            works = comm.send_recv(sent, (comm.rank - s) % comm.world, recvs, (comm.rank + s) % comm.world,
                                   DKV_TAG, step=s)
            in_flight = (works, sent, received)
            del works, sent, received, recvs  # in_flight holds them until settle frees them
        if split and not dq_per_piece:  # the last piece's messages travel meanwhile
            remote_dq(plans[s], kv)
    attend_own(own_last)
    settle()
    return dq.result(q.dtype), dk.result(k.dtype), dv.result(v.dtype)
