"""How K/V blocks reach the ranks that read them, for one ring pass (`held_blocks`): copy-engine pulls
within one host (`ringlse.ring.pull`), else point-to-point messages, passed from neighbour to
neighbour, or sent straight from owner to reader (`direct_blocks`) where the route says so
(`ringlse.ring.plan.Route`).

Neighbour passing moves every whole block through every rank, W - 1 steps, because each rank
forwards what it just held. A window shorter than a shard, or short documents, leave most of that
unread: with shards of 8K and window (1024, 0), a contiguous ring reads 1024 rows at step 1 and
nothing after. Direct sends: rank r, at step s, receives the rows `rows_read(plans[s])` of rank
(r - s)'s K/V and sends rank (r + s) the rows of ours that its step s reads (`peer_plans[s]`: the
same plan, computed here), so a message travels only where a call reads it.

Order of direct sends: every rank posts the transfers of each step at the same point of the loop
(the step of the route before it), so any two ranks post their messages to each other, K/V and the
backward's dk/dv, in the same order (NCCL matches point-to-point messages by order). A rank's wait
at step s depends only on its peers having posted step s, which they do after their waits of
earlier steps: no cycle.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Sequence

import torch

from ringlse.blocks.contract import BlockCall
from ringlse.ring.comm import Pending, RingComm, record_event
from ringlse.ring.plan import Route, rows_read
from ringlse.ring.pull import PulledKV

# point-to-point tags, one per kind of message (gloo matches messages by peer and tag)
KV_TAG, DKV_TAG, DIRECT_KV_TAG = 1, 2, 3


def held_blocks(comm: RingComm, own: tuple[torch.Tensor, torch.Tensor], kv_own: torch.Tensor | None,
                bufs: list[torch.Tensor], ready, plans, peer_plans, route: Route, pulled: PulledKV | None,
                phase: str, limit: datetime.timedelta | None) -> Iterator[tuple[int, object]]:
    """Yield `(s, kv)` for s = 0 .. W-1: the K/V of rank (rank - s) mod W once it has arrived
    (`own`, this rank's `(k, v)`, for s = 0, `bufs[s % 3]` after; None where no K/V moved to this
    rank); the caller queues its work on `kv` before asking for the next block. `kv_own` is the packed
    K/V that NCCL sends (None when blocks are pulled: `pulled` packs its own after `ready`). `ready` (a
    CUDA event, None on CPU) is recorded after `kv_own` (if any) is written and `bufs` were allocated:
    transfers wait for it and the events below only, so every earlier user of the buffers' memory
    must be queued before it. Each transfer wait lasts at most `limit` (`RingComm.wait` raises,
    naming `phase`, the step and the peer).

    Block 1's transfer is posted before step 0 is yielded. Block s+1's is posted before block s is
    yielded, waiting only for the last reader of the buffer it fills (an event), not for everything
    queued: with three buffers that reader is step s-2's work, long done, so the transfer starts
    while step s-1 still runs, not when step s's kernels already hold every SM. On one host with
    CUDA, blocks are pulled from their owners by copy engines (`ringlse.kv_pull`), only the rows
    read; otherwise NCCL passes them from neighbour to neighbour, or, where the `route` says so,
    sends only the rows read from owner to reader at the steps some rank reads (`direct_blocks`).
    """
    if comm.world == 1:
        yield 0, own
        return
    if not route.steps:  # no rank reads another's K/V: nothing moves
        yield from ((s, own if s == 0 else None) for s in range(comm.world))
        return
    if pulled is None and route.direct:
        yield from direct_blocks(comm, own, kv_own, bufs, ready, plans, peer_plans, route.steps, phase, limit)
        return
    cuda = own[0].device.type == "cuda"
    last_read = [ready] * 3
    if pulled is not None:
        pulled.publish(limit or comm.timeout())
        if limit is not None:
            pulled.await_published(limit, phase)
        pulled.pull(1, bufs[1], rows_read(plans[1]), ready)
    else:
        works = comm.exchange(kv_own, bufs[1], KV_TAG, ready=ready, step=1)
    yield 0, own
    for s in range(1, comm.world):
        if pulled is not None:
            pulled.wait(s)
        else:
            comm.wait(works, phase, limit)
        kv = bufs[s % 3]
        if s + 1 < comm.world:
            nxt = (s + 1) % 3
            if pulled is not None:
                pulled.pull(s + 1, bufs[nxt], rows_read(plans[s + 1]), last_read[nxt])
            else:
                works = comm.exchange(kv, bufs[nxt], KV_TAG, ready=last_read[nxt], step=s + 1)
        yield s, kv
        if cuda:
            last_read[s % 3] = record_event()
    if pulled is not None:
        pulled.finish()


def own_kv(comm: RingComm, k: torch.Tensor, v: torch.Tensor, pull: bool, plans, route: Route):
    """`(kv_own, bufs, ready, pulled)` for a ring pass over W > 1 ranks: the packed K/V that NCCL
    sends (None when blocks are pulled), the receive buffers (`bufs[s % 3]` gets block s; direct
    sends fill one per step received, in turn), the event transfers wait for, and the `PulledKV` (or
    None). With pulls, K/V are packed on the pull stream, so the compute stream goes straight to its
    own block (which reads `k` and `v` in place). Where no K/V move (`route`), none of them exist."""
    if not route.steps:
        return None, [], None, None
    new = lambda: torch.empty((2, *k.shape), dtype=k.dtype, device=k.device)
    kv_own = None if pull else torch.stack([k, v])
    if route.direct and not pull:  # the own block is sent at every step: no buffer may reuse it
        bufs = [new() for _ in range(min(3, receive_count(plans, route.steps)))]
    else:
        # bufs[0] is used from W = 4 on (block 3); NCCL receives it into the packed own block, whose
        # only reader, the send of step 0, is queued before that receive on the same NCCL stream
        bufs = [(new() if pull else kv_own) if comm.world >= 4 else None, new(), new() if comm.world >= 3 else None]
    ready = record_event() if k.is_cuda else None
    return kv_own, bufs, ready, PulledKV(comm, k, v, ready) if pull else None


def row_views(kv: torch.Tensor, rows: tuple[int, int]) -> list[torch.Tensor]:
    """Rows `[k0, k1)` of a packed K/V `[2, b, n, hkv, d]` as contiguous views, one per K/V and
    sequence (point-to-point messages are contiguous; the rows of a batch of sequences are not)."""
    k0, k1 = rows
    return [kv[i, j, k0:k1] for i in range(2) for j in range(kv.shape[1])] if k1 > k0 else []


def receive_count(plans: Sequence[Sequence[BlockCall]], steps: Sequence[int]) -> int:
    """How many of the route's steps this rank receives K/V at (its buffers: at most three)."""
    return sum(1 for s in steps if plans[s])


