"""How K/V blocks reach the ranks that read them, for one ring pass: one interface (`KVTransport.blocks`)
and its implementations, chosen by `kv_transport`:

- `Stationary`: one rank, or no rank reads another's K/V (a short window): nothing moves;
- `NeighbourKV`: NCCL (gloo on CPU) passes whole blocks from neighbour to neighbour, W - 1 steps;
- `DirectKV`: NCCL sends only the rows a reader's calls read, straight from owner to reader, at the
  steps some rank reads (`ringlse.ring.plan.Route.direct`);
- `CopyEngineKV`: within one host, blocks are pulled from their owners' symmetric memory by copy
  engines, only the rows read (`ringlse.ring.pull.PulledKV`).

Neighbour passing moves every whole block through every rank, because each rank forwards what it
just held. A window shorter than a shard, or short documents, leave most of that unread: with shards
of 8K and window (1024, 0), a contiguous ring reads 1024 rows at step 1 and nothing after. Direct
sends: rank r, at step s, receives the rows `rows_read(plans[s])` of rank (r - s)'s K/V and sends rank
(r + s) the rows of ours that its step s reads (`peer_plans[s]`: the same plan, computed here).

Order of direct sends: every rank posts the transfers of each step at the same point of the loop
(the step of the route before it), so any two ranks post their messages to each other, K/V and the
backward's dk/dv, in the same order (NCCL matches point-to-point messages by order). A rank's wait
at step s depends only on its peers having posted step s, which they do after their waits of
earlier steps: no cycle.

Buffers: a block travels packed in one flat buffer, K's elements then V's, each with its own head dim
(`ringlse.kv_pack.KVPack`), so one message per step carries it. Block s lands in `bufs[s % 3]` (direct
sends use theirs in turn). A transfer waits only for the last reader of the buffer it fills (an event),
not for everything queued: with three buffers that reader is step s-2's work, long done, so the transfer
starts while step s-1 still runs, not when step s's kernels already hold every SM.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ringlse.kv_pack import KVPack
from ringlse.ring.call import RingCall, Transport
from ringlse.ring.comm import Pending, record_event
from ringlse.ring.plan import rows_read
from ringlse.ring.pull import PulledKV

# point-to-point tags, one per kind of message (gloo matches messages by peer and tag)
KV_TAG, DKV_TAG, DIRECT_KV_TAG = 1, 2, 3

KV = tuple[torch.Tensor, torch.Tensor]  # (k, v) of one block (views into its packed buffer, `KVPack`)


class KVTransport:
    """The K/V of one ring pass. Made where the pass starts (packing and buffers are queued then, and
    `ready`, a CUDA event recorded after them, is what transfers wait for: every earlier user of the
    buffers' memory must be queued before it). This base class moves nothing (`Stationary`)."""

    def __init__(self, call: RingCall, k: torch.Tensor, v: torch.Tensor):
        self.call, self.own = call, (k, v)
        self.pack = KVPack.of(k, v)

    def _new(self) -> torch.Tensor:
        """A flat buffer for one packed K/V block (`KVPack`)."""
        k = self.own[0]
        return self.pack.empty(k.dtype, k.device)

    def blocks(self, phase: str) -> Iterator[tuple[int, KV | None]]:
        """Yield `(s, kv)` for s = 0 .. W-1: the K/V of rank (rank - s) mod W once it has arrived (this
        rank's `(k, v)` for s = 0; None where none moved here); the caller queues its work on `kv` before
        asking for the next block. Each wait lasts at most `call.limit` (`RingComm.wait` raises, naming
        `phase`, the step and the peer)."""
        yield 0, self.own
        yield from ((s, None) for s in range(1, self.call.comm.world))

    def abandon(self) -> None:
        """The ranks disagreed before any block moved: let go of what was started."""


class Stationary(KVTransport):
    """One rank, or no rank reads another's K/V: the own block at step 0, None after."""


class _Rotating(KVTransport):
    """Blocks s = 1 .. W-1 in turn into three buffers, block s+1's transfer posted before block s is
    yielded (block 1's before the own block)."""

    def __init__(self, call: RingCall, k: torch.Tensor, v: torch.Tensor, pack: bool):
        super().__init__(call, k, v)
        world = call.comm.world
        self.kv_own = self.pack.pack(k, v) if pack else None
        # bufs[0] is used from W = 4 on (block 3); NCCL receives it into the packed own block, whose only
        # reader, the send of step 0, is queued before that receive on the same NCCL stream
        first = (self.kv_own if pack else self._new()) if world >= 4 else None
        self.bufs = [first, self._new(), self._new() if world >= 3 else None]
        self.views = [None if b is None else self.pack.views(b) for b in self.bufs]  # made once, read every step
        self.ready = record_event() if k.is_cuda else None

    def _post(self, t: int, held: torch.Tensor, into: torch.Tensor, after, phase: str) -> Any:
        """Start block t's transfer of `phase` into `into` once `after` (an event, or None) has happened."""
        raise NotImplementedError

    def _arrive(self, s: int, posted: Any, phase: str) -> None:
        """Make the current stream (or the host) wait for block s."""
        raise NotImplementedError

    def _start(self, phase: str) -> None:
        pass

    def _end(self) -> None:
        pass

    def blocks(self, phase: str) -> Iterator[tuple[int, KV | None]]:
        world = self.call.comm.world
        cuda = self.own[0].device.type == "cuda"
        last_read = [self.ready] * 3
        self._start(phase)
        posted = self._post(1, self.kv_own, self.bufs[1], self.ready, phase)
        yield 0, self.own
        for s in range(1, world):
            self._arrive(s, posted, phase)
            kv = self.bufs[s % 3]
            if s + 1 < world:
                nxt = (s + 1) % 3
                posted = self._post(s + 1, kv, self.bufs[nxt], last_read[nxt], phase)
            yield s, self.views[s % 3]
            if cuda:
                last_read[s % 3] = record_event()
        self._end()


class NeighbourKV(_Rotating):
    """Whole packed blocks sent to rank+1 and received from rank-1 at every step."""

    def __init__(self, call: RingCall, k: torch.Tensor, v: torch.Tensor):
        super().__init__(call, k, v, pack=True)

    def _post(self, t, held, into, after, phase) -> list[Pending]:
        return self.call.comm.exchange(held, into, KV_TAG, ready=after, step=t, phase=phase)

    def _arrive(self, s, posted, phase) -> None:
        self.call.comm.wait(posted, phase, self.call.limit)


class CopyEngineKV(_Rotating):
    """Rows read pulled from the owners' symmetric memory (`PulledKV`); K/V are packed on the pull
    stream, so the compute stream goes straight to its own block (which reads `k` and `v` in place)."""

    def __init__(self, call: RingCall, k: torch.Tensor, v: torch.Tensor):
        super().__init__(call, k, v, pack=False)
        self.pulled = PulledKV(call.comm, k, v, self.ready)

    def _start(self, phase: str) -> None:
        limit = self.call.limit
        self.pulled.publish(limit or self.call.comm.timeout())
        if limit is not None:
            self.pulled.await_published(limit, phase)

    def _post(self, t, held, into, after, phase) -> None:
        self.pulled.pull(t, into, rows_read(self.call.plans[t]), after)

    def _arrive(self, s, posted, phase) -> None:
        self.pulled.wait(s)

    def _end(self) -> None:
        self.pulled.finish()

    def abandon(self) -> None:
        self.pulled.finish()


class DirectKV(KVTransport):
    """The rows each reader reads, straight from owner to reader, at the route's steps only.

    `kv_own`: this rank's packed K/V, read by the sends of every step (so no buffer may reuse it);
    `bufs`: one per step received, at most three, used in turn."""

    def __init__(self, call: RingCall, k: torch.Tensor, v: torch.Tensor):
        super().__init__(call, k, v)
        self.kv_own = self.pack.pack(k, v)
        received = sum(1 for s in call.route.steps if call.plans[s])
        self.bufs = [self._new() for _ in range(min(3, received))]
        self.views = [self.pack.views(b) for b in self.bufs]
        self.ready = record_event() if k.is_cuda else None

    def blocks(self, phase: str) -> Iterator[tuple[int, KV | None]]:
        comm, bufs = self.call.comm, self.bufs
        cuda = self.own[0].device.type == "cuda"
        last_read = [self.ready] * len(bufs)
        steps = self.call.route.steps
        following = dict(zip((0, *steps), steps))  # a step of the route -> the next one, posted at it
        posted: dict[int, tuple[list[Pending], int | None]] = {}
        received = 0
        for s in range(comm.world):
            works, slot = posted.pop(s, ([], None))
            comm.wait(works, phase, self.call.limit)
            if s in following:
                t = following[s]
                into = received % len(bufs) if self.call.plans[t] else None
                received += into is not None
                after = self.ready if into is None else last_read[into]
                posted[t] = self._post(t, None if into is None else bufs[into], after, phase), into
            yield s, self.own if s == 0 else (None if slot is None else self.views[slot])
            if cuda and slot is not None:
                last_read[slot] = record_event()

    def _post(self, t: int, buf: torch.Tensor | None, after, phase: str) -> list[Pending]:
        """Post step t of `phase`: the rows rank (rank + t) reads of our K/V to it, the rows we read of
        rank (rank - t)'s into `buf` (None: we read none), once `after` has happened."""
        comm = self.call.comm
        sends = self.pack.row_views(self.kv_own, rows_read(self.call.peer_plans[t]))
        recvs = [] if buf is None else self.pack.row_views(buf, rows_read(self.call.plans[t]))
        return comm.send_recv(sends, (comm.rank + t) % comm.world, recvs, (comm.rank - t) % comm.world,
                              DIRECT_KV_TAG, step=t, ready=after, phase=phase)


def kv_transport(call: RingCall, k: torch.Tensor, v: torch.Tensor) -> KVTransport:
    """The transport of this rank's K/V for one pass of `call` (the same kind on every rank)."""
    if call.comm.world == 1 or not call.route.steps:
        return Stationary(call, k, v)
    if call.transport is Transport.COPY_ENGINE:
        return CopyEngineKV(call, k, v)
    if call.route.direct:
        return DirectKV(call, k, v)
    return NeighbourKV(call, k, v)
