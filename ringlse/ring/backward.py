"""The ring's backward pass (`ring_backward`), CONVENTIONS.md §6: K/V come round again, dq stays local,
and each block's dk/dv go straight home to its owner, in pieces of keys where the op allows it, so
what a rank holds stays bounded whatever W (the memory bound: two K/V blocks and the float32
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
from ringlse.ring.dkv_pull import PulledMessages
from ringlse.ring.plan import Route, key_pieces, key_span, piece_size, split_keys
from ringlse.ring.transport import DKV_TAG, held_blocks, own_kv

# Ops with `split_backward` send a remote step's float32 dk/dv home in pieces of at most
# n / DKV_PIECES keys, each sent while the next is built: three pieces are alive at once (one being
# built, one each way in flight) instead of three blocks' (the memory bound of CONVENTIONS.md). Their
# dq is computed once per step, over all keys (pieces with their dq cost 8-10% at W = 2 on 2xH100,
# without it 3-4%), unless the op adds dq in its dk/dv pass
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

    def attend_remote(calls: Sequence[BlockCall], kv: torch.Tensor, with_dq: bool,
                      message: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Attend to a held K/V block; returns the dk/dv messages for its owner (`with_dq` False: dk/dv
        alone, in pieces; `remote_dq` then adds dq). Ops that accumulate add every call into one
        `[2, b, rows, hkv, d]` message over the calls' keys (`key_span`; `message`: where, zeroed);
        ops that return parts send a dk and a dv per call."""
        if op.backward_parts is None:
            k0, k1 = key_span(calls)
            if message is None:
                message = torch.zeros((2, b, k1 - k0, hkv, d), dtype=acc, device=q.device)
            for c in calls:
                args, kw = call_args(c, kv)
                op.backward(*args, **kw, dq_acc=dq.accumulator()[:, c.q0:c.q1] if with_dq else None,
                            dk_acc=message[0][:, c.k0 - k0:c.k1 - k0], dv_acc=message[1][:, c.k0 - k0:c.k1 - k0])
            return [message[0], message[1]]
        out = []
        for c in calls:
            args, kw = call_args(c, kv)
            shape = (b, c.k1 - c.k0, hkv, d)
            g = op.backward_parts(*args, **kw)
            for p in g.dq:
                dq.add(p, c.q0)
            dtype = message_dtype(op, c, q, k, with_lse)
            out += [sum_parts(shape, g.dk, dtype, q.device, acc), sum_parts(shape, g.dv, dtype, q.device, acc)]
        return out

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
    kv_own, bufs, ready, pulled_kv = own_kv(comm, k, v, pull, plans, route)
    # dk/dv messages: those of one piece in flight (NCCL transfers, what was sent, copy-engine pulls, and
    # what comes in as `(k0, k1, dk, dv)`) while the next piece is built; waited for once it is built, so
    # the transfers hide behind it and what is alive stays three pieces, whatever W (`DKV_PIECES`); what
    # came in goes into float32 dk/dv.
    in_flight: tuple | None = None

    def settle() -> None:
        nonlocal in_flight
        if in_flight is None:
            return
        works, _, pulls, received = in_flight
        in_flight = None  # the sent tensors go with it
        comm.wait(works, "backward", limit)
        for arrived in pulls:
            torch.cuda.current_stream().wait_event(arrived)
        for k0, k1, dk_part, dv_part in received:  # in step and piece order: the same sums on every run
            dk.accumulator()[:, k0:k1] += dk_part
            dv.accumulator()[:, k0:k1] += dv_part

    def incoming(calls: Sequence[BlockCall]) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """Buffers `(k0, k1, dk, dv)` for what the peer's `calls` on our K/V send home by NCCL."""
        if op.backward_parts is None:
            k0, k1 = key_span(calls)
            buf = torch.empty((2, b, k1 - k0, hkv, d), dtype=acc, device=q.device)
            return [(k0, k1, buf[0], buf[1])]
        return [(c.k0, c.k1, *(torch.empty((b, c.k1 - c.k0, hkv, d), dtype=message_dtype(op, c, q, k, with_lse),
                                           device=q.device) for _ in range(2))) for c in calls]

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

    # float32 messages of pieces pulled home by copy engines where K/V are (`ringlse.ring.dkv_pull`);
    # every rank makes the same choice (the agreed inputs and transport), and the workspace is collective
    messages = PulledMessages(comm, k, piece_size(n, DKV_PIECES), acc, limit) \
        if pull and split and op.backward_parts is None else None

    def span_rows(calls: Sequence[BlockCall]) -> int:
        k0, k1 = key_span(calls)
        return k1 - k0

    def by_copy(calls: Sequence[BlockCall]) -> bool:
        """Whether a piece's message goes by copy engine (both ends decide it from the same calls)."""
        return messages is not None and bool(calls) and messages.fits(span_rows(calls))

    try:
        for s, kv in held_blocks(comm, (k, v), kv_own, bufs, ready, plans, peer_plans, route, pulled_kv, "backward",
                                  limit):
            if s == 0:
                attend_own(own_first)
                continue
            # rank (rank + s) mod W attends to our K/V at its step s: its calls say what comes back, piece
            # by piece as ours go (both ends cut the same plan the same way, so messages pair in order)
            dst, src = (comm.rank - s) % comm.world, (comm.rank + s) % comm.world
            mine, theirs = pieces(plans[s]), pieces(peer_plans[s])
            for i in range(max(len(mine), len(theirs))):
                calls = mine[i] if i < len(mine) else []
                with_dq = not split or dq_per_piece
                if by_copy(calls):
                    attend_remote(calls, kv, with_dq, messages.message(i, span_rows(calls), s))
                    messages.send(i, dst)
                    sent = []
                else:
                    sent = attend_remote(calls, kv, with_dq) if calls else []
                settle()  # the previous piece's transfers ran while this one was built
                calls = theirs[i] if i < len(theirs) else []
                pulls, received = [], []
                if by_copy(calls):
                    k0, k1 = key_span(calls)
                    buf, arrived = messages.receive(i, src, k1 - k0, s)
                    pulls, received = [arrived], [(k0, k1, buf[0], buf[1])]
                elif calls:
                    received = incoming(calls)
                recvs = [t for *_, dk_part, dv_part in received for t in (dk_part, dv_part)] if not pulls else []
                works = comm.send_recv(sent, dst, recvs, src, DKV_TAG, step=s)
                in_flight = (works, sent, pulls, received)
                del works, sent, received, recvs  # in_flight holds them until settle frees them
            if split and not dq_per_piece:  # the last piece's messages travel meanwhile
                remote_dq(plans[s], kv)
        attend_own(own_last)
        settle()
        if messages is not None:
            messages.finish()
    except BaseException:
        if messages is not None:  # none of our streams may wait on for a peer that is gone
            messages.release()
        raise
    return dq.result(q.dtype), dk.result(k.dtype), dv.result(v.dtype)