def direct_blocks(comm: RingComm, own, kv_own: torch.Tensor, bufs: list[torch.Tensor], ready,
                  plans, peer_plans, steps: Sequence[int], phase: str,
                  limit: datetime.timedelta | None) -> Iterator[tuple[int, object]]:
    """Yield `(s, kv)` for s = 0 .. W-1 like `held_blocks`: `own` at s = 0, the buffer holding the
    rows this rank reads of rank (rank - s)'s K/V, or None where it reads none.

    `kv_own`: this rank's packed K/V, written before `ready` (a CUDA event, None on CPU), read by the
    sends of every step. `bufs`: `receive_count` buffers at most three, used in turn; a step's
    transfer is posted while the route's step before it is yielded and waits only for the last
    reader of the buffer it fills (three buffers back), as the neighbour transport does. Each wait
    lasts at most `limit` (`RingComm.wait` raises, naming `phase`, the step and the peer)."""
    cuda = own[0].device.type == "cuda"
    last_read = [ready] * len(bufs)
    following = dict(zip((0, *steps), steps))  # a step of the route -> the next one, posted at it
    posted: dict[int, tuple[list[Pending], int | None]] = {}
    received = 0
    for s in range(comm.world):
        works, slot = posted.pop(s, ([], None))
        comm.wait(works, phase, limit)
        if s in following:
            t = following[s]
            into = received % len(bufs) if plans[t] else None
            received += into is not None
            after = ready if into is None else last_read[into]
            posted[t] = _post_direct(comm, t, kv_own, None if into is None else bufs[into], plans, peer_plans,
                                     after), into
        yield s, own if s == 0 else (None if slot is None else bufs[slot])
        if cuda and slot is not None:
            last_read[slot] = record_event()


def _post_direct(comm: RingComm, t: int, kv_own: torch.Tensor, buf: torch.Tensor | None, plans, peer_plans,
                 after) -> list[Pending]:
    """Post step t: the rows rank (rank + t) reads of our K/V to it, the rows we read of rank
    (rank - t)'s into `buf` (None: we read none), once `after` has happened."""
    sends = row_views(kv_own, rows_read(peer_plans[t]))
    recvs = [] if buf is None else row_views(buf, rows_read(plans[t]))
    return comm.send_recv(sends, (comm.rank + t) % comm.world, recvs, (comm.rank - t) % comm.world,
                          DIRECT_KV_TAG, step=t, ready=after)
